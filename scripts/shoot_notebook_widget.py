"""The README's picture of the notebook widget in JupyterLab: docs/img/notebook-widget.png.

    .venv/bin/python -m scripts.shoot_notebook_widget   (from the checkout's root: it imports tests/browser's helpers)

Starts a lab server with smollm2-135m (the notebook's origin allowed by cors_origins) and JupyterLab in a temporary
home, both on free 127.0.0.1 ports (as tests/browser/test_notebook_widget.py does), runs a notebook whose cell asks
the client for attention and shows it, and saves the notebook panel, reduced to a 256-colour palette with Pillow.
"""
from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

from PIL import Image

from tests.browser.conftest import CHROMIUM, CHROMIUM_ARGS, serve_app
from tests.browser.test_notebook_widget import jupyterlab_server, notebook, run_notebook

ROOT = Path(__file__).resolve().parent.parent

OUT = ROOT / "docs" / "img" / "notebook-widget.png"
CELL = """from attnlab import Lab
lab = Lab({url!r})
lab.show("The capital of France is", model="smollm2-135m", layer=5, head=3)"""


def main() -> None:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as home, jupyterlab_server(Path(home)) as (url, token, folder):
        server = serve_app({"ATTNLAB_DEFAULT_MODELS": '["smollm2-135m"]', "ATTNLAB_CORS_ORIGINS": json.dumps([url])},
                           log_name="widget-shot-server.log")
        lab_url = next(server)
        try:
            (folder / "attention.ipynb").write_text(json.dumps(notebook([CELL.format(url=lab_url)])))
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1200, "height": 900})
                run_notebook(page, url, token, "attention.ipynb")
                page.evaluate("window.jupyterapp.commands.execute('application:toggle-left-area')")  # the file browser
                page.wait_for_timeout(1500)
                panel = page.locator(".jp-NotebookPanel").bounding_box()
                view = page.locator(".attnlab-embed").bounding_box()
                bottom = min(panel["y"] + panel["height"], view["y"] + view["height"] + 16)  # no empty cell below
                png = page.screenshot(clip={"x": panel["x"], "y": panel["y"], "width": panel["width"], "height": bottom - panel["y"]})
                browser.close()
        finally:
            server.close()
    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    image.save(OUT, optimize=True)
    print(f"{OUT}: {OUT.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
