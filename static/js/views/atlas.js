// Long inputs (/guide#s10): a response over full_map_tokens carries an overview of the shown head (blocks of P's
// mean) instead of the map. Drawn first; a box drag or a scroll zoom asks the server for the exact window
// (POST /api/runs/{run_id}/window) and draws it with token labels once it is narrow enough to read; a click on a
// query row draws that row over the whole context for the head or for every head of the layer; the retrieval
// view shows, per layer × head, the attention mass that row puts on a span of keys (POST /api/runs/{id}/row).
// View-mode β applies to the window, the row and the retrieval view (the server re-normalises from q̂ k̂ᵀ at that β,
// no model run); the overview stays at the run's own β.
// Encoder–decoders (kind encoder | decoder | cross) carry an overview per kind: its rows are the kind's queries and its
// columns its keys (cross: target queries × source keys), and every window/row request names the kind.
// With interventions (a compare: the response names `base_run_id`, the run without them) the map can show P̂ − P
// instead of P̂ — a window by the server's `minus`, the overview as the difference of the two runs' overviews
// (`base_overview`) — on a diverging scale symmetric around 0 as the short page's diff. Beside every
// window a thin plot shows each row's entropy over ALL the keys (`row_entropy`; in a difference, both runs').

import { isAbort, postBinary, postJSON, setStatus } from "../api.js";
import { visibleToken } from "../dom.js";
import { decodeTensor, fmt, maxAbs } from "../mathx.js";
import { loadPlotly } from "../vendor.js";
import { MASKED_GREY } from "./heatmap.js";
import { bandShapes, rowBandNote, rowBandShapes } from "./layerkinds.js";

const LABEL_MAX = 80; // token labels on an axis once a window is at most this many tokens wide
const MAX_CELLS = 262_144; // the server's default max_window_cells: larger boxes show the overview instead

let current = null; // {el, r, kind, layer, head, queryTokens, keyTokens, beta, row, onWindow}

// The atlas panel (row plot, retrieval controls) under the heatmap, made once.
function panel(el) {
  let box = document.getElementById("atlas-panel");
  if (box) return box;
  box = document.createElement("div");
  box.id = "atlas-panel";
  box.innerHTML = `
    <p class="help" id="atlas-note"></p>
    <div id="atlas-error" class="field-error" role="alert" hidden></div>
    <div class="fig-tools atlas-tools"><label class="help" id="atlas-show-box" hidden>the map shows <select id="atlas-show" aria-label="the map shows">
        <option value="P">P̂ (with the interventions)</option><option value="diff">difference P̂ − P</option></select></label>
      <label class="help">row plot of <select id="atlas-row-scope" aria-label="row scope">
      <option value="head">this head</option><option value="layer">all heads of this layer</option></select></label></div>
    <p class="help" id="atlas-row-title">click a query row of the map to draw it over every key</p>
    <div id="atlas-row" class="plot" style="height:220px" hidden></div>
    <div class="fig-tools atlas-tools"><span class="help">retrieval: attention mass from query row</span>
      <input id="atlas-span-row" type="number" min="0" class="atlas-num" aria-label="query row">
      <span class="help">on keys</span><input id="atlas-span-from" type="number" min="0" value="0" class="atlas-num" aria-label="span start">
      <span class="help">to</span><input id="atlas-span-to" type="number" min="1" value="16" class="atlas-num" aria-label="span end">
      <button id="atlas-span-go" type="button">per layer × head</button>
      <span class="help">(click a cell to show that head)</span></div>
    <div id="atlas-retrieval" class="plot" style="height:320px" hidden></div>`;
  el.after(box);
  box.querySelector("#atlas-span-go").addEventListener("click", () => retrieval());
  box.querySelector("#atlas-row-scope").addEventListener("change", () => current?.row !== undefined && drawRow(current.row));
  box.querySelector("#atlas-show").addEventListener("change", () => {
    const w = current?.el.dataset.window ? JSON.parse(current.el.dataset.window) : null;
    if (w) drawWindow(w.rows, w.cols);
    else if (current) drawOverview();
  });
  return box;
}

