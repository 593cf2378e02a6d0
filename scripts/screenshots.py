"""Screenshots of every page for the README, into docs/img/ (small PNGs).

    .venv/bin/python scripts/screenshots.py            # all pages
    .venv/bin/python scripts/screenshots.py text guide # some of them

Starts the app on a free 127.0.0.1 port (like the browser tests), opens each page in Debian's Chromium
(/usr/bin/chromium, driven by Playwright; never a browser download), waits until its figures are drawn
and the page is idle, and saves a 1200 px wide view (800 px high, more for the text pages), reduced to a 256-colour palette with Pillow (the pages
are flat colours and text: this keeps each file near 100 KB). The LM view is taken when /api/models
lists a model whose output is "next_token". Nothing is fetched outside the machine.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "img"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1200, "height": 800}
# Taller views where the first figures sit below the controls.
HEIGHTS = {"text": 1150, "lm": 1150, "image": 900, "long-input": 1300, "gemma3-long": 1300}
MAX_BYTES = 150_000
LM_PROMPT = "The capital of France is"

COUNT_DRAWN = "() => [...document.querySelectorAll('.js-plotly-plot')].filter(el => el.data && el.data.length).length"


def log(msg: str) -> None:
    print(f"[screenshots] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    handle = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "app.main:app", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 900  # a loaded shared machine: the default models load and are timed first
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/ready", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise SystemExit(f"the server did not become ready; see {log_path}")
        time.sleep(0.5)


def wait_drawn(page, figures: int, timeout_s: float = 180) -> None:
    """Until at least `figures` Plotly figures hold data, the status line is not busy, and both stay so
    for a moment (late panels catch up ~150 ms after the first)."""
    deadline, stable = time.time() + timeout_s, 0
    while time.time() < deadline:
        drawn = page.evaluate(COUNT_DRAWN)
        status = page.evaluate("() => (document.querySelector('#status') || {}).textContent || ''")
        stable = stable + 1 if drawn >= figures and "running" not in status and "loading" not in status else 0
        if stable >= 4:
            page.wait_for_timeout(500)
            return
        page.wait_for_timeout(250)
    raise SystemExit(f"{page.url}: only {page.evaluate(COUNT_DRAWN)} of {figures} figures drawn in {timeout_s:.0f} s")


def save_small(png: bytes, path: Path) -> int:
    """The screenshot as an optimised 256-colour PNG; fewer colours if it is still over MAX_BYTES."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    for colours in (256, 128, 64):
        buffer = io.BytesIO()
        image.quantize(colors=colours, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
            buffer, "PNG", optimize=True)
        if buffer.tell() <= MAX_BYTES:
            break
    path.write_bytes(buffer.getvalue())
    return buffer.tell()


def next_token_model(url: str) -> str | None:
    with urllib.request.urlopen(f"{url}/api/models?kind=text", timeout=120) as r:
        models = json.load(r)["models"]
    return next((m["id"] for m in models if m.get("output") == "next_token"), None)


def shoot_text(page, url):
    page.goto(f"{url}/#m=minilm")  # the encoder view (the page opens on the LM: that is the "lm" shot)
    wait_drawn(page, 4)


def shoot_image(page, url):
    page.goto(f"{url}/image")
    page.wait_for_selector("#overlay g.hm image", state="attached", timeout=180_000)
    wait_drawn(page, 3)


def shoot_gaussian(page, url):
    page.goto(f"{url}/gaussian")
    wait_drawn(page, 5)


def shoot_guide(page, url):
    page.goto(f"{url}/guide#s4")
    page.wait_for_selector("#s4")
    page.wait_for_timeout(300)


