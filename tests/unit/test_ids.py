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


def test_a_run_id_names_its_replica():
    from app.ids import is_valid_run_id, new_run_id, replica_name, run_owner

    run_id = new_run_id()
    assert is_valid_run_id(run_id) and run_owner(run_id) == replica_name() and new_run_id() != run_id
    assert not is_valid_id(run_id)  # an upload id is never a run id, and the other way round
    assert not is_valid_run_id(new_id()) and run_owner(new_id()) is None


@pytest.mark.parametrize("value", [
    "abcd." + "0" * 31, "abc." + "0" * 32, "ABCD." + "0" * 32, "abcd.." + "0" * 32, "abcd." + "0" * 32 + "\n",
    "a" * 17 + "." + "0" * 32, "../x." + "0" * 32, "abcd-" + "0" * 32,
])
def test_what_is_not_a_run_id(value):
    from app.ids import is_valid_run_id, run_owner

    assert not is_valid_run_id(value) and run_owner(value) is None
