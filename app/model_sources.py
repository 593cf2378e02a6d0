"""Where a model came from, as a client may read it (GET /api/models and the pages' model menus): the package and
version, the project's own folder, or the operator's model id, never an absolute path on the server. Shared by
app/routes/service.py and app/routes/pages.py, so that no route imports another."""
from __future__ import annotations

import importlib.metadata
from functools import lru_cache
from pathlib import Path

from app.runtime import Runtime

ROOT = Path(__file__).resolve().parents[1]


def public_info(runtime: Runtime, info: dict) -> dict:
    """A ModelInfo dict for clients: `source` names the package and version, the project's own folder,
    or the operator's model id, never an absolute path on the server."""
    return {**info, "source": public_source(runtime, info["id"], info.get("source", ""))}


def public_source(runtime: Runtime, model_id: str, source: str) -> str:
    settings = runtime.settings
    added = {**settings.extra_text_models, **settings.extra_image_models, **settings.extra_models}
    if model_id in added:
        configured = added[model_id]
        if "/" in configured and not configured.startswith(("/", ".", "~")) and configured.count("/") == 1 \
                and not Path(configured).exists():
            return f"hub:{configured}"  # a hub id (org/name) is public already
        return f"added by the operator as {model_id!r}"
    return _named_source(source)


@lru_cache(maxsize=64)
def _named_source(source: str) -> str:
    path = Path(source)
    parts = path.parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            top = parts[parts.index(marker) + 1] if parts.index(marker) + 1 < len(parts) else ""
            for dist in importlib.metadata.packages_distributions().get(top, []):
                try:
                    return f"PyPI package {dist} {importlib.metadata.version(dist)}"
                except importlib.metadata.PackageNotFoundError:
                    continue
            return f"an installed package ({top})" if top else "an installed package"
    try:
        return f"attnlab: {path.resolve().relative_to(ROOT).as_posix()}"  # e.g. weights/dinov2-small
    except ValueError:
        pass
    if path.is_absolute() or source.startswith((".", "~")):
        return path.name or "a local folder"
    return source
