// Attention heatmap of one head: rows are queries, columns are keys (§1).
//
// Plotly draws the figure: axes, hover, colour bar, zoom, PNG export. A Plotly redraw costs 15–40 ms
// even for a small map (measured in Chromium on the CI machine), too slow to follow a slider, so
// `paintHeatmap` repaints only the cells: a canvas laid exactly over Plotly's plot area, filled from a
// 256-colour table of the trace's own colour scale (about a millisecond at 128²). The caller brings
// Plotly up to date with `drawHeatmap` once the input settles, which removes the canvas.

import { viridis } from "../colors.js";
import { visibleToken } from "../dom.js";

// Plotly merges duplicate category labels, so each token label gets its index.
export const tokenLabels = (tokens) => tokens.map((t, i) => `${i}:${visibleToken(t)}`);

const drawnTokens = new WeakMap(); // plot element → the tokens its axes show ({x, y})

// Cells a mask forbids (P = 0 by construction, not by attention) are drawn in this neutral grey, over the map.
export const MASKED_GREY = "#c3c7cf";

// tokens: the keys (x); yTokens: the queries (y), the same tokens unless the map is rectangular
// (cross-attention: target queries × source keys).
// matrix: the values coloured (P, or P on another scale: then `customdata` holds P for the hover and
// `colorbar` its ticks); masked: bool rows (true = the mask forbids this cell) or null; maskLegend: what
// forbids them ("the causal mask: key j > query i").
export function drawHeatmap(el, matrix, tokens, {
  title = "", zmin = null, zmax = null, colorscale = "Viridis", zmid = null, yTokens = tokens,
  customdata = null, colorbar = {}, masked = null, maskLegend = "masked",
} = {}) {
  const labels = tokenLabels(tokens), yLabels = tokenLabels(yTokens);
  const trace = {
    type: "heatmap", z: matrix, x: labels, y: yLabels, colorscale,
    zmin: zmin ?? (zmid === null ? 0 : -zmax), zmax: zmax ?? undefined, zmid: zmid ?? undefined,
    hovertemplate: `query %{y}<br>key %{x}<br>P = %{${customdata ? "customdata" : "z"}:.4f}<extra></extra>`,
    colorbar: { thickness: 12, ...colorbar }, hoverongaps: false,
    ...(customdata ? { customdata } : {}),
  };
  const traces = [trace];
  const anyMasked = masked?.some((row) => row.some(Boolean));
  if (anyMasked) { // one grey layer over the forbidden cells; every other cell is a gap in it
    traces.push({
      type: "heatmap", z: masked.map((row) => row.map((m) => (m ? 1 : null))), x: labels, y: yLabels,
      colorscale: [[0, MASKED_GREY], [1, MASKED_GREY]], zmin: 0, zmax: 1, showscale: false, hoverongaps: false,
      name: "masked", hovertemplate: `query %{y}<br>key %{x}<br>masked (${maskLegend}): P = 0<extra></extra>`,
    });
  }
  const dense = Math.max(tokens.length, yTokens.length) > 40;
  const legend = anyMasked ? `<span style="color:${MASKED_GREY}">■</span> ${maskLegend}` : "";
  const layout = {
    title: { text: title, font: { size: 13 } },
    margin: { l: dense ? 40 : 90, r: 10, t: title || legend ? 30 : 10, b: dense ? 40 : 90 },
    xaxis: { title: { text: "key" }, tickangle: -60, showticklabels: !dense, type: "category" },
    yaxis: { title: { text: "query" }, autorange: "reversed", showticklabels: !dense, type: "category" },
    annotations: legend ? [{ text: legend, xref: "paper", yref: "paper", x: 0, y: 1, yanchor: "bottom", xanchor: "left",
      showarrow: false, font: { size: 11, color: "#555" } }] : [],
  };
  el.dataset.masked = anyMasked ? String(masked.reduce((n, row) => n + row.filter(Boolean).length, 0)) : "0";
  const drawn = Plotly.react(el, traces, layout, { responsive: true, displaylogo: false });
  drawnTokens.set(el, { x: tokens, y: yTokens });
  const cells = el.querySelector(":scope > canvas.fast-cells");
  if (cells) cells.hidden = true; // Plotly shows the same values now
  el.querySelector(":scope > .preview-note")?.remove();
  return drawn;
}

// Repaint the cells of an already drawn heatmap with new values for the same tokens. Returns false
// (and paints nothing) when that is not possible: nothing drawn yet, other tokens, or a zoomed view;
// the caller then draws with Plotly.
export function paintHeatmap(el, matrix, tokens, yTokens = tokens, masked = null) {
  const layout = el._fullLayout;
  const trace = el._fullData?.[0];
  const shown = drawnTokens.get(el);
  if (!layout || !trace || trace.type !== "heatmap" || !shown || !sameTokens(shown.x, tokens) || !sameTokens(shown.y, yTokens)) return false;
  const n = matrix.length, m = matrix[0]?.length ?? 0;
  const [x0, x1] = layout.xaxis.range, [y0, y1] = layout.yaxis.range;
  const whole = (a, b) => Math.abs(a - b) < 1e-6;
  if (!(whole(x0, -0.5) && whole(x1, m - 0.5) && whole(y0, n - 0.5) && whole(y1, -0.5))) return false; // zoomed
  const { l, t, w, h } = layout._size; // the plot area, in CSS pixels from the element's corner
  paintCells(cellsCanvas(el), matrix, { left: l, top: t, width: w, height: h }, colourTable(trace.colorscale), trace.zmin, trace.zmax, masked);
  return true;
}

