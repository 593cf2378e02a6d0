"""Patching, attribution patching, the logit lens and the faithfulness check on the real smollm2-135m
(docs/science.md "Beyond attention weights"): France/Paris against Italy/Rome."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from models.interventions import Intervention
from models.patching import Pair, attribution_scan, baseline, head_scan, last_logits, rank_correlation, single_token
from tests.integration.helpers import cpu_after_leaving, smollm2_adapter

# the real server of tests/integration/conftest.py (smollm2_server) is shared with test_smollm2.py: one worker starts it
pytestmark = pytest.mark.xdist_group("smollm2-server")

CLEAN, CORRUPT = "The capital of France is", "The capital of Italy is"


@pytest.fixture(scope="module")
def lm():
    return smollm2_adapter()


@pytest.fixture(scope="module")
def scans(lm):
    ids = lambda text: torch.tensor([lm.prompt_ids(text)])  # noqa: E731
    pair = Pair(ids(CLEAN), ids(CORRUPT), single_token(lm.tokenizer, " Paris"), single_token(lm.tokenizer, " Rome"))
    base = baseline(lm, pair)
    return pair, base, head_scan(lm, pair, base, batch=135), attribution_scan(lm, pair, base)


def test_paris_rome_logit_difference_flips_between_the_prompts(scans):
    _, base, _, _ = scans
    assert base.ld_clean > 2 and base.ld_corrupt < -2


def test_some_head_restores_paris_and_attribution_agrees(scans, lm):
    pair, base, exact, attribution = scans
    assert exact.shape == (30, 9)
    assert float(exact.max()) > 0.1
    rho = rank_correlation(exact, attribution)
    print(f"max head effect {float(exact.max()):.3f} at {divmod(int(exact.argmax()), 9)}; Spearman ρ = {rho:.3f}")
    assert rho > 0.5
    # the best cell applied as an intervention gives the scan's logit difference
    layer, head = divmod(int(exact.argmax()), 9)
    from models.head_ops import HeadRun, head_run

    with head_run(HeadRun(sources={"clean": base.clean_outputs})):
        logits = last_logits(lm, pair.corrupt, (Intervention("patch_heads", layers=(layer,), heads=(head,), source="clean"),))[0]
    ld = float(logits[pair.answer] - logits[pair.wrong])
    assert (ld - base.ld_corrupt) / (base.ld_clean - base.ld_corrupt) == pytest.approx(float(exact[layer, head]), abs=1e-3)


def test_lens_last_row_is_the_models_prediction(lm):
    from models.lens import logit_lens

    ids = torch.tensor([lm.prompt_ids(CLEAN)])
    found = logit_lens(lm, ids, top=5)
    assert lm.token_text(int(found.ids[-1, -1, 0])) == " Paris"
    encoded = lm.encode(CLEAN)
    assert float(found.probs[-1, -1, 0]) == pytest.approx(float(lm.distribution(lm.run(encoded), 4).max()), abs=1e-4)
    assert lm.token_text(int(found.ids[0, -1, 0])) != " Paris"  # the first layer does not know yet


@pytest.mark.slow  # a real smollm2-135m server (started once: tests/integration/conftest.py)
def test_a_streamed_scan_stops_when_the_client_leaves(smollm2_server):
    """A real server: a residual scan in batches of 4 (90 batches), two progress events read, the connection
    closed, and the process goes idle (without the stop it would run the other ~88 batches)."""
    base, server = smollm2_server  # batches of 4 copies of the 12-token prompt
    body = {"model": "smollm2-135m", "clean": "The Eiffel Tower stands in France, in the city of",
            "corrupt": "The Colosseum stands in Italy, in the city of", "answer": " Paris", "wrong": " Rome",
            "scan": "residual"}
    with httpx.stream("POST", f"{base}/api/text/patching", json=body, timeout=120,
                      headers={"Accept": "text/event-stream"}) as response:
        assert response.status_code == 200
        progress = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                assert "done" not in event
                if event.get("accepted"):  # a job's first event (docs/api.md "Jobs")
                    continue
                progress.append(event["progress"])
                if len(progress) == 2:
                    break
    assert progress == [4, 8]
    idle_cpu = cpu_after_leaving(server.pid, settle_s=2.0)  # the batch in progress finishes first
    assert idle_cpu < 0.5, f"the server kept scanning after the client left ({idle_cpu:.2f} CPU s in 3 s)"
    assert httpx.get(f"{base}/api/health", timeout=5).status_code == 200
