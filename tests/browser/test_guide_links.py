"""The guide in Chromium: /guide renders its sections with a working contents list (also on a phone), every
"§" link the pages show (server-rendered or built by their scripts) leads to an anchor that exists on
/guide, and nothing links to ../shared (pages or README)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.browser.conftest import screenshot

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = [f"s{n}" for n in range(1, 10)]
COUNT_DRAWN = "() => [...document.querySelectorAll('.js-plotly-plot')].filter(el => el.data && el.data.length).length"
# (href, text) of every link whose text has a "§", and the "§"s of the visible text outside links
SECTION_LINKS = """() => {
  const links = [...document.querySelectorAll('a')].filter(a => a.textContent.includes('§'));
  const all = (document.body.innerText.match(/§/g) || []).length;
  // innerText of a link that is not rendered (a hidden panel) is its whole text: count only shown links
  const shown = links.filter(a => a.getClientRects().length > 0);
  const linked = shown.reduce((n, a) => n + (a.innerText.match(/§/g) || []).length, 0);
  return {links: links.map(a => [a.getAttribute('href'), a.textContent]), unlinked: all - linked};
}"""


def wait_drawn(pg, figures: int, timeout_s: float = 120):
    """Until `figures` Plotly figures hold data and the status line is not busy (polled from Python)."""
    for _ in range(int(timeout_s * 4)):
        status = pg.text_content("#status") or ""
        if pg.evaluate(COUNT_DRAWN) >= figures and "running" not in status:
            pg.wait_for_timeout(400)
            return
        pg.wait_for_timeout(250)
    raise AssertionError(f"{pg.url}: {pg.evaluate(COUNT_DRAWN)} figures drawn, status {pg.text_content('#status')!r}")


def guide_anchors(pg, live_server, path="/guide") -> set[str]:
    pg.goto(live_server + path)
    return set(pg.eval_on_selector_all("[id]", "els => els.map(e => e.id)"))


def test_guide_renders_its_sections_and_contents(live_server, page, page_log):
    page.goto(live_server + "/guide")
    for anchor in SECTIONS:
        heading = page.locator(f"h2#{anchor}")
        assert heading.count() == 1, anchor
        assert heading.inner_text().startswith(f"{anchor[1:]}. "), heading.inner_text()
    assert page.locator(".topbar nav a.active").inner_text() == "Guide"  # the site's nav, with the guide marked
    # the contents list jumps to a section and shows it below the sticky top bar
    page.locator(".guide-toc a[href='#s7']").click()
    page.wait_for_function("() => location.hash === '#s7'")
    page.wait_for_timeout(300)
    top = page.eval_on_selector("#s7", "el => el.getBoundingClientRect().top")
    bar = page.eval_on_selector(".topbar", "el => el.getBoundingClientRect().bottom")
    assert bar <= top < 400, (bar, top)
    # formulas stay readable text (no MathJax): the key-perturbation identity is in §4.1
    assert "Ŝ[i, j] = q_i · (α k_j + ε) = α S[i, j] + q_i · ε" in page.inner_text("#guide-body")
    screenshot(page, "guide")
    for path in ("/guide/api", "/guide/configuration"):
        page.goto(live_server + path)
        assert page.locator(".guide-pages a.active").get_attribute("href") == path
        assert page.locator(".guide-body h2").count() >= 3
    page_log.check()


def test_guide_fits_a_phone(live_server, browser):
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    try:
        pg = context.new_page()
        for path in ("/guide", "/guide/api", "/guide/configuration"):
            pg.goto(live_server + path)
            width = pg.evaluate("() => document.documentElement.scrollWidth")
            assert width <= 390, f"{path} scrolls sideways: {width} px wide"
        screenshot(pg, "guide-phone")
    finally:
        context.close()


@pytest.mark.parametrize("path, figures", [("/", 3), ("/image", 3), ("/gaussian", 5), ("/#m=smollm2-135m", 4)])
def test_every_section_link_on_a_page_resolves(live_server, page, page_log, path, figures):
    page.goto(live_server + path)
    wait_drawn(page, figures)  # help built by the page's scripts is there too
    found = page.evaluate(SECTION_LINKS)
    body = page.inner_text("body")
    assert "SPEC" not in body, re.findall(r".{0,60}SPEC.{0,20}", body)
    assert found["links"], f"{path} shows no § link"
    assert found["unlinked"] == 0, f"{path}: {found['unlinked']} '§' shown outside a link"
    anchors = guide_anchors(page, live_server)
    for href, text in found["links"]:
        assert href.startswith("/guide#"), (path, href, text)
        assert href.split("#", 1)[1] in anchors, f"{path}: {text!r} links to {href}, which /guide lacks"
    page_log.check()


def test_nothing_links_to_shared(live_server, page):
    for path in ("/", "/image", "/gaussian", "/guide", "/guide/api", "/guide/configuration", "/docs"):
        page.goto(live_server + path)
        urls = page.eval_on_selector_all("[href], [src]", "els => els.map(e => e.getAttribute('href') || e.getAttribute('src'))")
        assert not [u for u in urls if "shared/" in u or "SPEC.md" in u or "API.md" in u], (path, urls)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "../shared" not in readme and "SPEC.md" not in readme
    for target in re.findall(r"\]\(([^)#\s]+)", readme):  # every relative link of the README exists in the repo
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links {target}, which is not in the repository"
