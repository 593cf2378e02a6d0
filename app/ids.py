"""Ids handed to clients (uploads, runs): unguessable capabilities, never content hashes.

A content hash would let anyone test whether a known image or clip was uploaded by someone else, and read it by
recomputing its id. Ids are random instead; deduplication of identical content stays internal to each store.
"""
from __future__ import annotations

import re
import secrets

ID_BYTES = 16  # 128 random bits
ID_PATTERN = re.compile(r"^[0-9a-f]{32}$")


def new_id() -> str:
    """A fresh random id: 32 lowercase hex characters (the same shape as the earlier content-hash ids)."""
    return secrets.token_hex(ID_BYTES)


def is_valid_id(value: str) -> bool:
    """Whether `value` has the shape of an id (uploads of images and audio, runs): the one check of every route.
    The whole string must match: a trailing newline is not an id."""
    return ID_PATTERN.fullmatch(value) is not None