// A long response for one layer and head (request layers [layer], heads [head]). beta: view-mode β or null (the
// run's own). onWindow({P, rows, cols}) hears each exact window drawn, and null when the overview is shown again.
// kind: an encoder–decoder's attention kind (null for one-kind models); queryTokens label and bound the rows,
// keyTokens the columns. The same run and kind drawn again (another head, β mode, the full load after a partial
// one) keeps the zoomed window; the same run with another kind is a new view.
// band: a local layer's window w (static/js/views/layerkinds.js: its edge is drawn on the maps and rows), else null;
// layerName: the layer as the titles name it ("layer 2 · local 512").
// causal: whether a key after its query is masked (default: a decoder LM's map, an encoder–decoder's decoder kind).
export async function drawAtlas(el, r, { layer, head, kind = null, queryTokens = r.tokens, keyTokens = r.tokens, beta = null,
  onWindow = null, onSelectHead = null, band = null, layerName = null, causal = null }) {
  const Plotly = await loadPlotly();
  // The same input (tokens) and kind keeps the place: another head, the full load after a partial one, and a new
  // run of the same tokens (a compare after an intervention) re-ask the same window, row and retrieval of it.
  const same = current?.kind === kind && (current?.r.run_id === r.run_id
    || (sameTokens(current.queryTokens, queryTokens) && sameTokens(current.keyTokens, keyTokens)));
  const kept = same && el.dataset.window ? JSON.parse(el.dataset.window) : null;
  const row = same ? current.row : undefined;
  const retrievalShown = same && current.r.run_id !== r.run_id && !document.getElementById("atlas-retrieval")?.hidden;
  current = { el, r, kind, layer, head, queryTokens, keyTokens, beta, row: undefined, onWindow, onSelectHead, band,
    layerName: layerName ?? `layer ${layer}`,
    causal: causal ?? (kind === "decoder" || (!kind && r.output?.kind === "next_token")) };
  const box = panel(el);
  box.hidden = false;
  const n = (x) => x.toLocaleString("en");
  const size = kind === "cross" ? `cross-attention: ${n(queryTokens.length)} target queries × ${n(keyTokens.length)} source keys`
    : kind ? `${kind} self-attention: ${n(keyTokens.length)} ${kind === "decoder" ? "target" : "source"} tokens`
    : `${n(keyTokens.length)} tokens`;
  box.querySelector("#atlas-note").textContent = `${size}, over full_map_tokens = `
    + `${r.full_map_tokens}: the map shows blocks of P's mean (the overview). Drag a box or scroll to zoom: exact `
    + `windows load from the server; double-click returns to the overview.`;
  // P̂ − P is offered where the response names the run without the interventions
  box.querySelector("#atlas-show-box").hidden = !r.base_run_id;
  const spanRow = box.querySelector("#atlas-span-row");
  if (!spanRow.value || !same) spanRow.value = String(queryTokens.length - 1); // a new input: its last query asks
  if (!same) { // another input's row and retrieval plots are hidden until asked again
    for (const id of ["atlas-row", "atlas-retrieval"]) document.getElementById(id).hidden = true;
    box.querySelector("#atlas-row-title").textContent = "click a query row of the map to draw it over every key";
  }
  el.removeAllListeners?.("plotly_relayout");
  el.removeAllListeners?.("plotly_click");
  drawOverview(Plotly);
  watchBoxDrags(el);
  el.on("plotly_relayout", (ev) => { if (!justBoxed()) onZoom(ev); });
  el.on("plotly_click", (ev) => { const p = ev.points?.[0]; if (p && !justBoxed()) drawRow(Math.floor(p.y)); });
  if (kept) await drawWindow(kept.rows, kept.cols);
  if (row !== undefined && current) await drawRow(row);
  if (retrievalShown && current) await retrieval(); // the same span of the new run
}

