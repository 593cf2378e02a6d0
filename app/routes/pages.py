"""The text page. (The image and Gaussian pages live with their own routers.)"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from app.deps import RuntimeDep, SettingsDep
from app.runtime import Runtime
from app.templating import templates

router = APIRouter(include_in_schema=False)

EXAMPLE_TEXT = "The animal didn't cross the street because it was too tired."
EXAMPLE_PAIR = "The dog was exhausted, so it stayed on the sidewalk."


@router.get("/", response_class=HTMLResponse)
def text_page(request: Request, settings: SettingsDep, runtime: RuntimeDep):
    config = {
        "model": "minilm",
        "text": EXAMPLE_TEXT,
        "text_pair": EXAMPLE_PAIR,
        "max_text_chars": settings.max_text_chars,
        # The text models, when all are loaded: the page then starts its first request without asking /api/models.
        "models": loaded_infos(runtime, "text"),
    }
    return templates.TemplateResponse(request, "text.html", {"config": config, "page": "text"})


def loaded_infos(runtime: Runtime, kind: str) -> list[dict] | None:
    """ModelInfo of every registry model of `kind` if all of them are loaded already, else None."""
    loaded = {adapter.info.id: adapter.info for adapter in runtime.loaded_adapters()}
    ids = [model_id for model_id, spec in runtime.specs.items() if spec.kind == kind]
    if not ids or any(model_id not in loaded for model_id in ids):
        return None
    return [loaded[model_id].to_dict() for model_id in ids]
