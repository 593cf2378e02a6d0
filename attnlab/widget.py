"""The lab's own views in a notebook: an anywidget (JupyterLab, Notebook 7, VS Code, marimo) whose ES module is the
same bundle as the standalone export (attnlab/export.py: static/js/views/embed.js and the page's views it imports).

The response is the widget's data, so layer, head, view-mode β, key masks and the colour scale work in the browser
without a round trip. Run mode re-runs the model on the lab server from the browser, as the text page does: the
server must allow the notebook's origin (the `cors_origins` setting, e.g. ATTNLAB_CORS_ORIGINS='["http://localhost:8888"]';
docs/notebook.md). plotly.js comes from the lab server too (/static/vendor/plotly.min.js, a classic script: no CORS
needed) unless the notebook's page already has it.

anywidget is optional for the client: `pip install anywidget` (requirements-dev.txt pins it).
"""
from __future__ import annotations

import functools
import json
from typing import Any

from attnlab.export import ENTRY, LOADER_JS, complete_response, module_sources, static_reader

try:
    import anywidget
    import traitlets
except ImportError:  # the client works without it; show() says what to install
    anywidget = None

# The widget's module: the bundle's loader and sources, plotly.js from the lab when the page has none, then the
# embedded view mounted in the output cell. AMD loaders (some notebook front ends have RequireJS) would take the
# UMD plotly.js bundle as a module instead of setting window.Plotly: `define` is hidden while it loads.
_ESM_TEMPLATE = """
const SOURCES = %(sources)s;
const ENTRY = %(entry)s;
%(loader)s
let plotlyLoading = null;
function loadPlotly(server) {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  if (!server) return Promise.reject(new Error("plotly.js is not on this page and the widget has no lab URL to load it from"));
  plotlyLoading ??= new Promise((resolve, reject) => {
    const amd = window.define;
    window.define = undefined;
    const script = document.createElement("script");
    script.src = `${server.replace(/\\/$/, "")}/static/vendor/plotly.min.js`;
    script.onload = () => { window.define = amd; resolve(window.Plotly); };
    script.onerror = () => { window.define = amd; plotlyLoading = null; reject(new Error(`could not load ${script.src}`)); };
    document.head.append(script);
  });
  return plotlyLoading;
}
export default {
  async render({ model, el }) {
    const root = document.createElement("div");
    root.className = "attnlab-widget";
    root.textContent = "loading the attnlab view…";
    el.append(root);
    const server = model.get("server") || null;
    let view = null;
    try {
      const [{ mountEmbed }] = await Promise.all([attnlabImport(SOURCES, ENTRY), loadPlotly(server)]);
      view = mountEmbed(root, { response: model.get("response"), request: model.get("request"), server,
        layer: model.get("layer"), head: model.get("head") });
    } catch (err) {
      root.textContent = `the attnlab view could not start: ${err.message}`;
      root.dataset.state = "error";
    }
    return () => view?.destroy();
  },
};
"""


@functools.lru_cache(maxsize=4)
def widget_esm(lab_url: str | None = None) -> str:
    """The widget's ES module: the embedded view's bundle (read from the checkout, else from the lab at lab_url)."""
    sources = module_sources(ENTRY, static_reader(lab_url))
    return _ESM_TEMPLATE % {"sources": json.dumps(sources), "entry": json.dumps(ENTRY), "loader": LOADER_JS}


if anywidget is not None:
    class AttentionWidget(anywidget.AnyWidget):
        """One attention response in the lab's views. response/request: the server's answer and the body that asked
        for it; server: the lab's URL (plotly.js and run mode), or "" for none."""

        response = traitlets.Dict().tag(sync=True)
        request = traitlets.Dict(allow_none=True).tag(sync=True)
        server = traitlets.Unicode("").tag(sync=True)
        layer = traitlets.Int(None, allow_none=True).tag(sync=True)  # the head shown first (model numbering)
        head = traitlets.Int(None, allow_none=True).tag(sync=True)

        def __init__(self, response: dict, request: dict | None = None, server: str | None = None, **kwargs: Any):
            # anywidget takes the module from the `_esm` attribute it finds at __init__ (read here: from the checkout,
            # or outside one from the lab that serves the same files)
            self._esm = widget_esm(None if _has_checkout() else server)
            super().__init__(response=response, request=request, server=server or "", **kwargs)
else:  # pragma: no cover - exercised only without anywidget
    AttentionWidget = None


def _has_checkout() -> bool:
    from attnlab.export import STATIC_JS

    return (STATIC_JS / ENTRY).is_file()


def show(result: Any, **options: Any):
    """The notebook widget of `result` (a client result with .response, .request, .lab): heatmap, head view,
    layer/head menus, β (view mode here, run mode on the lab), key masks, colour scale, the effect panel.
    options: layer=, head= (the head shown first, model numbering), server= (another URL for the lab).
    Returns the widget: the last expression of a cell displays it."""
    if AttentionWidget is None:
        raise ImportError("the attnlab notebook widget needs anywidget: pip install anywidget")
    response, request = complete_response(result)
    lab = getattr(result, "lab", None)
    server = options.pop("server", None) or (str(lab.url).rstrip("/") if getattr(lab, "url", None) else None)
    return AttentionWidget(response, request=request, server=server, **options)
