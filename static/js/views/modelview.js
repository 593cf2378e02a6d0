// Grid of every layer × head as canvas thumbnails (cheap to draw for 72+ heads); click selects.
import { viridis } from "../colors.js";
import { keepFocus, keyActivate, markRefocus } from "../dom.js";
import { LABEL_MARKS } from "./headkinds.js";

// colour (optional, static/js/views/headkinds.js): { name, values [L][H], labels [L][H]|null, unit }: each cell is
// then a tile coloured by the head's score (shares on 0–1, distances on 0–max) with the head's label written on it.
// rowLabel (optional): layer → {text, title} of its row's label (static/js/views/layerkinds.js: local / global).
export function drawModelView(container, thumbs, { layer, head, onSelect, entropy = null, colour = null, rowLabel = null }) {
  const nLayers = thumbs.length, nHeads = thumbs[0].length;
  const top = colour ? scoreTop(colour) : 1;
  container.replaceChildren();
  container.style.gridTemplateColumns = `${rowLabel ? 40 : 28}px repeat(${nHeads}, 1fr)`;
  container.append(axis(""));
  for (let h = 0; h < nHeads; h++) container.append(axis(`h${h}`));
  for (let l = 0; l < nLayers; l++) {
    const label = rowLabel?.(l) ?? { text: `L${l}`, title: "" };
    container.append(Object.assign(axis(label.text), label.title ? { title: label.title } : {}));
    for (let h = 0; h < nHeads; h++) {
      const value = colour?.values?.[l]?.[h], label = colour?.labels?.[l]?.[h] ?? null;
      const canvas = colour ? drawScoreTile(value, top, label) : drawThumb(thumbs[l][h]);
      canvas.dataset.layer = l; canvas.dataset.head = h;
      canvas.title = `layer ${l}, head ${h}` + (entropy ? `, mean entropy ${entropy[l][h].toFixed(3)}` : "")
        + (colour ? `, ${colour.name.replaceAll("_", " ")} ${value == null ? "n/a" : value.toFixed(3) + colour.unit}` : "")
        + (label ? `, label: ${label.replaceAll("_", " ")}` : "");
      if (colour) { canvas.dataset.score = value ?? ""; canvas.dataset.label = label ?? ""; }
      if (l === layer && h === head) canvas.classList.add("selected");
      canvas.addEventListener("click", () => onSelect(l, h));
      keyActivate(canvas, () => { markRefocus(container); onSelect(l, h); }, canvas.title);
      // one tab stop for the grid (the selected head); ← → ↑ ↓ move the selection, Enter picks a cell
      canvas.tabIndex = l === layer && h === head ? 0 : -1;
      container.append(canvas);
    }
  }
  if (colour) container.append(scoreLegend(colour, top));
  container.dataset.colour = colour ? colour.name : "none";
  if (!container.dataset.arrowsBound) {
    container.dataset.arrowsBound = "1";
    container.addEventListener("keydown", (e) => { if (e.key.startsWith("Arrow")) markRefocus(container); });
  }
  keepFocus(container, "canvas.selected");
}

function axis(text) {
  const el = document.createElement("div");
  el.className = "axis";
  el.textContent = text;
  return el;
}

// rows × cols: cross-attention thumbnails are rectangular (target queries × source keys).
function drawThumb(matrix) {
  const n = matrix.length, m = matrix[0]?.length ?? 0;
  const canvas = document.createElement("canvas");
  canvas.width = m; canvas.height = n;
  const ctx = canvas.getContext("2d");
  const image = ctx.createImageData(m, n);
  let max = 1e-12;
  for (const row of matrix) for (const v of row) if (v > max) max = v;
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < m; j++) {
      const [r, g, b] = viridis(matrix[i][j] / max);
      const o = 4 * (i * m + j);
      image.data[o] = r; image.data[o + 1] = g; image.data[o + 2] = b; image.data[o + 3] = 255;
    }
  }
  ctx.putImageData(image, 0, 0);
  return canvas;
}

// Shares of a row's attention (sink mass, previous-token, induction, duplicate-token) on a fixed 0–1 scale, so grids
// of different models and scores compare; the mean distance (tokens) on 0 to its largest value.
function scoreTop(colour) {
  if (colour.name !== "mean_distance") return 1;
  let top = 1e-12;
  for (const row of colour.values) for (const v of row) if (v != null && v > top) top = v;
  return top;
}

const TILE = 48;
function drawScoreTile(value, top, label) {
  const canvas = document.createElement("canvas");
  canvas.width = TILE; canvas.height = TILE;
  canvas.classList.add("score-tile");
  const ctx = canvas.getContext("2d");
  const t = value == null ? null : Math.max(0, Math.min(1, value / top));
  const [r, g, b] = t == null ? [210, 210, 210] : viridis(t);
  ctx.fillStyle = `rgb(${r}, ${g}, ${b})`;
  ctx.fillRect(0, 0, TILE, TILE);
  if (label) {
    ctx.fillStyle = t != null && t > 0.6 ? "#111" : "#fff"; // dark text on viridis' light yellow end
    ctx.font = "bold 15px sans-serif";
    ctx.textAlign = "center"; ctx.textBaseline = "middle";
    ctx.fillText(LABEL_MARKS[label] ?? label, TILE / 2, TILE / 2);
  }
  return canvas;
}

function scoreLegend(colour, top) {
  const legend = document.createElement("div");
  legend.className = "score-legend";
  const bar = document.createElement("span"); // a gradient, not a canvas: the grid's canvases are its heads
  bar.className = "score-bar";
  const stops = Array.from({ length: 11 }, (_, i) => `rgb(${viridis(i / 10).join(", ")}) ${i * 10}%`);
  bar.style.background = `linear-gradient(to right, ${stops.join(", ")})`;
  const name = colour.name.replaceAll("_", " ") + (colour.source ? ` (${colour.source})` : "");
  const end = colour.name === "mean_distance" ? `${top.toFixed(1)}${colour.unit}` : "1";
  legend.append(`${name}: 0 `, bar, ` ${end}`, colour.labels ? " · labels: prev = previous-token, ind = induction, dup = duplicate-token, sink" : "");
  return legend;
}
