"""attnlab_prepare.py learns the server's default_models without importing app/ (issue 54: a lower layer never
imports a higher one): models/preparing.py default_models reads ATTNLAB_DEFAULT_MODELS the way app/settings.py's
pydantic-settings does. Checked against Settings itself on the same environments."""
from __future__ import annotations

import pytest

from app.settings import Settings
from models.preparing import default_models


@pytest.mark.parametrize("environ", [
    {},
    {"ATTNLAB_DEFAULT_MODELS": "[]"},
    {"ATTNLAB_DEFAULT_MODELS": '["vit-fashion"]'},
    {"ATTNLAB_DEFAULT_MODELS": '["minilm", "dinov2-small", "whisper-tiny-en"]'},
    {"attnlab_default_models": '["gemma3-270m"]'},  # pydantic-settings matches names in any case
])
def test_the_same_list_as_the_settings(monkeypatch, environ):
    for name in [name for name in __import__("os").environ if name.upper() == "ATTNLAB_DEFAULT_MODELS"]:
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert default_models() == Settings().default_models


def test_a_value_that_is_not_a_list_of_ids_is_refused_naming_the_variable():
    for value in ("minilm", '{"a": 1}', "[1, 2]"):
        with pytest.raises(ValueError, match="ATTNLAB_DEFAULT_MODELS"):
            default_models({"ATTNLAB_DEFAULT_MODELS": value})