def shoot_lm(page, url):
    model = next_token_model(url)
    if model is None:
        log("no model with output 'next_token' listed by /api/models: LM view skipped")
        return False
    page.goto(f"{url}/#m={quote(model)}&t={quote(LM_PROMPT)}")
    page.wait_for_selector("#lm-panels:not([hidden])", timeout=300_000)
    wait_drawn(page, 4, timeout_s=300)
    page.wait_for_selector("#generate-button:not([disabled])", timeout=120_000)
    page.fill("#max-new-tokens", "8")
    page.click("#generate-button")  # the two continuations, streamed
    page.wait_for_selector("#continuation[data-state]:not([data-state='running'])", state="attached", timeout=300_000)
    state = page.get_attribute("#continuation", "data-state")
    if state != "done":
        raise SystemExit(f"continuation {state}: {page.text_content('#status')!r}")
    page.wait_for_timeout(300)
    return True


def shoot_long(page, url):
    """The shipped ~3,000-token sample on smollm2-135m (over full_map_tokens: an overview), zoomed to an exact window
    from the question at the end onto the fact near the start, on the head that puts the most attention there (the
    retrieval view's strongest head), with that window's head view and the last token's row over every key."""
    model = next_token_model(url)
    if model is None:
        log("no model with output 'next_token' listed by /api/models: long view skipped")
        return False
    sample = (ROOT / "static" / "samples" / "long-sample.txt").read_text()
    page.goto(f"{url}/#m={quote(model)}&t={quote(sample)}")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'overview'", timeout=900_000)
    page.wait_for_function("() => document.querySelectorAll('#token-strip .tok').length > 512", timeout=120_000)
    tokens = page.eval_on_selector_all("#token-strip .tok", "els => els.map(e => e.textContent)")
    fact = next(i for i, t in enumerate(tokens) if t.strip() == "tin")  # "…is kept in a tin box under the third step…"
    n = len(tokens)
    cols, rows = [max(0, fact - 22), fact + 18], [n - 40, n]
    # the retrieval view: which head puts the most attention from the last token on the fact's span
    page.fill("#atlas-span-from", str(fact - 12))
    page.fill("#atlas-span-to", str(fact + 10))
    page.fill("#atlas-span-row", str(n - 1))
    page.click("#atlas-span-go")
    page.wait_for_function("() => document.getElementById('atlas-retrieval').dataset.best", timeout=120_000)
    best = page.eval_on_selector("#atlas-retrieval", "el => JSON.parse(el.dataset.best)")
    log(f"long: {n} tokens, fact at {fact}; strongest head layer {best['layer']}, head {best['head']} ({best['mass']:.3f})")
    page.select_option("#layer-select", str(best["layer"]))
    page.wait_for_function(f"() => document.getElementById('heatmap').layout?.title?.text?.includes('layer {best['layer']},')",
                           timeout=120_000)
    page.select_option("#head-select", str(best["head"]))
    page.wait_for_function(f"() => document.getElementById('heatmap').layout?.title?.text?.includes('head {best['head']}')"
                           " && document.getElementById('heatmap').dataset.atlas === 'overview'", timeout=120_000)
    page.evaluate(f"""() => Plotly.relayout('heatmap', {{'xaxis.range[0]': {cols[0]}, 'xaxis.range[1]': {cols[1]},
                                                        'yaxis.range[0]': {rows[1]}, 'yaxis.range[1]': {rows[0]}}})""")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'window-labels'", timeout=120_000)
    page.select_option("#atlas-row-scope", "layer")
    page.evaluate(f"() => document.getElementById('heatmap').emit('plotly_click', {{points: [{{y: {n - 1}.2, x: 3}}]}})")
    page.wait_for_function("() => (document.getElementById('atlas-row').data || []).length > 1", timeout=120_000)
    page.evaluate("() => { document.getElementById('heatmap').closest('.row').scrollIntoView(); window.scrollBy(0, -60); }")
    page.wait_for_timeout(800)
    return True


