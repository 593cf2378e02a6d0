// "Download standalone HTML": the shown input as one file that opens offline, from file://, with the view-mode
// controls (layer, head, view-mode β, key masks, colour scale) and no server. The server renders it
// (POST /api/text/export.html, attnlab/export.py): the same request as the page's, every layer and head with
// their scores; over the server's response cap, the shown layer's heads only.
import { readJSON, setStatus } from "../api.js";
import { downloadBlob } from "./export.js";

// panel: the export panel (#export-panel); body(): the page's last attention request, or null before the first;
// filename(): the file's name; shownLayer(): the layer kept when every layer is over the cap.
// shownHead(): the head the file opens on.
// url: the export route (the image and speech pages: /api/image/export.html, /api/audio/export.html); what: the
// button's title (what the file holds). A panel without .controls gets the button at its end.
export function mountHtmlExport(panel, { body, filename, shownLayer, shownHead, url = "/api/text/export.html",
  what = "this input's maps (every layer and head)" }) {
  const controls = panel?.querySelector(".controls") ?? panel;
  if (!controls) return null;
  const b = document.createElement("button");
  b.type = "button";
  b.id = "export-html";
  b.textContent = "Download standalone HTML";
  b.title = `one HTML file with ${what}, Plotly and the views: it opens offline`;
  b.addEventListener("click", async () => {
    const request = body();
    if (!request) { setStatus("nothing to export yet", { error: true }); return; }
    b.disabled = true;
    setStatus("exporting HTML…");
    try {
      const opens = `?layer=${shownLayer()}&head=${shownHead()}`;
      let res = await post(url, { ...request, layers: null, heads: null }, opens);
      if (res.status === 413) res = await post(url, { ...request, layers: [shownLayer()], heads: null }, opens);
      if (!res.ok) await readJSON(res); // throws the server's detail
      downloadBlob(await res.blob(), filename());
      setStatus(`exported ${filename()}: it opens offline in any browser`);
    } catch (err) {
      setStatus(`HTML export failed: ${err.message}`, { error: true });
    } finally {
      b.disabled = false;
    }
  });
  controls.insertBefore(b, controls.querySelector("#copy-link"));
  return b;
}

const post = (url, request, query) => fetch(`${url}${query}`, {
  method: "POST", headers: { "Content-Type": "application/json", Accept: "text/html" }, body: JSON.stringify(request),
});
