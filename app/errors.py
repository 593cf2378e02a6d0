"""The error answers routes share: a 422 in FastAPI's usual shape naming the field, the answers of the upload
routes (images, audio), which return a response rather than raise (they run before the body is read), and
`Overloaded`, the 503 + Retry-After that the scheduler, the job board and the memory accountant raise, and
`ClientLimit`, the 429 + Retry-After of a cap about the client (its jobs, its address's jobs)."""
from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


def field_error(loc: tuple, message: str) -> RequestValidationError:
    """A 422 in FastAPI's usual shape, naming the field."""
    return RequestValidationError([{"loc": ("body", *loc), "msg": message, "type": "value_error"}])


def error_response(status: int, message: str, field: str = "file") -> JSONResponse:
    """A 4xx in FastAPI's validation shape, naming the body field (an upload's `file` unless said)."""
    return JSONResponse({"detail": [{"loc": ["body", field], "msg": message, "type": "value_error"}]}, status_code=status)


def too_large_response(limit: int, detail: str | None = None, setting: str = "max_upload_bytes") -> JSONResponse:
    """413 for an upload over `limit` bytes, naming the setting; the connection is closed (the rest of the body is
    not read)."""
    return JSONResponse(
        {"detail": detail or f"file: the upload is larger than the limit of {limit:,} bytes ({setting})"},
        status_code=413, headers={"Connection": "close"},
    )


class Overloaded(RuntimeError):
    """The queue is full, a wait would exceed the time limit, or a client has too many jobs: answer 503 with
    Retry-After (app/main.py), or the error event of a stream that has started (app/streams.py)."""

    status = 503

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class ClientLimit(Overloaded):
    """A cap about the client, not the replica: its jobs (max_queued_jobs_per_client) or its source address's
    (max_queued_jobs_per_address) queued or running. 429 + Retry-After: every replica would answer the same (the caps
    hold fleet-wide), so a load balancer must neither try another replica nor take this one out for it
    (deploy/nginx.conf)."""

    status = 429
