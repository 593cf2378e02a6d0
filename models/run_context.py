"""The model run in progress in this context (thread/task): models/hooks.py sets it around a forward (its RunScope,
or a CallTrace for the load-time probe), models/head_ops.py reads it in its residual hooks. A module of its own so
neither imports the other for it."""
from __future__ import annotations

import contextvars
from typing import Any

current_run: contextvars.ContextVar[Any] = contextvars.ContextVar("attnlab_run", default=None)  # RunScope | CallTrace | None
