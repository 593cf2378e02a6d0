"""Uploads need a same-origin signal (issue 53 §12): a multipart POST is a "simple" request that any page on any
origin can make a visitor's browser send (a <form> or a fetch without a preflight), with the visitor's cookies. So an
upload (POST /api/images, /api/audio) that a browser marks as cross-origin is refused with 403 naming why, before its
body is read:

- `Sec-Fetch-Site: cross-site` or `same-site` (a sibling host is another origin too): set by the browser itself, a
  page cannot change it;
- an `Origin` that is not this server's (its `Host`; compared by host name alone when the Host has no port, as
  behind nginx's `proxy_set_header Host $host`), or "null" (a sandboxed frame, a file).

An origin listed in `cors_origins` passes. Clients that send neither header (attnlab.Lab, curl, scripts) are not
browsers acting for a visitor, and pass.
"""
from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}


def cross_origin_refusal(headers: Mapping[str, str], allowed: list[str]) -> str | None:
    """Why this request must be refused as a cross-origin browser upload, or None."""
    origin = headers.get("origin")
    if origin is not None and origin.rstrip("/") in {a.rstrip("/") for a in allowed}:
        return None
    site = (headers.get("sec-fetch-site") or "").strip().lower()
    if site in ("cross-site", "same-site"):
        return (f"uploads are accepted from this server's own pages only: the browser marked this request "
                f"Sec-Fetch-Site: {site} (sent by a page of another origin{f', {origin}' if origin else ''}); "
                "list that origin in cors_origins to allow it")
    if origin is not None and not _same_origin(origin, headers.get("host") or ""):
        return (f"uploads are accepted from this server's own pages only: Origin {origin[:200]!r} is not this "
                f"server ({(headers.get('host') or '?')[:200]}); list it in cors_origins to allow it")
    return None


def _same_origin(origin: str, host: str) -> bool:
    parts = urlsplit(origin.strip())
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        return False  # "null" and anything that is not a web origin
    served = urlsplit("//" + host.strip())
    try:
        origin_port, host_port = parts.port or DEFAULT_PORTS[parts.scheme], served.port
    except ValueError:  # a port that is not a number
        return False
    if (served.hostname or "").lower() != parts.hostname.lower():
        return False
    return host_port is None or host_port == origin_port