const sameTokens = (a, b) => a === b || (a?.length === b?.length && a.every((t, i) => t === b[i]));

export const atlasShown = () => current !== null;

// The colour scale of the overview and the windows, as the page's menu (#zscale) names it: "log" (colours spaced
// by log₁₀ P from 10⁻⁴ to the largest value: a causal map's P[0, 0] = 1 leaves a linear scale almost black), "row"
// (each row over its own max), else linear from 0 to the largest value. z stays P itself on the log scale (the colour
// stops are placed at log-spaced values of P); the hover reads P either way (text).
let scaleName = "max";
export const ATLAS_SCALES = ["max", "log", "row"];
export function setAtlasScale(name, { redraw = true } = {}) {
  scaleName = ATLAS_SCALES.includes(name) ? name : "max";
  if (!redraw || !current) return;
  const w = current.el.dataset.window ? JSON.parse(current.el.dataset.window) : null;
  if (w) drawWindow(w.rows, w.cols);
  else drawOverview();
}
const LOG_FLOOR = -4;
const VIRIDIS = ["#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#b5de2b", "#fde725"];
function coloured(P) {
  const text = P.map((row) => row.map((p) => Number(p).toPrecision(3)));
  const top = Math.max(1e-12, maxAbs(P, 0));
  if (scaleName === "log") {
    const hi = Math.log10(top), lo = Math.min(LOG_FLOOR, hi - 1);
    // colour k of the ramp at P = 10^(lo + k (hi − lo) / 9): on z = P, Plotly's linear scale becomes a log one
    const colorscale = [[0, VIRIDIS[0]], ...VIRIDIS.map((c, k) => [10 ** (lo + (k * (hi - lo)) / (VIRIDIS.length - 1)) / top, c])];
    colorscale[colorscale.length - 1][0] = 1;
    const ticks = [-4, -3, -2, -1, 0].filter((t) => 10 ** t >= 0.02 * top && t <= hi + 1e-9); // readable on the bar
    return { z: P, zmin: 0, zmax: top, text, colorscale,
      colorbar: { title: { text: "P (log colours)" }, tickvals: ticks.map((t) => 10 ** t), ticktext: ticks.map((t) => ["10⁻⁴", "0.001", "0.01", "0.1", "1"][t + 4]) } };
  }
  if (scaleName === "row") {
    const z = P.map((row) => { const m = maxAbs(row, 0); return m > 0 ? row.map((p) => p / m) : row.slice(); });
    return { z, zmin: 0, zmax: 1, text, colorbar: { title: { text: "P / row max" } } };
  }
  return { z: P, zmin: 0, zmax: top, text };
}

// Cells a mask forbids (P = 0 by construction, not by attention) are grey, as on short maps (heatmap.js): the causal
// triangle (key j > query i) and, on a local layer of width w, the keys beyond the window's edge (j ≤ i − w).
// An overview block is grey when every cell in it is forbidden (a block across the diagonal or the edge is a mean).
// rows, cols: the cells' [start, end) token ranges along each axis. Returns the grey trace, or null when none is.
function forbiddenTrace(x, y, rows, cols) {
  const { causal, band } = current;
  if (!causal && !band) return null;
  const grey = rows.map(([r0, r1]) => cols.map(([c0, c1]) => ((causal && c0 >= r1) || (band && c1 <= r0 - band + 1) ? 1 : null)));
  if (!grey.some((row) => row.includes(1))) return null;
  const why = [causal ? "causal: key j > query i" : "", band ? `beyond the local window: key j ≤ i − ${band}` : ""].filter(Boolean).join("; ");
  return {
    type: "heatmap", x, y, z: grey, colorscale: [[0, MASKED_GREY], [1, MASKED_GREY]], zmin: 0, zmax: 1, showscale: false,
    hoverongaps: false, name: "forbidden", hovertemplate: `forbidden (${why}): P = 0<extra></extra>`,
  };
}
const spans = (edges) => edges.slice(0, -1).map((e, i) => [e, edges[i + 1]]);
const cellsOf = (indices) => indices.map((i) => [i, i + 1]);
// The heading's legend of the grey cells (as drawHeatmap's).
const greyLegend = (trace) => (trace ? [{ text: `<span style="color:${MASKED_GREY}">■</span> forbidden, P = 0`, xref: "paper", yref: "paper",
  x: 0, y: 1, yanchor: "bottom", xanchor: "left", showarrow: false, font: { size: 11, color: "#555" } }] : []);

