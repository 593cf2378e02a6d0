"""Long inputs on the real LM (docs/science.md §10): a 4,096-token run of smollm2-135m never allocates O(T²) per layer
at once. All of P would take 30 × 9 × 4,096² × 4 B = 18 GB (one layer's: 604 MB); the blockwise run keeps q̂/k̂ and
summaries. Measured, not timed: the largest single allocation (torch's profiler) and the peak RSS growth of a fresh
process (ru_maxrss), against those figures."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = ROOT / "weights" / "smollm2-135m"
TOKENS = 4096

pytestmark = pytest.mark.slow  # 4,096 tokens through smollm2-135m in a process of its own

PROBE = r"""
import json, resource, sys, torch
from models.adapters.causal_lm import CausalLMAdapter
from models.adapters.base import Encoded
tokens = int(sys.argv[1])
adapter = CausalLMAdapter("smollm2-135m", sys.argv[2], max_tokens=tokens, device="cpu")
ids = torch.randint(100, 40000, (1, tokens), generator=torch.Generator().manual_seed(0))
encoded = Encoded(key=("probe",), tokens=[str(i) for i in ids[0].tolist()],
                  inputs={"input_ids": ids, "attention_mask": torch.ones_like(ids)}, extra={"position": tokens - 1})
adapter.run(Encoded(key=("warm",), tokens=["a"] * 8, inputs={"input_ids": ids[:, :8], "attention_mask": torch.ones_like(ids[:, :8])}, extra={"position": 7}))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if sys.argv[3] == "profile":  # the largest single allocation: one op's own (self) allocation
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        result = adapter.run(encoded)
    largest = max((e.self_cpu_memory_usage for e in prof.events() if e.name != "[memory]"), default=0)
else:
    result = adapter.run(encoded)
    largest = None
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"peak_growth": after - before, "largest_allocation": largest, "kept": result.atlas.nbytes,
                  "long": result.is_long, "layers": adapter.info.layers, "heads": adapter.info.heads}))
"""


def _probe(tokens: int, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(tokens), str(WEIGHTS), mode], cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert measured["long"]
    return measured


def test_4096_tokens_allocate_no_full_map_per_layer():
    if not (WEIGHTS / "prepared.json").is_file():
        pytest.fail("weights/smollm2-135m is missing: run `make weights`")
    # the largest single allocation grows like T (hidden states, one block of rows), not like T²: doubling the input
    # at most doubles it (an O(T²) allocation would quadruple)
    small, large = _probe(1024, "profile"), _probe(2048, "profile")
    assert large["largest_allocation"] <= 2.2 * small["largest_allocation"], (small, large)
    measured = _probe(TOKENS, "rss")
    all_of_p = measured["layers"] * measured["heads"] * TOKENS * TOKENS * 4  # 18 GB in float32
    # the target: the peak grows by at most 1/8 of all of P
    assert measured["peak_growth"] < all_of_p / 8, measured
    print(json.dumps({"1024": small, "2048": large, "4096": measured}))
