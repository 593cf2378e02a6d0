"""`--model` on the serving command: the operator's models reach the settings, never a request."""
from __future__ import annotations

import json

import pytest

from app.serve import add_models, take_models
from app.settings import get_settings


def test_model_options_are_split_off_and_named():
    rest, models = take_models(["--port", "9000", "--model", "gpt2", "--model=./my-vit/", "--model", "mt=/m/opus-mt-en-de"])
    assert rest == ["--port", "9000"]
    assert models == {"gpt2": "gpt2", "my-vit": "./my-vit/", "mt": "/m/opus-mt-en-de"}


def test_model_without_value_is_refused():
    with pytest.raises(SystemExit, match="--model needs a value"):
        take_models(["--model"])


def test_models_merge_into_the_extra_models_setting(monkeypatch):
    monkeypatch.setenv("ATTNLAB_EXTRA_MODELS", json.dumps({"kept": "/a"}))
    add_models({"gpt2": "gpt2"})
    try:
        assert get_settings().extra_models == {"kept": "/a", "gpt2": "gpt2"}
    finally:
        get_settings.cache_clear()