// The page's map mode, as the response carried it: value-weighted windows, rows and retrieval follow the overview.
const weighting = (r) => r.weighting ?? "attention";
const weightingNote = (r) => (weighting(r) === "value_norm" ? " · value-weighted ‖P·v W_O‖" : "");
// Windows show the difference P̂ − P: chosen, and the run without the interventions is kept.
const showsDiff = (r) => Boolean(r.base_run_id) && document.getElementById("atlas-show")?.value === "diff";

export function hideAtlas() {
  const box = document.getElementById("atlas-panel");
  if (box) box.hidden = true;
  if (current) { delete current.el.dataset.atlas; delete current.el.dataset.window; }
  current = null;
}

// A window or row request that failed: an aborted one was replaced by a newer one. A run the server does not hold
// (404) is said as the server says it (unknown, expired, or its replica gone): the page does not guess which.
function failed(err, what) {
  if (isAbort(err)) return;
  const gone = err.status === 404 ? " (press Run again for a new run)" : "";
  // beside the map's controls (the header's status line only points here)
  const box = document.getElementById("atlas-error");
  if (box) { box.textContent = `${what}: ${err.message}${gone}`; box.hidden = false; box.dataset.what = what; }
  setStatus(`${what} failed: see the message under the map`, { error: true });
}
const cleared = () => { const box = document.getElementById("atlas-error"); if (box) box.hidden = true; };

function drawOverview(Plotly = window.Plotly) {
  const { el, r, kind, layer, head, onWindow } = current;
  zoomSeq += 1; // a window still on its way no longer replaces the overview
  const overview = kind ? r.overview[kind] : r.overview;
  const shown = decodeTensor(overview.maps)[0][0]; // (B_q, B_k)
  // the overview of P̂ − P: a block's mean is linear in P, so it is the difference of the two runs' overviews
  const base = showsDiff(r) && !kind && r.base_overview ? decodeTensor(r.base_overview)[0][0] : null; // (B_q, B_k)
  const diff = base !== null;
  const maps = diff ? shown.map((row, i) => row.map((v, j) => v - base[i][j])) : shown;
  const rows = overview.edges, cols = overview.col_edges ?? rows;
  const mid = (e) => e.slice(0, -1).map((v, i) => (v + e[i + 1]) / 2);
  const span = diff ? Math.max(1e-12, maxAbs(maps, 0)) : null;
  const shownZ = diff ? null : coloured(maps);
  const trace = {
    type: "heatmap", x: mid(cols), y: mid(rows),
    ...(diff ? { z: maps, colorscale: "RdBu", reversescale: true, zmid: 0, zmin: -span, zmax: span } : { colorscale: "Viridis", ...shownZ }),
    hovertemplate: `queries ≈ %{y:.0f} · keys ≈ %{x:.0f}<br>mean ${diff ? "P̂ − P %{z:.3g}" : "P %{text}"}<extra></extra>`,
  };
  const what = diff ? " · P̂ − P" : showsDiff(r) ? " · of P̂ (zoom for P̂ − P)" : "";
  const grey = forbiddenTrace(trace.x, trace.y, spans(rows), spans(cols));
  el.dataset.forbidden = String(grey ? grey.z.flat().filter(Boolean).length : 0);
  Plotly.react(el, grey ? [trace, grey] : [trace], {
    title: { text: `overview · ${kind ? `${kind} · ` : ""}${current.layerName}, head ${head}${current.beta ? " · at the run's β (zoom for view β)" : ""}${what}${weightingNote(r)}`, font: { size: 13 } },
    margin: { l: 60, r: 10, t: 30, b: 40 },
    xaxis: { title: { text: axisTitle("key") }, range: [0, cols.at(-1)] }, yaxis: { title: { text: axisTitle("query") }, autorange: "reversed" },
    dragmode: "zoom", shapes: bandShapes(current.band, { x0: 0, x1: cols.at(-1), y0: 0, y1: rows.at(-1) }),
    annotations: greyLegend(grey),
  }, { scrollZoom: true, responsive: true });
  el.dataset.atlas = "overview";
  el.dataset.band = current.band ?? "";
  el.dataset.scale = diff ? "diff" : scaleName;
  el.dataset.show = diff ? "diff" : "P";
  el.dataset.run = r.run_id; // which run and kind the map shows (a kind switch draws the same run)
  el.dataset.kind = kind ?? "";
  delete el.dataset.window;
  onWindow?.(null);
}

