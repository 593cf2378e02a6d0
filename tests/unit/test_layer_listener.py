"""The engine calls a per-layer listener, so the server stops a run within one layer of its client leaving."""
from __future__ import annotations

import pytest

from app.context import RequestContext
from app.lifecycle import CancelEvent, RequestCancelled, after_layer
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

    ctx = RequestContext(cancel=event, progress=progress)  # the request's, as the scheduler passes it on
    with on_each_layer(lambda layer, n: after_layer(layer, n, ctx)), pytest.raises(RequestCancelled):
        adapter.run(adapter.encode("the cat sat on the mat"))
    assert layers_run == [1], "layer 1 ran to its end after the client left: the forward was not stopped there"
    # without the cancellation the same listener reports every layer
    layers_run.clear()
    ctx = RequestContext(progress=lambda done, total: layers_run.append(done))
    with on_each_layer(lambda layer, n: after_layer(layer, n, ctx)):
        adapter.run(adapter.encode("the cat sat on the mat"))
    assert layers_run == list(range(1, len(adapter.layer_of) + 1))
