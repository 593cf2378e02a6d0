"""The text page. (The image and Gaussian pages live with their own routers.)"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from app.deps import SettingsDep
from app.templating import templates

router = APIRouter(include_in_schema=False)

EXAMPLE_TEXT = "The animal didn't cross the street because it was too tired."
EXAMPLE_PAIR = "The dog was exhausted, so it stayed on the sidewalk."


@router.get("/", response_class=HTMLResponse)
def text_page(request: Request, settings: SettingsDep):
    config = {
        "model": "minilm",
        "text": EXAMPLE_TEXT,
        "text_pair": EXAMPLE_PAIR,
        "max_text_chars": settings.max_text_chars,
    }
    return templates.TemplateResponse(request, "text.html", {"config": config, "page": "text"})
