"""Issue 36 "Done means", first item, on the real smollm2-135m: one process with default settings, the text page's own
order on the long sample (its first view streamed, then a compare with mask_keys on a few early tokens, streamed)
keeps both runs. The compare is accepted with runs: 1 and never computes the base again (every progress total is 30,
not 60); a minute after `done`, windows of both runs and their difference answer, and the intervened window equals
plain transformers eager attention with those keys masked (an attention mask of 0 on them: every query ignores them,
the causal mask stays).

Takes a few minutes on a 2-core CPU: two 2,932-token runs, the 60 s wait, and one eager forward."""
from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest
import torch

from tests.integration.helpers import ROOT, SMOLLM2, real_server

pytestmark = pytest.mark.slow  # the minute between the two runs is its point, and a server with the default settings

SAMPLE = (ROOT / "static" / "samples" / "long-sample.txt").read_text().rstrip()
MASKED = [1, 2, 3]
CLIENT = {"X-Attnlab-Client": "page-order"}
LAYER, HEAD = 14, 3
BOXES = [((100, 140), (0, 40)), ((2000, 2040), (1980, 2020)), ((2890, 2930), (0, 40))]


def _page_request(interventions: list) -> dict:
    """What static/js/text.js request() sends for the long sample on smollm2-135m."""
    compare = bool(interventions)
    return {"model": "smollm2-135m", "text": SAMPLE, "layers": [0], "heads": [0], "include_scores": True,
            "interventions": interventions, "compare": compare, "include_base": compare, "samples": 1,
            "thumbnail_size": 24, "encoding": "f32", "position": None, "chat": False}


def _streamed(base: str, body: dict) -> tuple[dict, set[int], dict]:
    """(accepted event, the progress totals sent, the done event) of one streamed request."""
    accepted, totals, final = {}, set(), {}
    with httpx.stream("POST", f"{base}/api/text/attention", json=body,
                      headers={"Accept": "text/event-stream", **CLIENT}, timeout=1800) as response:
        assert response.status_code == 200, response.read()[:500]
        for line in response.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                accepted = event if event.get("accepted") else accepted
                totals |= {event["total"]} if "total" in event else set()
                if "done" in event or "error" in event:
                    final = event
                    break
    assert final.get("done") is True, final
    return accepted, totals, final


def _window(base: str, run_id: str, rows, cols, minus: str | None = None) -> np.ndarray:
    response = httpx.post(f"{base}/api/runs/{run_id}/window", headers=CLIENT, timeout=120, json={
        "layer": LAYER, "head": HEAD, "rows": list(rows), "cols": list(cols), "minus": minus})
    assert response.status_code == 200, response.text
    return np.array(response.json()["attention"])


def _eager_masked(tokens: list[str]) -> torch.Tensor:
    """P of layer LAYER (H, T, T) from plain transformers eager attention, the keys MASKED masked for every query."""
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(SMOLLM2)
    ids = tokenizer(SAMPLE)["input_ids"]
    assert [tokenizer.decode([i]) for i in ids] == tokens  # the same tokens as the server's run
    model = tf.AutoModelForCausalLM.from_pretrained(SMOLLM2, attn_implementation="eager").eval()
    captured = {}

    def keep(module, args, output) -> None:  # returns None: the layer's output goes on unchanged
        captured["p"] = output[1][0]  # (H, T, T)

    hook = model.model.layers[LAYER].self_attn.register_forward_hook(keep)
    mask = torch.ones(1, len(ids), dtype=torch.long)
    mask[0, MASKED] = 0
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]), attention_mask=mask, logits_to_keep=1)
    finally:
        hook.remove()
    return captured["p"]


def test_the_pages_order_keeps_both_runs_a_minute_later():
    if not (SMOLLM2 / "prepared.json").is_file():
        pytest.fail("weights/smollm2-135m is missing: run `make weights`")
    with real_server({"HF_HUB_OFFLINE": "1"}, ready_s=900) as (base, _server):
        _, _, first = _streamed(base, _page_request([]))
        accepted, totals, compare = _streamed(base, _page_request([{"op": "mask_keys", "tokens": MASKED}]))
        done_at = time.monotonic()
        assert accepted["runs"] == 1 and totals == {30}, (accepted, totals)  # the kept base is not computed again
        run, base_run = compare["run_id"], compare["base_run_id"]
        assert base_run == first["run_id"]
        eager = _eager_masked(compare["tokens"])
        time.sleep(max(0.0, 60 - (time.monotonic() - done_at)))
        for rows, cols in BOXES:
            intervened = _window(base, run, rows, cols)
            expected = eager[HEAD, rows[0]:rows[1], cols[0]:cols[1]].numpy()
            assert np.abs(intervened - expected).max() < 1e-4, (rows, cols)
            if cols[0] == 0:
                assert np.all(intervened[:, MASKED] == 0)  # the masked keys get nothing
            plain = _window(base, base_run, rows, cols)
            difference = _window(base, run, rows, cols, minus=base_run).astype(np.float32)
            assert np.array_equal(difference, intervened.astype(np.float32) - plain.astype(np.float32))  # in float32
        kept = httpx.get(f"{base}/api/jobs", timeout=30).json()["memory"]
        assert kept["kept_bytes"] + kept["kept_disk_bytes"] > 0
        print(json.dumps({"accepted": accepted, "totals": sorted(totals), "windows_answered_after_60s": 3 * len(BOXES),
                          "memory": kept}))  # the figures of benchmarks/results/run_store.md
