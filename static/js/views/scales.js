// The attention heatmap's colour scales, shared by the text page and the embedded view (notebook widget,
// standalone HTML export). "max": 0 to this map's largest value (long inputs spread attention thin: at 512 tokens
// a 0–1 scale showed a uniform dark square); "fixed": 0 to 1; "log": log₁₀ P; "row": each row over its own max;
// "rowsk": 0 to the max over query rows ≥ k. A causal map has P[0, 0] = 1 whatever the head does (row 0 sees one
// key), so "this map's max" is always 1 there: its default is the log scale.
import { maxAbs } from "../mathx.js";

// [value, label] pairs, in the order the menus offer them.
export const SCALES = [
  ["max", "0 – this map's max"], ["fixed", "0 – 1"], ["log", "log scale (10⁻⁴ – max)"], ["row", "each row to its own max"],
  ["rowsk", "0 – max over rows ≥ k"],
];

const LOG_FLOOR = -4; // log scale: P ≤ 10⁻⁴ (and masked cells' 0) share the darkest colour
const LOG_TICKS = ["10⁻⁴", "0.001", "0.01", "0.1", "1"];

// P on `scale`: the values to colour (z), their range, and where z is not P, P itself for the hover (customdata)
// and the colour bar's ticks. rowsFrom: the first query row "rowsk" takes its top over.
export function scaleMatrix(P, scale, { rowsFrom = 0 } = {}) {
  if (scale === "log") {
    const top = Math.max(LOG_FLOOR + 0.01, Math.log10(Math.max(1e-12, maxAbs(P))));
    const z = P.map((row) => row.map((p) => (p > 10 ** LOG_FLOOR ? Math.log10(p) : LOG_FLOOR)));
    const tickvals = [-4, -3, -2, -1, 0].filter((t) => t <= top + 1e-9);
    return { z, zmin: LOG_FLOOR, zmax: top, customdata: P,
      colorbar: { tickvals, ticktext: tickvals.map((t) => LOG_TICKS[t + 4]), title: { text: "P (log)", side: "right" } } };
  }
  if (scale === "row") {
    const z = P.map((row) => { const m = maxAbs(row); return m > 0 ? row.map((p) => p / m) : row.slice(); });
    return { z, zmin: 0, zmax: 1, customdata: P, colorbar: { title: { text: "P / row max", side: "right" } } };
  }
  if (scale === "rowsk") {
    const k = Math.max(0, Math.min(P.length - 1, rowsFrom));
    return { z: P, zmin: 0, zmax: Math.max(1e-6, maxAbs(P.slice(k))), colorbar: { title: { text: `max of rows ≥ ${k}`, side: "right" } } };
  }
  return { z: P, zmin: 0, zmax: scale === "fixed" ? 1 : Math.max(1e-6, maxAbs(P)) };
}
