"""The notebook widget (attnlab/widget.py, issue 31) in a real JupyterLab: `jupyter lab` from PyPI started headless on
a free port with a token, in a temporary home; a lab server of its own (a tiny random BERT, the notebook's origin
allowed by the cors_origins setting); a notebook opened in Chromium whose cell runs the client and `.show()`.

The heatmap appears with the server's P, a β drag (view mode) re-normalises it in the browser, and run mode re-runs
the model on the lab from the notebook's page (a cross-origin POST) and draws the effect panel.

Cost (measured on the shared 2-core machine): about 40-60 s, most of it JupyterLab's start and first page load."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.browser.conftest import ROOT, _free_port, screenshot, serve_app, shown_p

pytestmark = pytest.mark.slow  # a real JupyterLab and a server

pytest.importorskip("jupyterlab")
pytest.importorskip("anywidget")

TEXT = "the cat sat on the mat because it was tired"
VIEW = ".attnlab-embed"
HEATMAP = f"{VIEW} [data-role=heatmap]"


@contextlib.contextmanager
def jupyterlab_server(home: Path):
    """JupyterLab on a free loopback port with a token, its config, data and runtime under `home`; yields
    (base URL, token, notebook folder). Also used by scripts/shoot_notebook_widget.py (the README's picture)."""
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "HOME": str(home), "JUPYTER_CONFIG_DIR": str(home / "config"),
           "JUPYTER_DATA_DIR": str(home / "data"), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
           "IPYTHONDIR": str(home / "ipython"), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    notebooks = home / "notebooks"
    notebooks.mkdir(parents=True, exist_ok=True)
    # no "get notified about Jupyter news?" toast over the output (a user setting, in this home)
    news = home / "config" / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True, exist_ok=True)
    news.write_text(json.dumps({"fetchNews": "false"}))
    log_path = ROOT / "artifacts" / "jupyterlab.log"
    log_path.parent.mkdir(exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={notebooks}", "--allow-root",  # CI runs as root
             "--LabApp.extension_manager=readonly",  # no PyPI look-ups from the extension manager
             "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: run the cell by its command
             "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
            cwd=notebooks, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"jupyter lab did not start; see {log_path}")
            time.sleep(0.5)
        try:
            yield url, token, notebooks
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def jupyter(tmp_path_factory):
    with jupyterlab_server(tmp_path_factory.mktemp("jupyter")) as started:
        yield started


@pytest.fixture(scope="module")
def lab_for_notebook(jupyter, tiny_bert):
    """A lab server with the tiny BERT that answers the notebook's page (its origin in cors_origins)."""
    url, _, _ = jupyter
    yield from serve_app({"ATTNLAB_DEFAULT_MODELS": '["tiny"]', "ATTNLAB_EXTRA_TEXT_MODELS": json.dumps({"tiny": str(tiny_bert)}),
                          "ATTNLAB_CORS_ORIGINS": json.dumps([url])}, log_name="widget-lab-server.log")


def notebook(cells: list[str]) -> dict:
    return {"nbformat": 4, "nbformat_minor": 5, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
            "cells": [{"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": c, "id": f"c{i}"}
                      for i, c in enumerate(cells)]}


def run_notebook(pg, url: str, token: str, name: str) -> None:
    """Open the notebook, wait for its kernel, run every cell by JupyterLab's own command, wait for the heatmap."""
    pg.goto(f"{url}/lab/tree/{name}?token={token}", timeout=120_000)
    pg.wait_for_function("""window.jupyterapp && (() => { const w = window.jupyterapp.shell.currentWidget;
        return w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel
          && w.sessionContext.session.kernel.status === 'idle'; })()""", timeout=120_000)
    pg.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    pg.wait_for_function(f"document.querySelector('{HEATMAP}')?.data?.[0]?.z?.length > 0", timeout=120_000)


def drag_beta(pg, to_fraction: float):
    box = pg.locator(f"{VIEW} [data-role=beta]").bounding_box()
    y = box["y"] + box["height"] / 2
    pg.mouse.move(box["x"] + box["width"] / 2, y)
    pg.mouse.down()
    pg.mouse.move(box["x"] + box["width"] * to_fraction, y, steps=10)
    pg.mouse.up()


def test_widget_in_jupyterlab_draws_and_follows_beta(jupyter, lab_for_notebook, browser):
    url, token, folder = jupyter
    lab_url = lab_for_notebook
    source = f"from attnlab import Lab\nlab = Lab({lab_url!r})\nlab.show({TEXT!r}, model='tiny')"
    (folder / "widget.ipynb").write_text(json.dumps(notebook([source])))
    ask = urllib.request.Request(f"{lab_url}/api/text/attention", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "tiny", "text": TEXT, "encoding": "json"}).encode())
    with urllib.request.urlopen(ask, timeout=60) as answer:
        expected = json.loads(answer.read())

    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    try:
        run_notebook(pg, url, token, "widget.ipynb")
        before = shown_p(pg, HEATMAP)
        P = expected["attention"][0][0]
        assert np.array_equal(np.array(before, dtype=np.float32), np.array(P, dtype=np.float32))  # the server's P
        screenshot(pg, "notebook-widget-jupyterlab")

        # view mode: a β drag re-normalises the scores in the browser
        beta0 = expected["native_beta"]
        drag_beta(pg, 0.95)
        pg.wait_for_function(f"Number(document.querySelector('{HEATMAP}').dataset.beta) > {beta0 * 10}", timeout=20_000)
        pg.wait_for_timeout(400)
        after = shown_p(pg, HEATMAP)
        assert max(abs(a - b) for ra, rb in zip(after, before) for a, b in zip(ra, rb)) > 0.05
        assert not pg.locator(f"{VIEW} [data-role=effect]").is_visible()  # no effect panel without a run

        # run mode: the same β re-run on the lab from the notebook's page (CORS), with the effect panel
        pg.select_option(f"{VIEW} [data-role=mode]", "run")
        pg.wait_for_function(f"document.querySelector('{VIEW}').dataset.state === 'ready'"
                             f" && document.querySelector('{HEATMAP}').data[0] && !document.querySelector('{VIEW} [data-role=effect]').hidden",
                             timeout=60_000)
        ran = shown_p(pg, HEATMAP)
        assert "run on the server" in pg.eval_on_selector(HEATMAP, "el => el.layout.title.text")
        assert max(abs(a - b) for ra, rb in zip(ran, before) for a, b in zip(ra, rb)) > 0.05
        assert pg.locator(f"{VIEW} [data-role=effect] dl dt").count() > 0  # the output change, from the lab
        assert pg.locator(f"{VIEW} [data-role=effect]").is_visible()
        screenshot(pg, "notebook-widget-jupyterlab-run")
        assert errors == [], errors
    finally:
        context.close()
