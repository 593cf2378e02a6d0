"""Ids handed to clients (app/ids.py): one check for every route (uploads of images and audio, runs)."""
from __future__ import annotations

import pytest

from app.ids import is_valid_id, new_id


def test_a_fresh_id_is_valid():
    assert is_valid_id(new_id()) and new_id() != new_id()


@pytest.mark.parametrize("value", [
    "", "0" * 31, "0" * 33, "A" * 32, "g" * 32, "../../etc/passwd",
    "0" * 32 + "\n",  # re.match with `$` accepted a trailing newline
    " " + "0" * 31,
])
def test_what_is_not_an_id(value):
    assert not is_valid_id(value)
