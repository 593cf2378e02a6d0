"""One self-contained HTML file of an attention response: the data inlined, plotly.js and the lab's own view modules
(static/js/views/embed.js and what it imports) bundled, so it opens offline from file:// and keeps the view-mode
controls (layer, head, view-mode β, key masks, colour scale) without a server.

The modules are the page's, not a copy: each is read from the checkout's static/js (or, outside a checkout, from the
lab server that serves them), its relative imports renamed to `attnlab-module:<path>`, and a small loader turns them
into blob: URLs in the browser (an ES module from a blob: URL imports the others by their blob: URLs). The notebook
widget (attnlab/widget.py) ships the same bundle as its ESM.

Standard library only: the client package does not need the server's dependencies to export.
"""
from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

from attnlab.vendor import plotly_bundle

STATIC_JS = Path(__file__).resolve().parents[1] / "static" / "js"  # the checkout's front end (editable installs)
ENTRY = "views/embed.js"

# A relative module specifier in an import or export … from, a side-effect import, or a dynamic import().
_SPECIFIER = re.compile(r"""(\bfrom\s*|\bimport\s*\(?\s*)(["'])(\.{1,2}/[^"'\n]+)\2""")

# The browser side of the bundle: the sources become blob: URLs, dependencies first (each module's
# "attnlab-module:<path>" specifiers replaced by its dependencies' URLs), then the entry is imported.
LOADER_JS = """
async function attnlabImport(sources, entry) {
  const urls = new Map();
  const urlOf = (path) => {
    if (!urls.has(path)) {
      if (!(path in sources)) throw new Error(`attnlab bundle: no module ${path}`);
      const code = sources[path].replace(/attnlab-module:([\\w./-]+)/g, (_, dep) => urlOf(dep));
      urls.set(path, URL.createObjectURL(new Blob([code], { type: "text/javascript" })));
    }
    return urls.get(path);
  };
  return import(urlOf(entry));
}
"""


def _resolve(importer: str, specifier: str) -> str:
    """`../mathx.js` imported by `views/embed.js` → `mathx.js` (paths relative to static/js)."""
    parts = importer.split("/")[:-1]
    for piece in specifier.split("/"):
        if piece == "..":
            if not parts:
                raise ValueError(f"{importer} imports {specifier}, outside static/js")
            parts.pop()
        elif piece not in (".", ""):
            parts.append(piece)
    return "/".join(parts)


def static_reader(lab_url: str | None = None) -> Callable[[str], str]:
    """Reads a static/js module: from the checkout when it is there, else from the lab server at lab_url."""
    def read(path: str) -> str:
        local = STATIC_JS / path
        if local.is_file():
            return local.read_text(encoding="utf-8")
        if not lab_url:
            raise FileNotFoundError(f"static/js/{path} is not in this install: pass the lab's URL to fetch it")
        return _fetch_text(f"{lab_url.rstrip('/')}/static/js/{path}")
    return read


def module_sources(entry: str = ENTRY, read: Callable[[str], str] | None = None) -> dict[str, str]:
    """The entry module and every module it imports (transitively), dependencies first, each with its relative
    imports renamed to `attnlab-module:<path>` for LOADER_JS."""
    read = read or static_reader()
    ordered: dict[str, str] = {}
    visiting: list[str] = []

    def visit(path: str) -> None:
        if path in ordered:
            return
        if path in visiting:
            raise ValueError(f"import cycle: {' → '.join(visiting + [path])}")
        visiting.append(path)
        source = read(path)
        deps: list[str] = []

        def rename(match: re.Match) -> str:
            dep = _resolve(path, match.group(3))
            deps.append(dep)
            return f"{match.group(1)}{match.group(2)}attnlab-module:{dep}{match.group(2)}"

        rewritten = _SPECIFIER.sub(rename, source)
        for dep in deps:
            visit(dep)
        visiting.pop()
        ordered[path] = rewritten

    visit(entry)
    return ordered


def plotly_js(lab_url: str | None = None) -> str:
    """plotly.js as the lab serves it (the cartesian bundle when fetched, attnlab/vendor.py), else the plotly package's
    full bundle, else the lab server's /static/vendor/plotly.min.js."""
    try:
        return plotly_bundle().read_text(encoding="utf-8")  # the server's own choice (attnlab/vendor.py)
    except ImportError:  # no plotly package here
        if not lab_url:
            raise
    return _fetch_text(f"{lab_url.rstrip('/')}/static/vendor/plotly.min.js")


def _fetch_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return answer.read().decode("utf-8")


