"""The guide: docs/*.md rendered to HTML (markdown-it-py, pure Python), served as /guide, /guide/api, ….

Each heading gets a stable anchor: a numbered one ("4. Perturbations", "9.2 Grouped-query attention")
gets `s4`, `s9-2`, so "§4" anywhere in the product links to `/guide#s4`; any other heading gets a slug of
its text. Links between the docs (`api.md`, `science.md#s4`) become links between the guide's pages.
Rendered once per process, on first request. Formulas stay readable Unicode (no MathJax, no CDN).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


@dataclass(frozen=True)
class GuidePage:
    slug: str  # "" for /guide itself
    file: str  # under docs/
    title: str

    @property
    def url(self) -> str:
        return "/guide" + (f"/{self.slug}" if self.slug else "")


# The nav order of the guide's pages. A request names one of these slugs, never a file.
PAGES: tuple[GuidePage, ...] = (
    GuidePage("", "science.md", "The science"),
    GuidePage("api", "api.md", "HTTP API"),
    GuidePage("configuration", "configuration.md", "Configuration"),
    GuidePage("docker", "docker.md", "Docker"),
    GuidePage("notebook", "notebook.md", "Notebook"),
)
BY_SLUG = {page.slug: page for page in PAGES}
BY_FILE = {page.file: page for page in PAGES}

_NUMBERED = re.compile(r"^(\d+)(?:\.(\d+))?\.?\s")


@dataclass(frozen=True)
class Heading:
    level: int
    anchor: str
    text: str


@dataclass(frozen=True)
class Rendered:
    page: GuidePage
    title: str  # the document's h1
    html: str
    headings: tuple[Heading, ...]  # h2 and h3, for the table of contents

    @property
    def anchors(self) -> set[str]:
        return {h.anchor for h in self.headings}


def anchor_for(text: str) -> str:
    """'4. Perturbations …' → 's4', '9.2 Grouped …' → 's9-2', anything else → a slug of the text."""
    match = _NUMBERED.match(text)
    if match:
        return f"s{match[1]}" + (f"-{match[2]}" if match[2] else "")
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug or "section"


def _rewrite_href(href: str) -> str:
    """Links between docs become guide URLs; everything else is left as written."""
    if "://" in href or href.startswith(("/", "#", "mailto:")):
        return href
    path, _, fragment = href.partition("#")
    target = BY_FILE.get(path.removeprefix("./"))
    if target is None:
        return href
    return target.url + (f"#{fragment}" if fragment else "")


@functools.lru_cache
def _parser() -> MarkdownIt:
    # commonmark + tables; raw HTML in the markdown is escaped, not passed through.
    return MarkdownIt("commonmark", {"html": False}).enable("table")


@functools.lru_cache
def render(slug: str) -> Rendered:
    """The guide page `slug` (KeyError if there is none)."""
    page = BY_SLUG[slug]
    md = _parser()
    tokens = md.parse((DOCS / page.file).read_text(encoding="utf-8"))
    headings: list[Heading] = []
    title, seen, skip = page.title, set(), set()
    for index, token in enumerate(tokens):
        if token.type == "heading_open":
            inline = tokens[index + 1]
            text = "".join(c.content for c in inline.children or () if c.type in ("text", "code_inline")) or inline.content
            level = int(token.tag[1])
            if level == 1:  # the page template prints the title itself
                title = text
                skip.update((index, index + 1, index + 2))  # heading_open, inline, heading_close
                continue
            anchor = base = anchor_for(text)
            suffix = 2
            while anchor in seen:  # keep anchors unique within the page
                anchor, suffix = f"{base}-{suffix}", suffix + 1
            seen.add(anchor)
            token.attrSet("id", anchor)
            if level <= 3:
                headings.append(Heading(level, anchor, text))
        elif token.type == "inline" and token.children:
            for child in token.children:
                if child.type == "link_open" and child.attrGet("href"):
                    child.attrSet("href", _rewrite_href(str(child.attrGet("href"))))
    html = md.renderer.render([t for i, t in enumerate(tokens) if i not in skip], md.options, {})
    return Rendered(page=page, title=title, html=html, headings=tuple(headings))