// Axis titles: an encoder–decoder's cross-attention has target queries and source keys.
function axisTitle(side) {
  const kind = current?.kind;
  if (!kind) return `${side} token`;
  const seq = kind === "encoder" || (kind === "cross" && side === "key") ? "source" : "target";
  return `${side} (${seq} token)`;
}

// A box drag under 8 px is a click to Plotly (its MINDRAG), and one under 20 px (MINZOOM) in a direction zooms the
// other axis alone: on an overview of thousands of tokens a 40 × 40 window is a few pixels, and took two zooms.
// A drag of at least BOX_PX both ways that Plotly would not zoom as a box is taken here as the box drawn: its window
// loads, its click is no row click and Plotly's own one-axis zoom of it is not a window request.
const BOX_PX = 3, PLOTLY_BOX_PX = 20;
const watched = new WeakSet();
let boxedAt = -Infinity;
const justBoxed = () => performance.now() - boxedAt < 400;
function watchBoxDrags(el) {
  if (watched.has(el)) return;
  watched.add(el);
  let start = null;
  el.addEventListener("mousedown", (e) => {
    start = e.button === 0 && e.target.closest?.(".nsewdrag[data-subplot='xy']") ? { x: e.clientX, y: e.clientY } : null;
  }, true);
  window.addEventListener("mouseup", (e) => { // capture: before Plotly's own mouseup on the document
    const from = start;
    start = null;
    if (!from || current?.el !== el || el.layout?.dragmode !== "zoom") return;
    const dx = Math.abs(e.clientX - from.x), dy = Math.abs(e.clientY - from.y);
    if (dx < BOX_PX || dy < BOX_PX || (dx >= PLOTLY_BOX_PX && dy >= PLOTLY_BOX_PX)) return; // a click; Plotly's box
    const box = dataBox(el, from, { x: e.clientX, y: e.clientY });
    if (!box) return;
    boxedAt = performance.now();
    setTimeout(() => { if (current?.el === el) zoomTo(box); }, 0);
  }, true);
}

// Two points on the page (client pixels) as the map's data ranges {x0, x1, y0, y1}, or null before a figure is drawn.
function dataBox(el, a, b) {
  const xa = el._fullLayout?.xaxis, ya = el._fullLayout?.yaxis;
  if (!xa?.p2d || !ya?.p2d) return null;
  const rect = el.getBoundingClientRect();
  const x = (p) => xa.p2d(p.x - rect.left - xa._offset), y = (p) => ya.p2d(p.y - rect.top - ya._offset);
  return { x0: x(a), x1: x(b), y0: y(a), y1: y(b) };
}

let zoomSeq = 0;
async function onZoom(ev) {
  if (!current) return;
  if (ev["xaxis.autorange"] || ev["yaxis.autorange"]) { drawOverview(); return; }
  const x0 = ev["xaxis.range[0]"], x1 = ev["xaxis.range[1]"], y0 = ev["yaxis.range[0]"], y1 = ev["yaxis.range[1]"];
  if (x0 === undefined || y0 === undefined) return;
  await zoomTo({ x0, x1, y0, y1 });
}

