// Head summaries (§6): mean row entropy per layer × head and mean attention distance, as heatmaps
// and as a sortable table. Clicking a cell or a row selects that head everywhere (onSelect).
import { fmt } from "../mathx.js";
import { keepFocus, keyActivate, markRefocus } from "../dom.js";

const CONFIG = { responsive: true, displaylogo: false };
const sortState = new WeakMap(); // table element → {key, dir}

function heatmap(el, z, { title, colorscale, unit, layer, head, onSelect }) {
  const nHeads = z[0]?.length ?? 0;
  Plotly.react(el, [{
    type: "heatmap", z, colorscale, x: z[0].map((_, h) => h), y: z.map((_, l) => l),
    hovertemplate: `layer %{y}, head %{x}<br>%{z:.3f} ${unit}<extra></extra>`, colorbar: { thickness: 10 },
  }], {
    title: { text: title, font: { size: 13 } },
    margin: { l: 40, r: 10, t: 30, b: 35 },
    xaxis: { title: { text: "head" }, dtick: nHeads > 16 ? undefined : 1 },
    yaxis: { title: { text: "layer" }, autorange: "reversed", dtick: 1 },
    shapes: [{ type: "rect", x0: head - 0.5, x1: head + 0.5, y0: layer - 0.5, y1: layer + 0.5, line: { color: "#e03131", width: 2 } }],
  }, CONFIG);
  if (!el.dataset.clickBound) {
    el.dataset.clickBound = "1";
    el.on("plotly_click", (ev) => {
      const pt = ev.points?.[0];
      if (pt) el._onSelect?.(Number(pt.y), Number(pt.x));
    });
  }
  el._onSelect = onSelect;
}

// els: {entropyEl, distanceEl, tableEl}; data: {entropy [L][H], distance [L][H] | null, distanceUnit}
export function drawSummaries(els, { entropy, distance = null, distanceUnit = "tokens", layer, head, onSelect }) {
  if (!entropy) return;
  heatmap(els.entropyEl, entropy, { title: "mean row entropy −Σ P log P (nats)", colorscale: "Blues", unit: "nats", layer, head, onSelect });
  if (els.distanceEl) {
    if (distance) {
      heatmap(els.distanceEl, distance, { title: `mean attention distance Σ_j P[i,j]·|pos_i − pos_j| (${distanceUnit})`, colorscale: "Oranges", unit: distanceUnit, layer, head, onSelect });
    } else {
      Plotly.purge(els.distanceEl);
      els.distanceEl.textContent = "mean attention distance: not provided by the server";
    }
  }
  if (els.tableEl) drawTable(els.tableEl, { entropy, distance, distanceUnit, layer, head, onSelect });
}

function drawTable(tableEl, { entropy, distance, distanceUnit, layer, head, onSelect }) {
  const rows = [];
  entropy.forEach((row, l) => row.forEach((e, h) => rows.push({ layer: l, head: h, entropy: e, distance: distance ? distance[l][h] : null })));
  const sort = sortState.get(tableEl) || { key: "entropy", dir: 1 };
  rows.sort((a, b) => sort.dir * ((a[sort.key] ?? 0) - (b[sort.key] ?? 0)) || a.layer - b.layer || a.head - b.head);
  const columns = [["layer", "layer"], ["head", "head"], ["entropy", "entropy (nats)"]];
  if (distance) columns.push(["distance", `distance (${distanceUnit})`]);
  const thead = document.createElement("thead");
  const tr = document.createElement("tr");
  for (const [key, text] of columns) {
    const th = document.createElement("th");
    th.textContent = text + (sort.key === key ? (sort.dir > 0 ? " ▲" : " ▼") : "");
    th.dataset.sort = key;
    th.title = "click to sort";
    th.addEventListener("click", () => {
      sortState.set(tableEl, { key, dir: sort.key === key ? -sort.dir : 1 });
      drawTable(tableEl, { entropy, distance, distanceUnit, layer, head, onSelect });
    });
    tr.append(th);
  }
  thead.append(tr);
  const tbody = document.createElement("tbody");
  for (const r of rows) {
    const row = document.createElement("tr");
    row.dataset.layer = r.layer; row.dataset.head = r.head;
    if (r.layer === layer && r.head === head) row.className = "selected";
    for (const [key] of columns) {
      const td = document.createElement("td");
      td.textContent = key === "layer" || key === "head" ? r[key] : fmt(r[key], 4);
      row.append(td);
    }
    row.addEventListener("click", () => onSelect(r.layer, r.head));
    keyActivate(row, () => { markRefocus(tableEl); onSelect(r.layer, r.head); }, `select layer ${r.layer}, head ${r.head}`);
    row.tabIndex = r.layer === layer && r.head === head ? 0 : -1; // one tab stop; arrows move the selection
    row.addEventListener("keydown", (e) => { if (e.key.startsWith("Arrow")) markRefocus(tableEl); });
    tbody.append(row);
  }
  tableEl.replaceChildren(thead, tbody);
  keepFocus(tableEl, "tbody tr.selected");
}
