"""adapter.encode_request(request, cached) -> Encoded (issue 20 §2): each text family encodes a request by its own
fields (the route has no isinstance ladder), under the cache key the runtime keys it by, and a field the model cannot
take is a RequestFieldError naming it (the route's 422)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from models.adapters.base import RequestFieldError
from models.adapters.bert import BertAdapter
from models.adapters.causal_lm import CausalLMAdapter
from models.adapters.seq2seq import Seq2SeqAdapter
from tests.tiny_models import build_text_model

TEXT = "the cat sat on the mat because it was tired"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    build = lambda family: str(build_text_model(family, tmp_path_factory.mktemp(family)))  # noqa: E731
    return {"lm": CausalLMAdapter("tl", build("llama"), max_tokens=6, device="cpu"),
            "s2s": Seq2SeqAdapter("tb", build("bart"), max_tokens=6, device="cpu", max_new_tokens=4),
            "enc": BertAdapter("tbert", build("bert"), max_tokens=6, device="cpu")}


def request(**fields):
    return SimpleNamespace(**{"text": TEXT, "text_pair": None, "target": None, "chat": False, "position": None, **fields})


def recording_cache():
    calls = []

    def cached(key, encode):
        calls.append(key)
        return encode()
    return cached, calls


def same(a, b) -> bool:
    return a.key == b.key and a.tokens == b.tokens and a.truncated == b.truncated and all(
        torch.equal(a.inputs[k], b.inputs[k]) for k in a.inputs)


def test_each_family_encodes_its_own_fields_under_the_runtimes_key(adapters):
    lm, s2s, enc = adapters["lm"], adapters["s2s"], adapters["enc"]
    cached, calls = recording_cache()
    got = lm.encode_request(request(position=2), cached)
    assert same(got, lm.encode(TEXT)) and got.extra["position"] == 2
    got = s2s.encode_request(request(target="the dog ran"), cached)
    assert same(got, s2s.encode(TEXT, "the dog ran")) and got.extra["target_tokens"] == s2s.encode(TEXT, "the dog ran").extra["target_tokens"]
    got = enc.encode_request(request(text_pair="a dog ran"), cached)
    assert same(got, enc.encode(TEXT, "a dog ran"))
    assert calls == [("lm", TEXT, False), ("seq2seq", TEXT, "the dog ran"), ("text", TEXT, "a dog ran")]
    # a continuation's request has no position: the last token
    assert lm.encode_request(SimpleNamespace(text=TEXT, chat=False)).extra["position"] == 5


def test_fields_a_model_cannot_take_name_themselves(adapters):
    lm = adapters["lm"]
    with pytest.raises(RequestFieldError) as caught:
        lm.encode_request(request(position=6))  # 6 tokens after truncation: 0 … 5
    assert caught.value.field == "position" and "past the last token (5)" in str(caught.value)
    with pytest.raises(RequestFieldError) as caught:
        lm.encode_request(request(chat=True))  # the tiny model has no chat template
    assert caught.value.field == "chat"


def test_untruncated_tokens_count_the_input_before_max_tokens(adapters):
    for name, adapter in adapters.items():
        encoded = adapter.encode_request(request())
        assert encoded.truncated and len(encoded.tokens) == 6, name
        assert adapter.untruncated_tokens(request()) > 6, name
