// P̂ − P (or P̂ / P) of one head (§4): after the interventions minus the same input without them.
// One figure for every page: a query × key matrix (text) or a query row laid out on the patch grid (images).
import { fmt, maxAbs } from "../mathx.js";

const CONFIG = { responsive: true, displaylogo: false };

// d: {after, before (matrices of one shape), x, y (axis labels, or null for numeric axes), where ("layer 2,
// head 3"), subtitle, square (equal axes: a patch grid), masked ((i, j) → whether the cell's key is masked)} or null
// (nothing to compare: `empty` is shown).
// el.dataset.maxAbs holds max |P̂ − P| (0 when nothing differs) for tests and benchmarks.
export function drawDiff(el, d, { ratio = false, empty = "no interventions active: P̂ = P" } = {}) {
  if (!d) {
    el.dataset.maxAbs = "0";
    Plotly.react(el, [], {
      margin: { l: 40, r: 10, t: 30, b: 30 }, xaxis: { visible: false }, yaxis: { visible: false },
      annotations: [{ text: empty, showarrow: false, font: { color: "#667085" } }],
    }, CONFIG);
    return;
  }
  const { after, before, x = null, y = null, where = "", subtitle = "", square = false } = d;
  const diff = after.map((row, i) => row.map((p, j) => p - before[i][j]));
  const maxAbsDiff = maxAbs(diff, 0);
  el.dataset.maxAbs = String(maxAbsDiff);
  const span = Math.max(maxAbsDiff, 1e-12);
  const dense = (x?.length ?? 0) > 40 || (y?.length ?? 0) > 40;
  const axes = square
    ? { xaxis: { constrain: "domain" }, yaxis: { autorange: "reversed", scaleanchor: "x" } }
    : {
      xaxis: { title: { text: "key" }, tickangle: -60, type: "category", showticklabels: !dense },
      yaxis: { title: { text: "query" }, autorange: "reversed", type: "category", showticklabels: !dense },
    };
  const margin = square ? { l: 30, r: 10, t: 50, b: 20 } : { l: dense ? 40 : 90, r: 10, t: 30, b: dense ? 40 : 90 };
  const sub = subtitle ? `<br><sub>${subtitle}</sub>` : "";
  const labels = { ...(x ? { x } : {}), ...(y ? { y } : {}) };
  if (ratio) {
    // P̂ / P where P > 1e-6 (else blank); log scale colours: 1 = unchanged.
    const r = after.map((row, i) => row.map((p, j) => (before[i][j] > 1e-6 ? p / before[i][j] : null)));
    const logs = r.flat().filter((v) => v !== null && v > 0).map((v) => Math.abs(Math.log10(v)));
    const logSpan = maxAbs(logs, 1e-6);
    Plotly.react(el, [{
      type: "heatmap", z: r.map((row) => row.map((v) => (v === null || v <= 0 ? null : Math.log10(v)))), ...labels,
      customdata: r, colorscale: "RdBu", reversescale: true, zmid: 0, zmin: -logSpan, zmax: logSpan,
      hovertemplate: "query %{y}<br>key %{x}<br>P̂ / P = %{customdata:.5f}<extra></extra>",
      colorbar: { thickness: 12, title: { text: "log₁₀" } },
    }], { title: { text: `P̂ / P at ${where} (log₁₀ colour; blank where P ≈ 0)${sub}`, font: { size: 13 } }, margin, ...axes }, CONFIG);
    return;
  }
  const overlay = maskedOverlay(d, labels, square);
  Plotly.react(el, [{
    type: "heatmap", z: diff, ...labels, colorscale: "RdBu", reversescale: true, zmid: 0, zmin: -span, zmax: span,
    hovertemplate: `${square ? "patch (%{y}, %{x})" : "query %{y}<br>key %{x}"}<br>P̂ − P = %{z:.5f}<extra></extra>`,
    colorbar: { thickness: 12 }, showlegend: false,
  }, ...overlay], {
    title: { text: `P̂ − P at ${where}  (max |Δ| = ${fmt(maxAbsDiff, 3)})${sub}`, font: { size: 13 } }, margin, ...axes,
    showlegend: overlay.length > 0, legend: { orientation: "h", x: 0, y: square ? -0.05 : 1.02, yanchor: square ? "top" : "bottom", xanchor: "left" },
  }, CONFIG);
}

// A masked key's cells (P̂ = 0 by the mask where P was not): drawn in a colour of their own, with a legend entry, so
// that they are not read as "no change" (RdBu's white) where P was small. d.masked(i, j): the cell's key is masked
// for this head. Cells where P was 0 as well (a causal map's upper triangle) did not change and stay as they are.
export const MASKED_COLOUR = "#2e9e44"; // green: outside RdBu's reds, greys and blues
function maskedOverlay({ after, before, masked = null }, labels, square) {
  if (!masked) return [];
  let any = false;
  const z = after.map((row, i) => row.map((p, j) => {
    const hit = p === 0 && before[i][j] !== 0 && masked(i, j);
    any ||= hit;
    return hit ? 1 : null;
  }));
  if (!any) return [];
  const what = "masked key: P̂ = 0 by the mask";
  return [{
    type: "heatmap", name: "masked", z, ...labels, customdata: before, showscale: false, hoverongaps: false,
    colorscale: [[0, MASKED_COLOUR], [1, MASKED_COLOUR]], zmin: 0, zmax: 1, showlegend: false,
    hovertemplate: `${square ? "patch (%{y}, %{x})" : "query %{y}<br>key %{x}"}<br>${what} (P was %{customdata:.5f})<extra></extra>`,
  }, { // its legend entry (a heatmap draws none)
    type: "scatter", mode: "markers", x: [null], y: [null], name: `${what}, not “no change”`, showlegend: true,
    marker: { symbol: "square", size: 12, color: MASKED_COLOUR }, hoverinfo: "skip",
  }];
}
