"""The engine calls a per-layer listener, so the server stops a run within one layer of its client leaving."""
from __future__ import annotations

import pytest

from app.lifecycle import CancelEvent, RequestCancelled, after_layer, request_cancel, request_progress
from models.adapters.bert import BertAdapter
from models.hooks import on_each_layer


@pytest.fixture(scope="module")
def adapter(tiny_bert):
    return BertAdapter("tiny", str(tiny_bert), max_tokens=64, device="cpu")


def test_listener_hears_every_layer_in_order(adapter):
    heard = []
    with on_each_layer(lambda layer, n: heard.append((layer, n))):
        adapter.run(adapter.encode("the cat sat on the mat"))
    n_layers = len(adapter.layer_of)
    assert heard == [(layer, n_layers) for layer in range(n_layers)]


def test_a_client_that_leaves_mid_forward_stops_it_at_the_next_layer(adapter):
    """The cancel event is set while layer 0 runs: the forward stops before layer 1 (not at its end)."""
    event = CancelEvent()
    layers_run = []

    def progress(done: int, total: int) -> None:
        layers_run.append(done)
        event.set()  # the client leaves while the first layer runs

    cancel_token, progress_token = request_cancel.set(event), request_progress.set(progress)
    try:
        with on_each_layer(after_layer), pytest.raises(RequestCancelled):
            adapter.run(adapter.encode("the cat sat on the mat"))
    finally:
        request_cancel.reset(cancel_token)
        request_progress.reset(progress_token)
    assert layers_run == [1], "layer 1 ran to its end after the client left: the forward was not stopped there"
    # without the cancellation the same listener reports every layer
    layers_run.clear()
    token = request_progress.set(lambda done, total: layers_run.append(done))
    try:
        with on_each_layer(after_layer):
            adapter.run(adapter.encode("the cat sat on the mat"))
    finally:
        request_progress.reset(token)
    assert layers_run == list(range(1, len(adapter.layer_of) + 1))
