"""The docs say what the code does (issue 38 §5, §7): an upload's id is random in every doc that describes it, as the
upload route makes it (the same file twice: two ids); the README and docs/api.md name the guide's sections as
docs/science.md has them."""
from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.api.test_images_api import png_bytes

ROOT = Path(__file__).resolve().parents[2]


def paragraph(text: str, marker: str) -> str:
    """The list item or paragraph of `text` that contains `marker` (up to the next item or blank line)."""
    start = text.index(marker)
    begin = max(text.rfind("\n- ", 0, start), text.rfind("\n\n", 0, start))
    ends = [i for i in (text.find("\n- ", start), text.find("\n\n", start)) if i != -1]
    return text[begin:min(ends) if ends else len(text)]


def test_image_ids_are_random_in_the_docs_and_the_code():
    with TestClient(create_app(Settings(default_models=[]))) as client:
        ids = [client.post("/api/images", files={"file": ("a.png", png_bytes(seed=5), "image/png")}).json()["image_id"]
               for _ in range(2)]
    assert ids[0] != ids[1]  # the same file twice: two ids
    api = paragraph((ROOT / "docs" / "api.md").read_text(), "`POST /api/images`")
    configuration = (ROOT / "docs" / "configuration.md").read_text()
    for name, text in (("docs/api.md", api), ("docs/configuration.md", configuration)):
        assert not re.search(r"\bis (a|the) (content )?hash|hash of the content, so", text), name
    assert "random" in api and "two ids" in api
    assert "never the content's hash" in configuration


def test_the_guides_sections_are_named_as_science_md_has_them():
    sections = [int(n) for n in re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "science.md").read_text(), re.M)]
    last = max(sections)
    assert sections == list(range(1, last + 1))
    readme = (ROOT / "README.md").read_text()
    named = re.findall(r"§1–§(\d+)", readme)
    assert named and set(named) == {str(last)}, named
    api = (ROOT / "docs" / "api.md").read_text()
    pages = re.findall(r"`/guide#s1` … `/guide#s(\d+)`", api)
    assert pages == [str(last)], pages
