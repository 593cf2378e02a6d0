"""The error answers routes share: a 422 in FastAPI's usual shape naming the field."""
from __future__ import annotations

from fastapi.exceptions import RequestValidationError


def field_error(loc: tuple, message: str) -> RequestValidationError:
    """A 422 in FastAPI's usual shape, naming the field."""
    return RequestValidationError([{"loc": ("body", *loc), "msg": message, "type": "value_error"}])
