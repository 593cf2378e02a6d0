"""Ids handed to clients (uploads, runs): unguessable capabilities, never content hashes.

A content hash would let anyone test whether a known image or clip was uploaded by someone else, and read it by
recomputing its id. Ids are random instead; deduplication of identical content stays internal to each store.

A run lives in the memory of the process that computed it, so a run id names that process (its replica):
`<replica>.<32 hex>`. Any replica of a fleet reads the owner from the id and forwards the run's requests there
(app/fleet.py); uploads are shared through Redis and keep plain 32-hex ids.
"""
from __future__ import annotations

import re
import secrets

ID_BYTES = 16  # 128 random bits
ID_PATTERN = re.compile(r"^[0-9a-f]{32}$")
REPLICA_PATTERN = re.compile(r"^[a-z0-9]{4,16}$")
RUN_ID_PATTERN = re.compile(r"^([a-z0-9]{4,16})\.[0-9a-f]{32}$")
# This process's replica name: set from the replica_name setting at start-up (app/fleet.py), else random per
# process, so a restarted process never claims the runs of the one before it.
_replica = secrets.token_hex(4)


def new_id() -> str:
    """A fresh random id: 32 lowercase hex characters (the same shape as the earlier content-hash ids)."""
    return secrets.token_hex(ID_BYTES)


def is_valid_id(value: str) -> bool:
    """Whether `value` has the shape of an id (uploads of images and audio, runs): the one check of every route.
    The whole string must match: a trailing newline is not an id."""
    return ID_PATTERN.fullmatch(value) is not None


def replica_name() -> str:
    return _replica


def set_replica_name(name: str) -> None:
    """This process's replica name (app/fleet.py, from the replica_name setting): 4-16 of [a-z0-9]."""
    global _replica
    if REPLICA_PATTERN.fullmatch(name) is None:
        raise ValueError(f"replica name {name!r}: 4 to 16 characters of a-z and 0-9")
    _replica = name


def new_run_id() -> str:
    """A fresh run id owned by this process: `<replica>.<32 hex>`."""
    return f"{_replica}.{secrets.token_hex(ID_BYTES)}"


def is_valid_run_id(value: str) -> bool:
    """Whether `value` has the shape of a run id (the whole string: a trailing newline is not an id)."""
    return RUN_ID_PATTERN.fullmatch(value) is not None


def run_owner(value: str) -> str | None:
    """The replica that owns run id `value`, or None when it is not a run id."""
    match = RUN_ID_PATTERN.fullmatch(value)
    return match.group(1) if match else None
