"""The guide (/guide…, docs/ rendered): pages, anchors, links between them, and the references to it from
the pages' server-rendered HTML and from the OpenAPI schema."""
from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest

GUIDE_PAGES = ("/guide", "/guide/api", "/guide/configuration", "/guide/docker", "/guide/notebook")
SECTIONS = [f"s{n}" for n in range(1, 10)]


class Links(HTMLParser):
    """Every element id, every href, and every <script> of a page."""

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.hrefs: list[str] = []
        self.scripts: list[dict] = []
        self.images: list[str] = []
        self.section_links: list[tuple[str, str]] = []  # (href, text) of <a> whose text has a §
        self._open_a: str | None = None
        self._a_text = ""

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "a" and "href" in attrs:
            self.hrefs.append(attrs["href"])
            self._open_a, self._a_text = attrs["href"], ""
        if tag == "script":
            self.scripts.append(attrs)
        if tag == "img" and "src" in attrs:
            self.images.append(attrs["src"])

    def handle_data(self, data):
        if self._open_a is not None:
            self._a_text += data

    def handle_endtag(self, tag):
        if tag == "a" and self._open_a is not None:
            if "§" in self._a_text:
                self.section_links.append((self._open_a, self._a_text))
            self._open_a = None


def parse(html: str) -> Links:
    links = Links()
    links.feed(html)
    return links


@pytest.fixture(scope="module")
def guide(client) -> dict[str, Links]:
    pages = {}
    for path in GUIDE_PAGES:
        r = client.get(path)
        assert r.status_code == 200, (path, r.status_code)
        assert r.headers["content-type"].startswith("text/html")
        pages[path] = parse(r.text)
    return pages


def test_the_science_page_has_an_anchor_per_section_and_a_contents_list(client, guide):
    science = guide["/guide"]
    assert set(SECTIONS) <= science.ids, f"missing section anchors: {set(SECTIONS) - science.ids}"
    # the decoder subsections the product cites (§9.x)
    assert {"s4-1", "s4-2", "s9-1", "s9-2", "s9-9"} <= science.ids
    toc = [h for h in science.hrefs if h.startswith("#")]
    assert [f"#{s}" for s in SECTIONS] == [h for h in toc if re.fullmatch(r"#s\d", h)], "contents list out of order"
    html = client.get("/guide").text
    # the seed correction and the decoder mask are stated, in the section they belong to
    s4 = html.split('id="s4"')[1].split('id="s5"')[0]
    assert "only row i" in s4 and "keep their ratios" in s4
    s91 = html.split('id="s9-1"')[1].split('id="s9-2"')[0]
    assert "j ≤ i" in s91 and "reversed" in s91


def test_every_link_inside_the_guide_resolves(guide):
    for path, page in guide.items():
        for href in page.hrefs:
            if not href.startswith(("/guide", "#")):
                continue
            target, _, fragment = href.partition("#")
            target = target or path
            assert target in guide, f"{path} links to {href}: no such guide page"
            if fragment:
                assert fragment in guide[target].ids, f"{path} links to {href}: no anchor #{fragment} on {target}"


def test_guide_pages_share_the_site_shell_and_run_no_inline_script(guide):
    for path, page in guide.items():
        assert "/guide" in page.hrefs and "/" in page.hrefs and "/gaussian" in page.hrefs, path  # site nav
        # script-src 'self': every script must come from a file (the guide needs none)
        assert all("src" in attrs for attrs in page.scripts), f"inline <script> on {path}"


def test_unknown_guide_pages_are_404_and_never_read_other_files(client):
    for path in ("/guide/nope", "/guide/science.md", "/guide/..%2FREADME", "/guide/%2E%2E"):
        assert client.get(path).status_code == 404, path


@pytest.mark.parametrize("path", ["/", "/image", "/gaussian"])
def test_section_references_on_pages_link_to_existing_anchors(client, guide, path):
    r = client.get(path)
    assert r.status_code == 200
    page = parse(r.text)
    assert "SPEC" not in r.text and "../shared" not in r.text
    assert page.section_links, f"{path} has no § link"
    for href, text in page.section_links:
        assert href.startswith("/guide#"), (path, href, text)
        fragment = href.partition("#")[2]
        assert fragment in guide["/guide"].ids, (path, href)
        assert text.strip().lstrip("§").split("–")[0].replace(".", "-") == fragment[1:], (href, text)


def test_openapi_descriptions_point_at_the_guide(client, guide):
    text = client.get("/openapi.json").text
    assert "SPEC" not in text and "API.md" not in text
    references = re.findall(r"/guide#(s\d+(?:-\d+)?)", text)
    assert len(references) >= 6, references  # β, masks, perturbations, rollout, building blocks…
    for anchor in references:
        assert anchor in guide["/guide"].ids, anchor
    # a "§n" left in a description must come with its link
    for match in re.finditer(r"§(\d+)", text):
        assert f"/guide#s{match[1]}" in text[match.start(): match.start() + 80], text[match.start() - 40: match.end() + 80]


def test_every_figure_a_guide_page_shows_is_served(client, guide):
    """docs/notebook.md shows img/notebook-widget.png: from /guide/notebook that is /guide/img/…, a 404 before the
    guide served docs/img (the browser logged it as a page error)."""
    from urllib.parse import urljoin

    shown = [(path, urljoin(f"http://testserver{path}", src)) for path, links in guide.items() for src in links.images]
    assert any(src.endswith("notebook-widget.png") for _, src in shown), shown
    for path, src in shown:
        r = client.get(src.removeprefix("http://testserver"))
        assert r.status_code == 200 and r.headers["content-type"] == "image/png", (path, src, r.status_code)
    assert client.get("/guide/img/..%2Fscience.md").status_code == 404
    assert client.get("/guide/img/nothing.png").status_code == 404
