"""The client's one error, raised by attnlab/client.py and attnlab/results.py alike (a module of its own, so that
neither imports the other for it)."""
from __future__ import annotations

from typing import Any


class LabError(Exception):
    """The server refused or failed a request: `status` (HTTP status; None when the server was not reached or a
    streamed job failed without one), `detail` (the server's `detail`: a string, or for a 422 the list of
    {"loc", "msg", "type"}), `path` (the route) and `retry_after` (seconds, when the server was busy)."""

    def __init__(self, status: int | None, detail: Any, path: str = "", retry_after: float | None = None):
        self.status, self.detail, self.path, self.retry_after = status, detail, path, retry_after
        super().__init__(self._message())

    def _message(self) -> str:
        detail = self.detail
        if isinstance(detail, list):  # a validation error: one line per field, its path first
            detail = "; ".join(f"{'.'.join(str(p) for p in item.get('loc', ()))}: {item.get('msg', item)}"
                               if isinstance(item, dict) else str(item) for item in detail)
        where = f" {self.path}" if self.path else ""
        status = f"{self.status}" if self.status is not None else "error"
        return f"{status}{where}: {detail}"
