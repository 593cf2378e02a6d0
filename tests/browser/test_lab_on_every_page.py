"""Every page mounts the lab module (issue 40 §5): static/js/lab/lab.js mounts its panels on the text, image and speech
pages and lists what it mounted in `window.attnlab.lab` ({all, panels, lacks}). A page names the panels it lacks, with
the reason, in one place: the `lacks` option of its mountLab call. So a panel added to the lab's list (LAB_PANELS)
appears on every page that does not say it lacks it.

In Chromium, on each page: the lab's list is the same module's list everywhere; what it mounted and what the page lacks
are that list split in two; each mounted panel's controls are on the page, filled by the lab's builders, and a lacked
panel's markup is not (a page cannot keep a panel and say it lacks it). The pages' scripts import no panel module of
static/js/lab/ themselves: only lab.js mounts them (before: the speech page built its own store and mounted its β,
perturbation, softmax and HTML-export panels itself)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = {"text": "/", "image": "/image", "speech": "/audio"}
# The panels a page lacks: the speech page's masks are spans of time and ablated cross heads (its own controls), and it
# shows the transcript before/after instead of the lab's effect panel, summaries, export and link.
LACKS = {"text": set(), "image": set(), "speech": {"masks", "effect", "summaries", "export", "url"}}
# A panel's controls, as its builder (or the shared markup, templates/partials/lab.html) puts them on the page.
SHOWN_BY = {
    "beta": "#beta-slider", "masks": "#masks-panel #mask-reset", "perturb": "#perturb-panel #perturb-apply",
    "softmax": "#softmax-panel #softmax-jacobian", "effect": "#effect-panel #effect-summary",
    "summaries": "#summaries-panel #summary-table", "export": "#export-json", "html-export": "#export-html",
    "url": "#share-url",
}
PANEL_MODULES = ("beta.js", "masks.js", "perturb.js", "softmax.js", "store.js", "export-html.js", "summaries.js")


def test_every_page_mounts_the_labs_panels_but_those_it_says_it_lacks(page, page_log, live_server):
    seen = {}
    for name, path in PAGES.items():
        page.goto(f"{live_server}{path}")
        # before: no page registered anything (the speech page did not mount through lab.js)
        page.wait_for_function("() => window.attnlab && window.attnlab.lab", timeout=30_000)
        lab = page.evaluate("() => window.attnlab.lab")
        seen[name] = lab
        mounted, lacks, every = set(lab["panels"]), set(lab["lacks"]), lab["all"]
        assert set(SHOWN_BY) == set(every), f"a lab panel the test does not know: {every}"
        assert mounted | lacks == set(every) and not mounted & lacks, (name, lab)
        assert lacks == LACKS[name], (name, lab["lacks"])
        assert all(isinstance(why, str) and len(why) > 10 for why in lab["lacks"].values()), lab["lacks"]
        for panel in every:
            count = page.locator(SHOWN_BY[panel]).count()
            assert count == (1 if panel in mounted else 0), (name, panel, count)
        assert page.inner_text("#beta-readout").startswith("β = "), name  # bound to the store by the β panel
        # the lab's active list (lab.js renderActive): after the first response on the text and image pages, at once
        # on the speech page (no clip yet); then no run is left in flight when the next page opens
        page.wait_for_selector("#interventions-list .iv-head", timeout=300_000)
        page.wait_for_load_state("networkidle", timeout=300_000)
    assert seen["text"]["all"] == seen["image"]["all"] == seen["speech"]["all"]
    page_log.check()


def test_no_page_mounts_a_lab_panel_itself():
    imports = re.compile(r"""from\s+["']\./lab/([\w-]+\.js)["']""")
    for script in ("text.js", "image.js", "audio.js"):
        source = (ROOT / "static" / "js" / script).read_text(encoding="utf-8")
        assert "./lab/lab.js" in source, script
        direct = sorted(set(imports.findall(source)) & set(PANEL_MODULES))
        assert direct == [], f"{script} imports {direct}: panels are mounted by static/js/lab/lab.js"