// The exact window of the data ranges asked (a box drag, a scroll zoom), when it is small enough to load.
async function zoomTo({ x0, x1, y0, y1 }) {
  const clamp = (v, n) => Math.max(0, Math.min(n, Math.round(v)));
  const nk = current.keyTokens.length, nq = current.queryTokens.length;
  const cols = [clamp(Math.min(x0, x1), nk), clamp(Math.max(x0, x1), nk)];
  const rows = [clamp(Math.min(y0, y1), nq), clamp(Math.max(y0, y1), nq)];
  if (cols[1] - cols[0] < 1 || rows[1] - rows[0] < 1) return;
  if ((cols[1] - cols[0]) * (rows[1] - rows[0]) > MAX_CELLS) return; // still overview-sized: Plotly's own zoom
  await drawWindow(rows, cols);
}

export async function drawWindow(rows, cols) {
  const seq = ++zoomSeq;
  const { el, r, kind, layer, head, queryTokens, keyTokens, beta } = current;
  setStatus(`window ${rows[0]}–${rows[1]} × ${cols[0]}–${cols[1]}…`);
  const diff = showsDiff(r);
  const ask = { layer, head, kind, rows, cols, beta, weighting: weighting(r), encoding: "f32" };
  let w, plain;
  try { // a difference: P̂ − P for the map, and P̂ itself for the head view (each window is one small request)
    [w, plain] = await Promise.all([
      postBinary(`/api/runs/${r.run_id}/window`, diff ? { ...ask, minus: r.base_run_id } : ask, { channel: "atlas-window" }),
      diff ? postBinary(`/api/runs/${r.run_id}/window`, ask, { channel: "atlas-window-plain" }) : null]);
  } catch (err) { failed(err, "window"); return; }
  if (seq !== zoomSeq || current?.r !== r || current.kind !== kind) return;
  const z = decodeTensor(w.attention);
  const xs = Array.from({ length: cols[1] - cols[0] }, (_, i) => cols[0] + i);
  const ys = Array.from({ length: rows[1] - rows[0] }, (_, i) => rows[0] + i);
  const label = (tokens) => (i) => `${i}:${visibleToken(tokens[i])}`;
  const queryLabel = label(queryTokens), keyLabel = label(keyTokens);
  const narrow = xs.length <= LABEL_MAX && ys.length <= LABEL_MAX;
  const what = weighting(r) === "value_norm" ? "value-weighted" : "P";
  const span = diff ? Math.max(1e-12, maxAbs(z, 0)) : null; // a diverging scale symmetric around 0, as the short diff's
  const shownZ = diff ? null : coloured(z);
  const scale = diff ? { z, colorscale: "RdBu", reversescale: true, zmid: 0, zmin: -span, zmax: span }
    : { colorscale: "Viridis", ...shownZ };
  const trace = {
    type: "heatmap", x: xs, y: ys, ...scale,
    colorbar: { x: 0.77, xanchor: "left", thickness: 10, tickfont: { size: 9 }, ...(shownZ?.colorbar ?? {}) },
    customdata: ys.map((i) => xs.map((j) => [queryLabel(i), keyLabel(j)])),
    hovertemplate: `query %{customdata[0]}<br>key %{customdata[1]}<br>${diff ? `${what} P̂ − P %{z:.4g}` : `${what} %{text}`}<extra></extra>`,
  };
  // beside the window: each row's entropy over all the keys, on the window's rows (the short page's entropy panel)
  const strip = (values, name, color) => ({
    type: "scatter", mode: "lines+markers", x: values, y: ys, xaxis: "x2", yaxis: "y", name,
    line: { color, width: 1.5 }, marker: { size: 3, color },
    hovertemplate: `query %{y}<br>${name} %{x:.3f} nats<extra></extra>`,
  });
  const entropy = [strip(w.row_entropy, diff ? "entropy P̂" : "row entropy", "#3b5bdb")];
  if (diff) entropy.push(strip(w.minus_row_entropy, "entropy P", "#999"));
  const axis = (idx, text, name) => narrow // Plotly 3 reads an axis title from {text} only
    ? { title: { text }, tickmode: "array", tickvals: idx, ticktext: idx.map(name), tickfont: { size: 9 } }
    : { title: { text } };
  const maxDiff = diff ? ` (max |Δ| = ${fmt(span, 3)})` : "";
  const grey = forbiddenTrace(xs, ys, cellsOf(ys), cellsOf(xs)); // after the entropy strip: data[1] stays the strip
  el.dataset.forbidden = String(grey ? grey.z.flat().filter(Boolean).length : 0);
  await window.Plotly.react(el, [trace, ...entropy, ...(grey ? [grey] : [])], {
    title: { text: `${diff ? "P̂ − P · " : ""}window · ${kind ? `${kind} · ` : ""}${current.layerName}, head ${head}${beta ? ` · view β = ${fmt(beta)}` : ""}${weightingNote(r)}${maxDiff}`, font: { size: 13 } },
    margin: { l: narrow ? 110 : 60, r: 10, t: 30, b: narrow ? 110 : 40 },
    xaxis: { ...axis(xs, axisTitle("key"), keyLabel), domain: [0, 0.76] }, yaxis: { ...axis(ys, axisTitle("query"), queryLabel), autorange: "reversed" },
    xaxis2: { domain: [0.88, 1], title: { text: "row entropy (nats)", font: { size: 10 } }, rangemode: "tozero", tickfont: { size: 9 } },
    showlegend: false, dragmode: "zoom",
    shapes: bandShapes(current.band, { x0: cols[0], x1: cols[1], y0: rows[0], y1: rows[1], cells: true }),
    annotations: greyLegend(grey),
  }, { scrollZoom: true, responsive: true });
  el.dataset.atlas = narrow ? "window-labels" : "window";
  el.dataset.scale = diff ? "diff" : scaleName;
  el.dataset.show = diff ? "diff" : "P"; // what the window shows: P̂, or P̂ − P
  el.dataset.maxAbs = diff ? String(span) : "";
  el.dataset.window = JSON.stringify({ rows, cols });
  el.dataset.beta = beta === null ? "" : String(beta);
  setStatus(`window ${rows[0]}–${rows[1]} × ${cols[0]}–${cols[1]} (exact${diff ? ", P̂ − P" : ""}${beta ? `, view β = ${fmt(beta)}` : ""})`);
  // the head view draws P̂ of the window (a difference has signs: not line weights); row entropy for the page's panel
  const shown = diff ? decodeTensor(plain.attention) : z;
  if (current?.r === r && current.kind === kind) current.onWindow?.({ P: shown, rows, cols, rowEntropy: diff ? plain.row_entropy : w.row_entropy });
}

