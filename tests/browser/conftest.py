"""Browser fixtures: one uvicorn server per session, Debian's Chromium driven by Playwright.

`page` records console errors, page errors and every request that leaves 127.0.0.1; tests assert
on them with `page_log`. Screenshots go to artifacts/screenshots/ (kept as CI artifacts).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.server_launcher import launch

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "artifacts" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVER_PIDS: dict[str, int] = {}  # base URL → the pid of the server serve_app started there


def serve_app(env_extra: dict[str, str] | None = None, log_name: str = "browser-server.log"):
    """Start `uvicorn app.main:app` on a free loopback port and wait for /api/ready; yields the base URL,
    stops the server after. Its output goes to artifacts/<log_name>. Forked by tests/server_launcher.py (torch and
    transformers imported once per worker; ATTNLAB_TEST_EXEC=1: a plain exec)."""
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    (ROOT / "artifacts").mkdir(exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # each pytest-xdist worker starts its own session server
    log_path = ROOT / "artifacts" / (log_name.replace(".log", f"-{worker}.log") if worker else log_name)
    with open(log_path, "w") as log:
        proc = launch(
            [sys.executable, "-m", "uvicorn", "app.main:app", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        SERVER_PIDS[url] = proc.pid  # a forked server's /proc/<pid>/cmdline is its zygote's, so find it by this
        deadline = time.time() + 600  # two pytest-xdist workers may load their servers' models at once on 2 cores
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"server did not become ready; see {log_path}")
            time.sleep(0.5)
        try:
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=15)


@pytest.fixture(scope="session")
def live_server():
    yield from serve_app()


@pytest.fixture(scope="session")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class PageLog:
    def __init__(self):
        self.errors: list[str] = []
        self.external: list[str] = []

    def check(self):
        assert self.errors == [], f"console/page errors: {self.errors}"
        assert self.external == [], f"requests outside the server: {self.external}"


@pytest.fixture
def page_log() -> PageLog:
    return PageLog()


@pytest.fixture
def page(browser, page_log):
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    pg = context.new_page()
    pg.on("console", lambda m: page_log.errors.append(m.text) if m.type == "error" else None)
    # the stack names the script and line of an uncaught error (the message alone often doesn't say where)
    pg.on("pageerror", lambda e: page_log.errors.append(f"{e.message}\n{e.stack or ''}".strip()))

    def on_request(request):
        host = urlparse(request.url).hostname
        if request.url.startswith(("data:", "blob:")) or host in ("127.0.0.1", "localhost"):
            return
        page_log.external.append(request.url)

    pg.on("request", on_request)
    yield pg
    context.close()


def screenshot(pg, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    full_page_screenshot(pg, path)
    return path


TALL_PAGE_PX = 10_000


def full_page_screenshot(pg, path: Path) -> None:
    """The whole page as a PNG. A page taller than TALL_PAGE_PX (the guide: 24,000 px at 1400 px wide, 49,000 on a
    phone) is shot with the viewport stretched to its height, then put back: Chromium's full-page capture took
    90–126 s for /guide on a loaded 2-core machine, the stretched viewport 9–15 s for the same pixels."""
    height = pg.evaluate("() => document.documentElement.scrollHeight")
    viewport = pg.viewport_size
    if viewport is None or height <= TALL_PAGE_PX:
        pg.screenshot(path=str(path), full_page=True, timeout=120_000)  # 30 s (the default) is short on a busy machine
        return
    pg.set_viewport_size({"width": viewport["width"], "height": height})
    try:
        pg.screenshot(path=str(path), timeout=120_000)
    finally:
        pg.set_viewport_size(viewport)


@contextmanager
def phone_page(browser):
    """A page in a phone-sized context (390 × 844 CSS px at 2× pixels), closed at the end."""
    context = browser.new_context(viewport={"width": PHONE_WIDTH, "height": 844}, device_scale_factor=2)
    try:
        yield context.new_page()
    finally:
        context.close()


PHONE_WIDTH = 390


def assert_fits_a_phone(pg) -> None:
    width = pg.evaluate("() => document.documentElement.scrollWidth")
    assert width <= PHONE_WIDTH + 1, f"the page scrolls sideways on a phone: {width} px"


def plot_data(pg, selector: str):
    """The data of a Plotly figure (its first trace's z, or y) as plain JSON."""
    return pg.eval_on_selector(selector, "el => { const t = el.data && el.data[0]; return t ? (t.z || t.y) : null; }")


def shown_p(pg, selector: str = "#heatmap"):
    """The P an attention heatmap shows: its hover values (customdata) where the colours are on another scale
    (log₁₀ P, P / row max), else its z."""
    return pg.eval_on_selector(selector, "el => { const t = el.data && el.data[0]; return t ? (t.customdata || t.z) : null; }")


def masked_cells(pg, selector: str = "#heatmap"):
    """The cells an attention heatmap draws grey as forbidden by a mask: (i, j) pairs, from its overlay trace."""
    return pg.eval_on_selector(selector, """el => { const t = (el.data || []).find(d => d.name === 'masked');
        return t ? t.z.flatMap((row, i) => row.map((v, j) => v === 1 ? [i, j] : null).filter(Boolean)) : []; }""")
