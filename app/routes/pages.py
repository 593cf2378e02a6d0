"""The text page and the guide (docs/ rendered). (The image and Gaussian pages live with their own routers.)"""
from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse

from app import guide
from app.deps import RuntimeDep, SettingsDep
from app.runtime import Runtime
from app.templating import templates

router = APIRouter(include_in_schema=False)

EXAMPLE_TEXT = "The animal didn't cross the street because it was too tired."
EXAMPLE_PAIR = "The dog was exhausted, so it stayed on the sidewalk."
# A decoder LM's example: the next-token panel shows " Rome" on top (p ≈ 0.77 for smollm2-135m), and the
# attention of the last token can look back at the first "capital of … is" pattern.
LM_EXAMPLE = "The capital of France is Paris, and the capital of Italy is"
EXAMPLES = {"next_token": LM_EXAMPLE, "default": EXAMPLE_TEXT}  # by model output; the page follows the model
# The text page opens on the language model, the one people study; minilm stays one choice away.
PAGE_MODELS = ("smollm2-135m", "minilm")


def page_model(runtime: Runtime) -> str:
    """The text page's first model: the first of PAGE_MODELS that this server has."""
    return next((m for m in PAGE_MODELS if m in runtime.specs and runtime.specs[m].kind == "text"), PAGE_MODELS[-1])


@router.get("/", response_class=HTMLResponse)
def text_page(request: Request, settings: SettingsDep, runtime: RuntimeDep):
    model = page_model(runtime)
    config = {
        "model": model,
        "text": LM_EXAMPLE if getattr(runtime.specs.get(model), "family", "") == "causal_lm" else EXAMPLE_TEXT,
        "text_pair": EXAMPLE_PAIR,
        "examples": EXAMPLES,
        "max_text_chars": settings.max_text_chars,
        # The server's limits, so the page offers no more than a request may ask for.
        "limits": {"samples": settings.max_samples, "max_new_tokens": settings.max_new_tokens, "max_tokens": settings.max_tokens,
                   "full_map_tokens": settings.full_map_tokens},  # longer texts ask for layer progress
        # The text models, when all are loaded: the page then starts its first request without asking /api/models.
        "models": loaded_infos(runtime, "text"),
        "not_ready": runtime.not_ready("text"),  # being prepared (`make run`): shown, not chosen
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


@router.get("/guide/img/{name}")
def guide_image(name: str):
    """The figures the guide's pages show (docs/img/*.png, written `img/x.png` in the markdown, as on GitHub)."""
    path = guide.DOCS / "img" / name
    if not name.endswith(".png") or "/" in name or name.startswith(".") or not path.is_file():
        raise HTTPException(404, detail=f"no guide image {name!r}")
    return FileResponse(path, media_type="image/png")


def _guide(request: Request, slug: str):
    doc = guide.render(slug)
    return templates.TemplateResponse(request, "guide.html", {"doc": doc, "pages": guide.PAGES, "page": "guide"})


def loaded_infos(runtime: Runtime, kind: str) -> list[dict] | None:
    """ModelInfo of every registry model of `kind` if each is loaded already or can be described from its files
    without loading (a prepared decoder LM such as gemma3-270m: models/listing.py), else None (the page asks
    GET /api/models)."""
    from app.model_sources import public_info  # `source` without server paths
    from app.runtime import UnknownModel

    infos = []
    for model_id, spec in runtime.specs.items():
        # models that could not load (optional weights not prepared: runtime.unavailable) are not waited for
        if spec.kind != kind or model_id in runtime.unavailable:
            continue
        try:
            info = runtime.describe(model_id, load=False)  # the loaded model's, or read from its files
        except UnknownModel:  # not prepared here (now in runtime.unavailable)
            continue
        if info is None:
            return None
        infos.append(public_info(runtime, info))
    return infos or None


def warm_example(runtime: Runtime, model_id: str | None = None) -> bool:
    """Run the text page's first view of its example once, at start-up: the first visitor's request is
    then a cache hit, and the first forward's one-time costs (kernel set-up, allocations) are paid here.
    model_id: the page's first model by default. Returns whether it ran (the model must be one of the
    loaded text models)."""
    from app.context import current
    from app.pipeline.text import text_work
    from app.schemas import TextAttentionRequest

    model_id = model_id or page_model(runtime)
    loaded = {adapter.info.id: adapter.info for adapter in runtime.loaded_adapters() if adapter.info.kind == "text"}
    if model_id not in loaded:
        return False
    lm = loaded[model_id].output == "next_token"
    request = TextAttentionRequest(  # what static/js/text.js asks for on a first view
        model=model_id, text=LM_EXAMPLE if lm else EXAMPLE_TEXT, text_pair=None if lm else EXAMPLE_PAIR,
        layers=[0], heads=[0], include_scores=True, thumbnail_size=24, encoding="f32",
    )
    text_work(runtime, request)(current())  # what POST /api/text/attention runs (app/pipeline/text.py), as a plain request
    return True