// View-mode β on a long input (null: the run's own): the shown window and row re-normalised by the server at
// that β (no model run). Over the overview only its title changes.
export async function setAtlasBeta(beta) {
  if (!current || current.beta === beta) return;
  current.beta = beta;
  const w = current.el.dataset.window ? JSON.parse(current.el.dataset.window) : null;
  if (w) await drawWindow(w.rows, w.cols);
  else drawOverview();
  if (current?.row !== undefined) await drawRow(current.row);
}

async function drawRow(i) {
  if (!current) return;
  current.row = i;
  const { r, kind, layer, head, queryTokens, keyTokens: tokens, beta } = current;
  if (!(i >= 0 && i < queryTokens.length)) return; // a click below the last query row
  const scope = document.getElementById("atlas-row-scope").value;
  const body = { row: i, layers: [layer], heads: scope === "layer" ? null : [head], kind, beta, weighting: weighting(r), encoding: "f32" };
  let out;
  try {
    out = await postBinary(`/api/runs/${r.run_id}/row`, body, { channel: "atlas-row" });
  } catch (err) { failed(err, "row"); return; }
  if (current?.r !== r || current.kind !== kind) return;
  cleared();
  const rows = decodeTensor(out.attention)[0]; // (h, T_k)
  const x = tokens.map((_, j) => j);
  const text = tokens.map((t, j) => `${j}:${visibleToken(t)}`);
  const traces = rows.map((p, k) => ({
    type: "scattergl", mode: "lines", x, y: p, text, name: `head ${out.heads[k]}`,
    hovertemplate: "key %{text}<br>P %{y:.4g}<extra>%{fullData.name}</extra>",
  }));
  document.getElementById("atlas-row-title").textContent = `query ${i}:${visibleToken(queryTokens[i])} over all ${tokens.length} keys`
    + (beta ? ` · view β = ${fmt(beta)}` : "") + rowBandNote(current.band, i);
  document.getElementById("atlas-span-row").value = String(i);
  Object.assign(document.getElementById("atlas-row").dataset, { run: r.run_id, row: String(i) });
  document.getElementById("atlas-row").hidden = false;
  await window.Plotly.react("atlas-row", traces, {
    margin: { l: 50, r: 10, t: 10, b: 40 }, xaxis: { title: { text: axisTitle("key") } }, yaxis: { title: { text: "P" } }, showlegend: rows.length > 1,
    shapes: rowBandShapes(current.band, i),
  }, { responsive: true });
}

