"""Uploads (the image and speech pages' POST /api/images and /api/audio): the multipart body read with its size
checked before and while it streams (`read_upload`), and the per-app gate that makes decodes take turns
(`DecodeGate`, `decode_gate`). Shared by app/routes/images.py and app/routes/audio.py, so that no route imports
another."""
from __future__ import annotations

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile

from app.errors import error_response, too_large_response
from app.origin import cross_origin_refusal

MULTIPART_SLACK = 64 * 1024  # boundaries and part headers around the file; the file itself is checked exactly


class DecodeGate:
    """At most `limit` image decodes at once: a decode holds the whole bitmap (and a copy or two while it
    converts), so a burst of large uploads is made to take turns instead of adding up to gigabytes.
    A request that gets no slot within `wait_s` is refused (503 + Retry-After) rather than left hanging.
    One per app, used on its event loop (see `decode_gate`)."""

    def __init__(self, limit: int, wait_s: float):
        self.limit, self.wait_s = limit, wait_s
        self._semaphore = anyio.Semaphore(limit)

    @property
    def in_use(self) -> int:
        return self.limit - self._semaphore.value

    async def acquire(self) -> bool:
        """Take a slot, waiting at most `wait_s`; False when none came free in time."""
        try:
            self._semaphore.acquire_nowait()  # a free slot is taken even when wait_s is 0
            return True
        except anyio.WouldBlock:
            pass
        with anyio.move_on_after(self.wait_s):
            await self._semaphore.acquire()
            return True
        return False

    def release(self) -> None:
        self._semaphore.release()


def decode_gate(app) -> DecodeGate:
    """The app's gate, built from its settings on first use (on the event loop: no lock needed)."""
    gate = getattr(app.state, "decode_gate", None)
    if gate is None:
        settings = app.state.runtime.settings
        gate = app.state.decode_gate = DecodeGate(settings.max_concurrent_decodes, settings.decode_wait_s)
    return gate


async def read_upload(request: Request, limit: int, setting: str, what: str, store=None) -> bytes | JSONResponse:
    """The bytes of an upload's multipart field `file` (the image and speech uploads), or the refusal to answer:
    403 a browser's cross-origin upload (app/origin.py); 415 not multipart; 400 a bad Content-Length; 413 over
    `limit` (the setting named), before the body is read when Content-Length says so, else counted as it comes
    (chunked uploads have none), and over the shared store's per-item limit; 422 no `file` field holding `what`."""
    refusal = cross_origin_refusal(request.headers, request.app.state.runtime.settings.cors_origins)
    if refusal is not None:  # a page on another origin making its visitor's browser upload (app/origin.py)
        return JSONResponse({"detail": refusal}, status_code=403)
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        return error_response(415, f"send multipart/form-data with the {what} in the field 'file' (got {content_type or 'no content type'!r})")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            return error_response(400, "invalid Content-Length header", "content-length")
        if int(declared) > limit + MULTIPART_SLACK:
            return too_large_response(limit, setting=setting)  # refused before a byte of the body is read
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit + MULTIPART_SLACK:
            return too_large_response(limit, setting=setting)
    form = await _replayed(request, bytes(body)).form(max_files=1, max_fields=8)
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            return error_response(422, f"missing the multipart field 'file' holding the {what}")
        data = await upload.read()
    finally:
        await form.close()
    if len(data) > limit:
        return too_large_response(limit, setting=setting)
    if store is not None and store.max_item_bytes is not None and len(data) > store.max_item_bytes:
        return too_large_response(store.max_item_bytes, f"file: the upload is larger than the shared store's limit of "
                                                f"{store.max_item_bytes:,} bytes per item (redis_max_item_bytes)")
    return data


def _replayed(request: Request, body: bytes) -> Request:
    """The same request with its (already read and counted) body to be read again, for Starlette's form parser:
    a new Request over the same scope whose receive hands over `body` once (no write into a Request's fields)."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:  # read past the end: as a server says once the body is over and the client leaves
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(request.scope, receive)
