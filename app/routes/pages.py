"""The text page and the guide (docs/ rendered). (The image and Gaussian pages live with their own routers.)"""
from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse

from app import guide
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
        # The server's limits, so the page offers no more than a request may ask for.
        "limits": {"samples": settings.max_samples, "max_new_tokens": settings.max_new_tokens, "max_tokens": settings.max_tokens},
        # The text models, when all are loaded: the page then starts its first request without asking /api/models.
        "models": loaded_infos(runtime, "text"),
    }
    return templates.TemplateResponse(request, "text.html", {"config": config, "page": "text"})


@router.get("/guide", response_class=HTMLResponse)
def guide_page(request: Request):
    """The science (docs/science.md): what every number means, an anchor per section (#s1 … #s9)."""
    return _guide(request, "")


@router.get("/guide/{name}", response_class=HTMLResponse)
def guide_subpage(request: Request, name: str):
    """docs/api.md, docs/configuration.md, docs/docker.md as /guide/api, /guide/configuration, /guide/docker."""
    if not name or name not in guide.BY_SLUG:
        raise HTTPException(404, detail=f"no guide page {name!r}; pages: {[p.url for p in guide.PAGES]}")
    return _guide(request, name)


def _guide(request: Request, slug: str):
    doc = guide.render(slug)
    return templates.TemplateResponse(request, "guide.html", {"doc": doc, "pages": guide.PAGES, "page": "guide"})


def loaded_infos(runtime: Runtime, kind: str) -> list[dict] | None:
    """ModelInfo of every registry model of `kind` if all of them are loaded already, else None."""
    loaded = {adapter.info.id: adapter.info for adapter in runtime.loaded_adapters()}
    ids = [model_id for model_id, spec in runtime.specs.items() if spec.kind == kind]
    if not ids or any(model_id not in loaded for model_id in ids):
        return None
    from app.routes.service import public_info  # `source` without server paths

    return [public_info(runtime, loaded[model_id].to_dict()) for model_id in ids]


def warm_example(runtime: Runtime, model_id: str = "minilm") -> bool:
    """Run the text page's first view of its example once, at start-up: the first visitor's request is
    then a cache hit, and the first forward's one-time costs (kernel set-up, allocations) are paid here.
    Returns whether it ran (the model must be one of the loaded text models)."""
    from app.routes.text import text_attention
    from app.schemas import TextAttentionRequest

    if model_id not in {adapter.info.id for adapter in runtime.loaded_adapters() if adapter.info.kind == "text"}:
        return False
    request = TextAttentionRequest(  # what static/js/text.js asks for on a first view
        model=model_id, text=EXAMPLE_TEXT, text_pair=EXAMPLE_PAIR, layers=[0], heads=[0], include_scores=True,
        thumbnail_size=24, encoding="f32",
    )
    text_attention(request, runtime)
    return True