def shoot_gemma3_long(page, url):
    """gemma3-270m on the long sample (~3,000 tokens): a local layer (4, window 512) beside the global layer 5, each as
    its overview (the local one with the band's edge) over the last token's row for every head of the layer. Two
    shots of the page composed side by side (one heatmap at a time on the page); returns the PNG bytes."""
    with urllib.request.urlopen(f"{url}/api/models?kind=text", timeout=120) as r:
        if "gemma3-270m" not in {m["id"] for m in json.load(r)["models"]}:
            log("gemma3-270m is not prepared here (make gemma3-270m): skipped")
            return False
    sample = (ROOT / "static" / "samples" / "long-sample.txt").read_text()
    page.goto(f"{url}/#m=gemma3-270m&t={quote(sample)}&l=4&h=0")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'overview'", timeout=900_000)
    page.select_option("#atlas-row-scope", "layer")
    halves = []
    for layer, name in ((4, "local 512"), (5, "global")):
        if layer != 4:
            page.select_option("#layer-select", str(layer))
        page.wait_for_function(f"() => document.getElementById('heatmap').layout?.title?.text?.includes('layer {layer} · {name}')"
                               " && document.getElementById('heatmap').dataset.atlas === 'overview'", timeout=300_000)
        n = page.locator("#token-strip .tok").count()
        page.evaluate("() => document.getElementById('atlas-row').data = null")
        page.evaluate(f"() => document.getElementById('heatmap').emit('plotly_click', {{points: [{{y: {n - 1}.2, x: 3}}]}})")
        page.wait_for_function("() => (document.getElementById('atlas-row').data || []).length === 4", timeout=120_000)
        page.wait_for_timeout(800)
        box = page.eval_on_selector("#heatmap", """el => { const a = el.getBoundingClientRect(),
            b = document.getElementById('atlas-row').getBoundingClientRect();
            return {x: a.left + window.scrollX, y: a.top + window.scrollY, width: Math.max(a.right, b.right) - a.left,
                    height: b.bottom - a.top}; }""")  # page coordinates: the map, its notes and the row plot
        halves.append(Image.open(io.BytesIO(page.screenshot(clip=box, full_page=True))).convert("RGB"))
        log(f"gemma3-long: layer {layer} ({name}), {n} tokens")
    width = sum(h.width for h in halves) + 20
    sheet = Image.new("RGB", (width, max(h.height for h in halves)), "white")
    sheet.paste(halves[0], (0, 0))
    sheet.paste(halves[1], (halves[0].width + 20, 0))
    sheet = sheet.resize((1200, round(sheet.height * 1200 / sheet.width)), Image.LANCZOS)
    buffer = io.BytesIO()
    sheet.save(buffer, "PNG")
    return buffer.getvalue()


def shoot_generate_map(page, url):
    """The continuation panel while the model writes (issue 39): layer 18 head 6 of smollm2-135m, with "Italy" masked,
    the growing maps side by side, and a generated token's row clicked (its bars and "why?")."""
    prompt = "The capital of France is Paris. The capital of Italy is"
    page.goto(f"{url}/#m=smollm2-135m&t={quote(prompt)}&l=18&h=6&mk=10&ms=all")
    page.wait_for_selector("#lm-panels:not([hidden])", timeout=300_000)
    wait_drawn(page, 4, timeout_s=300)
    page.wait_for_selector("#generate-button:not([disabled])", timeout=120_000)
    page.fill("#max-new-tokens", "12")
    page.click("#generate-button")
    page.wait_for_selector("#continuation[data-state]:not([data-state='running'])", state="attached", timeout=300_000)
    if page.get_attribute("#continuation", "data-state") != "done":
        raise SystemExit(f"continuation: {page.text_content('#continuation-status')!r}")
    page.wait_for_function("() => Number(document.getElementById('gen-map-intervened').dataset.rows) > 3")
    page.evaluate("() => document.getElementById('gen-map-intervened').emit('plotly_click', {points: [{pointIndex: [3, null]}]})")
    page.wait_for_selector("#gen-why-button", timeout=60_000)
    page.wait_for_timeout(500)
    return page.locator("#continuation").screenshot()


