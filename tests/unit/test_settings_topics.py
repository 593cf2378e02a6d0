"""Settings is made of topic mixins (app/settings.py, issue 54); every setting is still read from ATTNLAB_<NAME>,
with its default and its checks, whichever mixin declares it."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from app import settings as settings_module
from app.settings import Settings

TOPICS = [base for base in Settings.__bases__]


def test_every_setting_belongs_to_one_topic():
    owners: dict[str, list[str]] = {}
    for topic in TOPICS:
        for name in topic.__annotations__:
            owners.setdefault(name, []).append(topic.__name__)
    assert set(owners) == set(Settings.model_fields), "a setting declared on Settings itself, not on a topic"
    assert all(len(names) == 1 for names in owners.values()), {k: v for k, v in owners.items() if len(v) > 1}
    assert len(TOPICS) >= 5


@pytest.mark.parametrize("topic", TOPICS, ids=lambda topic: topic.__name__)
def test_each_topic_is_read_from_attnlab_env_names(topic, monkeypatch):
    """One int, float or bool setting of each topic set through its ATTNLAB_ name and read back changed."""
    for name in topic.__annotations__:
        default = Settings.model_fields[name].default
        if isinstance(default, bool):
            value, text = (not default), str(not default).lower()
        elif isinstance(default, (int, float)) and default > 0:
            value = type(default)(default * 2)
            text = str(value)
        else:
            continue
        monkeypatch.setenv(f"ATTNLAB_{name.upper()}", text)
        assert getattr(Settings(), name) == value, name
        monkeypatch.delenv(f"ATTNLAB_{name.upper()}")
        assert getattr(Settings(), name) == default, name
        return
    pytest.fail(f"{topic.__name__} has no int, float or bool setting to try")


def test_a_topics_checks_still_apply(monkeypatch):
    monkeypatch.setenv("ATTNLAB_TRUSTED_PROXIES", '["not an address"]')  # JobSettings' validator
    with pytest.raises(ValidationError):
        Settings()
    monkeypatch.setenv("ATTNLAB_TRUSTED_PROXIES", '["10.0.0.0/8"]')
    monkeypatch.setenv("ATTNLAB_MAX_AUDIO_S", "31")  # a bound of SpeechLimits (le=30)
    with pytest.raises(ValidationError):
        Settings()
    monkeypatch.delenv("ATTNLAB_MAX_AUDIO_S")
    assert Settings().trusted_proxies == ["10.0.0.0/8"]


def test_cache_sizes_are_still_derived_from_the_budget(monkeypatch):
    monkeypatch.setenv("ATTNLAB_MEMORY_BUDGET_BYTES", str(8 * 2**30))
    big = Settings()
    monkeypatch.setenv("ATTNLAB_MEMORY_BUDGET_BYTES", str(2 * 2**30))
    small = Settings()
    assert big.result_cache_bytes > small.result_cache_bytes > 0
    assert settings_module.get_settings.__wrapped__().result_cache_bytes == small.result_cache_bytes