// Before plotly.js is ready (it takes 1–2 s to evaluate on a slow machine, see benchmarks/): the cells
// alone, on a canvas about where the figure's plot area will be, with a note; drawHeatmap replaces them.
export function paintPreview(el, matrix, note = "", { zmin = 0, zmax = 1, masked = null } = {}) {
  const dense = Math.max(matrix.length, matrix[0]?.length ?? 0) > 40;
  const { width, height } = el.getBoundingClientRect();
  const box = { left: dense ? 40 : 90, top: 10, width: 0, height: 0 };
  box.width = Math.max(40, width - box.left - 70); // 70: Plotly's colour bar and right margin
  box.height = Math.max(40, height - box.top - (dense ? 40 : 90));
  paintCells(cellsCanvas(el), matrix, box, previewTable(), zmin, zmax, masked);
  let label = el.querySelector(":scope > .preview-note");
  if (!label) {
    label = document.createElement("p");
    label.className = "preview-note help";
    el.append(label);
  }
  label.textContent = note;
}

function cellsCanvas(el) {
  let canvas = el.querySelector(":scope > canvas.fast-cells");
  if (!canvas) {
    canvas = document.createElement("canvas");
    canvas.className = "fast-cells";
    canvas.setAttribute("aria-hidden", "true");
    if (getComputedStyle(el).position === "static") el.style.position = "relative";
    el.append(canvas);
  }
  return canvas;
}

const GREY_RGB = [0xc3, 0xc7, 0xcf]; // MASKED_GREY

// One pixel per cell (rows = queries, top to bottom), stretched over `box` without smoothing; masked cells grey.
function paintCells(canvas, matrix, box, table, zmin, zmax, masked = null) {
  const n = matrix.length, m = matrix[0]?.length ?? 0;
  Object.assign(canvas.style, { left: `${box.left}px`, top: `${box.top}px`, width: `${box.width}px`, height: `${box.height}px` });
  if (canvas.width !== m || canvas.height !== n) { canvas.width = m; canvas.height = n; }
  const ctx = canvas.getContext("2d");
  const image = ctx.createImageData(m, n);
  const px = image.data;
  const span = zmax - zmin || 1;
  for (let i = 0, o = 0; i < n; i++) {
    const row = matrix[i], forbidden = masked?.[i];
    for (let j = 0; j < m; j++, o += 4) {
      if (forbidden?.[j]) { px[o] = GREY_RGB[0]; px[o + 1] = GREY_RGB[1]; px[o + 2] = GREY_RGB[2]; px[o + 3] = 255; continue; }
      const level = Math.max(0, Math.min(255, Math.round(((row[j] - zmin) / span) * 255))) * 3;
      px[o] = table[level]; px[o + 1] = table[level + 1]; px[o + 2] = table[level + 2]; px[o + 3] = 255;
    }
  }
  ctx.putImageData(image, 0, 0);
  canvas.hidden = false;
}

let preview = null;
function previewTable() {
  if (!preview) {
    preview = new Uint8ClampedArray(256 * 3);
    for (let k = 0; k < 256; k++) preview.set(viridis(k / 255), k * 3);
  }
  return preview;
}

function sameTokens(a, b) {
  return a === b || (a.length === b.length && a.every((t, i) => t === b[i]));
}

// 256 RGB triples sampled from a resolved Plotly colour scale ([[t, "rgb(…)" | "#rrggbb"], …]),
// interpolated linearly in RGB between its stops as Plotly does.
const tables = new Map();
function colourTable(scale) {
  const key = JSON.stringify(scale);
  let table = tables.get(key);
  if (table) return table;
  const stops = scale.map(([t, colour]) => [Number(t), parseColour(colour)]);
  table = new Uint8ClampedArray(256 * 3);
  for (let k = 0; k < 256; k++) {
    const x = k / 255;
    let s = 0;
    while (s < stops.length - 2 && x > stops[s + 1][0]) s++;
    const [ta, ca] = stops[s], [tb, cb] = stops[Math.min(s + 1, stops.length - 1)];
    const f = tb > ta ? Math.min(1, Math.max(0, (x - ta) / (tb - ta))) : 0;
    for (let c = 0; c < 3; c++) table[k * 3 + c] = Math.round(ca[c] + f * (cb[c] - ca[c]));
  }
  tables.set(key, table);
  return table;
}

function parseColour(colour) {
  const text = String(colour).trim();
  if (text.startsWith("#")) {
    const hex = text.length === 4 ? [...text.slice(1)].map((c) => c + c).join("") : text.slice(1, 7);
    return [0, 2, 4].map((i) => parseInt(hex.slice(i, i + 2), 16));
  }
  const parts = text.match(/[\d.]+/g) || ["0", "0", "0"];
  return parts.slice(0, 3).map(Number);
}