def shoot_circuit(page, url):
    """The circuit view (issue 51): IOI on smollm2-135m, eight generated pairs scored by EAP, the circuit at 5 % of
    the edges with its faithfulness curve, and the largest drawn <k> edge clicked (its attention row with and without
    it, and its QK attribution with the sender's part outlined)."""
    page.goto(f"{url}/#m=smollm2-135m&t={quote(LM_PROMPT)}")
    page.wait_for_selector("#circuit-panel:not([hidden])", timeout=300_000)
    wait_drawn(page, 4, timeout_s=300)
    page.select_option("#circuit-task", "ioi")
    page.fill("#circuit-n", "8")
    page.select_option("#circuit-method", "eap")
    page.click("#circuit-run")
    page.wait_for_selector("#circuit-panel[data-state]:not([data-state='running'])", state="attached", timeout=900_000)
    if page.get_attribute("#circuit-panel", "data-state") != "done":
        raise SystemExit(f"circuit: {page.text_content('#circuit-error')!r}")
    names = page.eval_on_selector("#circuit-graph", "el => el.data.find(t => t.meta === 'picks').customdata")
    index = next(i for i, name in enumerate(names) if name.endswith("<k>"))
    page.evaluate("name => document.getElementById('circuit-graph').emit('plotly_click', "
                  "{points: [{customdata: name, data: {meta: 'picks'}}]})", names[index])
    page.wait_for_selector("#circuit-edge[data-state]:not([data-state='running'])", state="attached", timeout=300_000)
    if page.get_attribute("#circuit-edge", "data-state") != "done":
        raise SystemExit(f"circuit edge: {page.text_content('#circuit-edge-status')!r}")
    page.add_style_tag(content=".topbar { position: static !important; }")  # the sticky bar would cover the panel
    page.wait_for_timeout(500)
    return page.locator("#circuit-panel").screenshot()


SHOTS = {"text": shoot_text, "image": shoot_image, "gaussian": shoot_gaussian, "guide": shoot_guide, "lm": shoot_lm,
         "long-input": shoot_long, "gemma3-long": shoot_gemma3_long, "generate-map": shoot_generate_map,
         "circuit": shoot_circuit}


def shoot_luong(page, url):
    """/luong (docs/science.md §16): the dot score on "the 3rd of March 2021" with the year's four characters masked,
    its alignment, output and effect beside the Transformer's cross-attention per head."""
    page.set_viewport_size({"width": 1200, "height": 1480})
    page.goto(f"{url}/luong")
    page.wait_for_function("() => document.body.dataset.luongDrawn", timeout=180_000)
    page.select_option("#luong-score", "dot")
    page.wait_for_function("() => document.body.dataset.luongScore === 'dot' && !document.body.dataset.luongBusy")
    text = page.input_value("#luong-text")
    year = [text.index("2021") + i for i in range(4)]
    for pos in year:
        page.click(f"#luong-source button[data-pos='{pos}']")
    page.wait_for_function("m => document.body.dataset.luongMask === m && !document.body.dataset.luongBusy",
                           arg=",".join(map(str, year)))
    wait_drawn(page, 4)


SHOTS["luong"] = shoot_luong


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", help=f"some of {', '.join(SHOTS)} (default: all)")
    args = parser.parse_args()
    names = args.pages or list(SHOTS)
    unknown = [n for n in names if n not in SHOTS]
    if unknown:
        parser.error(f"unknown page(s) {unknown}; choose from {list(SHOTS)}")
    if not Path(CHROMIUM).exists():
        raise SystemExit(f"{CHROMIUM} is missing: `make browser` installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    OUT.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = ROOT / "artifacts" / "screenshots-server.log"
    log_path.parent.mkdir(exist_ok=True)
    log(f"starting the app on {url} (log: {log_path})")
    server = start_server(port, log_path)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            for name in names:
                viewport = {**VIEWPORT, "height": HEIGHTS.get(name, VIEWPORT["height"])}
                context = browser.new_context(viewport=viewport, device_scale_factor=1)
                page = context.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                started = time.time()
                shot = SHOTS[name](page, url)
                if shot is False:
                    context.close()
                    continue
                # a shot that composes its own picture returns its PNG; the others are the page's view
                size = save_small(shot if isinstance(shot, bytes) else page.screenshot(), OUT / f"{name}.png")
                log(f"{name}: docs/img/{name}.png, {size / 1000:.0f} KB, {time.time() - started:.1f} s"
                    + (f"; page errors: {errors}" if errors else ""))
                context.close()
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