async function retrieval() {
  if (!current) return;
  const { r, kind, queryTokens, keyTokens, beta } = current;
  const nq = queryTokens.length, n = keyTokens.length;
  const get = (id) => Number(document.getElementById(id).value);
  const row = Math.min(nq - 1, Math.max(0, get("atlas-span-row")));
  const from = Math.min(n - 1, Math.max(0, get("atlas-span-from")));
  const to = Math.min(n, Math.max(from + 1, get("atlas-span-to")));
  let out;
  try {
    out = await postJSON(`/api/runs/${r.run_id}/row`, { row, span: [from, to], include_row: false, kind, beta, weighting: weighting(r) },
      { channel: "atlas-retrieval" });
  } catch (err) { failed(err, "retrieval"); return; }
  if (current?.r !== r) return; // another run is shown now
  cleared();
  const mass = out.span_mass; // (L, H)
  const best = mass.flatMap((hs, l) => hs.map((m, h) => [m, l, h])).sort((a, b) => b[0] - a[0])[0];
  const el = document.getElementById("atlas-retrieval");
  el.hidden = false;
  await window.Plotly.react(el, [{
    type: "heatmap", z: mass, colorscale: "Viridis", zmin: 0,
    hovertemplate: "layer %{y}, head %{x}<br>mass on keys " + `${from}–${to - 1}: ` + "%{z:.3g}<extra></extra>",
  }], {
    title: { text: `attention from query ${row} on keys ${from}–${to - 1} · strongest: layer ${best[1]}, head ${best[2]} (${fmt(best[0])})`, font: { size: 12 } },
    margin: { l: 50, r: 10, t: 30, b: 40 }, xaxis: { title: { text: "head" }, dtick: 1 }, yaxis: { title: { text: "layer" }, dtick: 1 },
    // the strongest head outlined; a click on any cell shows that head's map
    shapes: [{ type: "rect", x0: best[2] - 0.5, x1: best[2] + 0.5, y0: best[1] - 0.5, y1: best[1] + 0.5,
      line: { color: "#e8590c", width: 2 } }],
  }, { responsive: true });
  el.dataset.best = JSON.stringify({ layer: best[1], head: best[2], mass: best[0] });
  el.dataset.run = r.run_id;
  el.dataset.span = JSON.stringify({ row, from, to });
  el.removeAllListeners?.("plotly_click");
  el.on("plotly_click", (ev) => { const p = ev.points?.[0]; if (p) current?.onSelectHead?.(Number(p.y), Number(p.x)); });
}
