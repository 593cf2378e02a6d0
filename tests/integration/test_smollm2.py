"""The real default decoder, smollm2-135m, through attnlab (SPEC §9): the France prompt, exact causal zeros,
parity with eager attention, β moving the prediction, continuations equal to `generate`, and a streamed
generation that stops when its client leaves."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from models.interventions import Intervention
from tests.integration.helpers import cpu_after_leaving, smollm2_adapter

# the real server of tests/integration/conftest.py (smollm2_server) is shared with test_smollm2_analysis.py: one worker starts it
pytestmark = pytest.mark.xdist_group("smollm2-server")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def lm():
    return smollm2_adapter()


def test_paris_is_the_top_prediction(lm):
    encoded = lm.at_position(lm.encode(PROMPT), None)
    summary = lm.output_summary(lm.run(encoded), encoded)
    assert summary["top"][0]["token"] == " Paris"
    assert 0.6 < summary["top"][0]["prob"] < 0.9


def test_facts_and_parity(lm):
    info = lm.info
    assert (info.layers, info.heads, info.kv_heads, info.head_dim) == (30, 9, 3, 64)
    assert info.parity <= 1e-4 and info.chat


def test_every_future_entry_is_exactly_zero(lm):
    result = lm.run(lm.encode("Attention is causal in a decoder, so no token sees the ones after it."))
    n = result.attention.shape[-1]
    future = torch.ones(n, n, dtype=torch.bool).triu(1)  # j > i
    assert torch.all(result.attention[..., future] == 0)
    assert torch.all(result.attention[..., ~future] > 0)


def test_small_beta_on_middle_layers_moves_the_prediction(lm):
    encoded = lm.at_position(lm.encode(PROMPT), None)
    before = lm.run(encoded)
    kls = []
    for beta in (0.1, 0.02, 0.005):
        after = lm.run(encoded, (Intervention("temperature", beta=beta, layers=(9, 10, 11)),))
        kls.append(lm.output_effect(before, after, encoded)["kl"])
    assert kls[0] > 1e-4 and kls[-1] > kls[0]  # flatter attention, further from the model's own answer


def test_plain_continuation_equals_generate_and_chat_answers(lm):
    prompt = lm.prompt_ids("What is the capital of France?", chat=True)
    ours = [s.id for s in lm.continuation(prompt, (), 12)]
    with torch.inference_mode():
        theirs = lm.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, num_beams=1)[0]
    assert ours == theirs[len(prompt):].tolist()[: len(ours)]
    assert "Paris" in lm.decode(ours)


@pytest.mark.slow  # a real smollm2-135m server (started once: tests/integration/conftest.py)
def test_generation_stops_when_the_client_disconnects(smollm2_server):
    """A real server: read two events of a 64-token generation, close the connection, and the process goes
    idle (without the stop it would compute ~60 more steps of two continuations)."""
    base, server = smollm2_server
    body = {"model": "smollm2-135m", "text": "Once upon a time", "max_new_tokens": 64}
    with httpx.stream("POST", f"{base}/api/text/generate", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                assert "done" not in json.loads(line[6:])
                events += 1
                if events == 2:
                    break
    idle_cpu = cpu_after_leaving(server.pid, settle_s=1.5)  # the step in progress finishes first
    assert idle_cpu < 0.5, f"the server kept working after the client left ({idle_cpu:.2f} CPU s in 3 s)"
    assert httpx.get(f"{base}/api/health", timeout=5).status_code == 200
