"""Fixtures shared by every test layer: tiny random-weight BERTs built here, and app clients."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# The test process holds many apps and models at once, so its RSS says nothing of one app's budget: apps built here
# keep the memory accountant's books only (servers started as subprocesses inherit this too). The RSS watch is tested
# on its own (tests/unit/test_jobs_admission.py).
os.environ.setdefault("ATTNLAB_MEMORY_WATCH_RSS", "0")
# The tests that prepare weights test the conversion, not the per-user cache of prepared folders that `make setup`
# fills (models/weights_cache.py): off here, and in the preparations the tests start as subprocesses;
# tests/integration/test_weights_cache.py turns it on in a folder of its own.
os.environ.setdefault("ATTNLAB_WEIGHTS_CACHE", "off")

# app/ and models/ come from the installed package (`pip install -e .`); the checkout itself is on sys.path
# through pyproject.toml's [tool.pytest.ini_options] pythonpath (tests.tiny_models, tests/api/slow_app.py).

WORDS = "the a cat dog sat on mat rug it was tired because street animal cross did not ran sleep".split()

# `make test` runs the suite on TEST_WORKERS pytest-xdist workers (--dist loadgroup). Each worker's own torch gets its
# share of the cores: two workers of 2 threads each on 2 cores only wait for each other.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under --dist loadgroup a test module is one unit of work, run on one worker, so that its module-scoped fixtures
    (a loaded model, a server) are built once. Modules marked `pytest.mark.xdist_group("name")` share one worker:
    a session-scoped server they all use, or something that must not be used twice at once."""
    if not getattr(config.option, "loadgroup", False):  # what pytest-xdist sets on its workers under loadgroup
        return
    from _pytest.nodeid import coerce_node_id

    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")}) or [item.nodeid.split("::")[0]]
        # the scheduler groups by what follows the node id's last "@"; pytest-xdist 3.8 appends it to item._nodeid,
        # which pytest 9 no longer reads (a node's id is item._id), so it is appended here
        item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(groups)}")


def build_tiny_bert(folder: Path, *, masked_lm: bool = False, seed: int = 0) -> Path:
    """A 2-layer, 4-head random BERT with a real WordPiece tokenizer, saved like a hub checkpoint."""
    import torch
    from transformers import BertConfig, BertForMaskedLM, BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", *WORDS]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab=str(folder / "vocab.txt"), do_lower_case=True)  # `vocab=`: transformers 5 ignores vocab_file
    tokenizer.save_pretrained(folder)
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    model = (BertForMaskedLM if masked_lm else BertModel)(config)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def tiny_mlm(tmp_path_factory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-mlm"), masked_lm=True, seed=1)