def _script_json(value: Any) -> str:
    """JSON safe inside <script type="application/json">: no '<' (so no '</script>') outside escapes."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")


def standalone_html(response: dict, *, request: dict | None = None, title: str | None = None,
                    lab_url: str | None = None, layer: int | None = None, head: int | None = None) -> str:
    """One HTML document that shows `response` (POST /api/text/attention's answer) with the lab's views, offline.

    request: the body that produced it (its text and model title the page). For view-mode β and masks the response
    needs its scores (include_scores); layer and head menus list the slices it holds (response["layers"], ["heads"]).
    lab_url: where to read the front end from when this install has no checkout (static/js).
    layer, head: the head shown when the file opens (model numbering; default the response's first)."""
    sources = module_sources(ENTRY, static_reader(lab_url))
    plotly = plotly_js(lab_url).replace("</script", "<\\/script")
    model = response.get("model") or (request or {}).get("model") or "attnlab"
    text = (request or {}).get("text") or " ".join(response.get("tokens") or [])
    title = title or f"attnlab · {model} · {text[:60]}{'…' if len(text) > 60 else ''}"
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    beta_note = (" View-mode β re-normalises the saved scores (softmax(β·Ŝ) per row) in the browser, starting from"
                 " each head's β in the run." if response.get("scores") is not None
                 else " It holds no scores: the maps are the run's, at its β.") + run_note((request or {}).get("interventions"))
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="attnlab standalone export">
<title>{html.escape(title)}</title>
<style>body {{ margin: 16px; }} footer {{ color: #667085; font: 12px system-ui, sans-serif; margin-top: 12px; }}</style>
</head>
<body>
<div id="attnlab-view">loading the view…</div>
<noscript>This file draws its figures with JavaScript: open it in a browser with JavaScript on.</noscript>
<footer>Exported from attnlab on {stamp}: {html.escape(model)}, {len(response.get("tokens") or [])} tokens.
Everything is in this file; it needs no server and no network.{beta_note}</footer>
<script>{plotly}</script>
<script type="application/json" id="attnlab-data">{_script_json({"response": response, "request": request, "layer": layer, "head": head})}</script>
<script type="application/json" id="attnlab-modules">{_script_json(sources)}</script>
<script type="module">
{LOADER_JS}
const read = (id) => JSON.parse(document.getElementById(id).textContent);
const data = read("attnlab-data");
const root = document.getElementById("attnlab-view");
attnlabImport(read("attnlab-modules"), {json.dumps(ENTRY)})
  .then(({{ mountEmbed }}) => mountEmbed(root, {{ response: data.response, request: data.request, layer: data.layer, head: data.head }}))
  .catch((err) => {{ root.textContent = `the view could not start: ${{err.message}}`; root.dataset.state = "error"; }});
</script>
</body>
</html>
"""


# An op's words in the footer, and whether a scope follows them (positions acts on the input embeddings: none); an
# op not listed is named as it is, with its scope.
RUN_NOTES = {
    "temperature": (lambda item: f"temperature β = {item.get('beta')}", True),
    "mask_keys": (lambda item: f"keys {item.get('tokens')} masked", True),
    "positions": (lambda item: f"positions {item.get('mode', 'off')}"
                  + (f" (seed {item.get('seed', 0)})" if item.get("mode") == "shuffle" else ""), False),
}


def run_note(interventions: list | None) -> str:
    """The footer's line on what the run did: ' The run's interventions: temperature β = 0.5 on layers 10; …'."""
    if not interventions:
        return ""

    def scope(item: dict) -> str:
        where = [f"{name if len(item[name]) > 1 else name[:-1]} {', '.join(map(str, item[name]))}"
                 for name in ("layers", "heads") if item.get(name) is not None]
        kind = f"{item['kind']} attention" if item.get("kind") else ""
        return " on " + ", ".join(filter(None, [kind, *where])) if where or kind else " on every head"

    parts = []
    for item in interventions:
        item = dict(item)
        note, scoped = RUN_NOTES.get(item.get("op"), (None, True))
        parts.append((note(item) if note else str(item.get("op"))) + (scope(item) if scoped else ""))
    return f" The run's interventions (the maps are drawn as it made them): {'; '.join(parts)}."


def complete_response(result: Any) -> tuple[dict, dict | None]:
    """A result's response and request, with the scores view-mode β needs: when the response has none and the
    result knows its lab, the same text request is asked again with include_scores (the lab's cache answers)."""
    response = sent_form(dict(result.response))
    request = getattr(result, "request", None)
    request = dict(request) if request else None
    lab_url = _lab_url(result)
    if response.get("scores") is None and response.get("attention") is not None and request and "text" in request and lab_url:
        body = {**request, "include_scores": True, "encoding": "f32", "compare": False, "include_base": False}
        body.pop("thumbnail_size", None)
        response = _post_json(f"{lab_url}/api/text/attention", body)
        request = body
    return response, request


def sent_form(value: Any) -> Any:
    """An answer read in the binary form (attnlab.results.read_binary: numpy arrays) with its arrays in the JSON
    form's exact base64 float32 fields, which the views read; anything else as it is."""
    if hasattr(value, "dtype") and hasattr(value, "tobytes"):  # a numpy array
        data = value.astype("<f4", copy=False).tobytes()
        return {"dtype": "float32", "shape": list(value.shape), "data": base64.b64encode(data).decode("ascii")}
    if isinstance(value, dict):
        return {key: sent_form(item) for key, item in value.items()}
    if isinstance(value, list) and value and isinstance(value[0], (dict, list)):
        return [sent_form(item) for item in value]
    return value


def _lab_url(result: Any) -> str | None:
    lab = getattr(result, "lab", None)
    url = getattr(lab, "url", None) if lab is not None else None
    return str(url).rstrip("/") if url else None


def _post_json(url: str, body: dict) -> dict:
    data = json.dumps(body).encode()
    call = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(call, timeout=300) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as err:  # the server's detail, not a bare status
        try:
            detail = json.loads(err.read()).get("detail")
        except ValueError:
            detail = err.reason
        raise RuntimeError(f"{url} answered {err.code}: {detail}") from None


def to_html(result: Any, path: str | Path, *, title: str | None = None, layer: int | None = None,
            head: int | None = None) -> Path:
    """Write `result` (a client result: .response, .request, .lab) as one standalone HTML file; returns the path.
    title: the page's title (default: model and text); layer, head: the head shown when it opens."""
    response, request = complete_response(result)
    target = Path(path)
    target.write_text(standalone_html(response, request=request, title=title, lab_url=_lab_url(result),
                                       layer=layer, head=head), encoding="utf-8")
    return target
