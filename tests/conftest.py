"""Fixtures shared by every test layer: tiny random-weight BERTs built here, and app clients."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# The test process holds many apps and models at once, so its RSS says nothing of one app's budget: apps built here
# keep the memory accountant's books only (servers started as subprocesses inherit this too). The RSS watch is tested
# on its own (tests/unit/test_jobs_admission.py).
os.environ.setdefault("ATTNLAB_MEMORY_WATCH_RSS", "0")

# app/ and models/ come from the installed package (`pip install -e .`); the checkout itself is on sys.path
# through pyproject.toml's [tool.pytest.ini_options] pythonpath (tests.tiny_models, tests/api/slow_app.py).

WORDS = "the a cat dog sat on mat rug it was tired because street animal cross did not ran sleep".split()


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
