// Patching over a set of prompt pairs, in the patching panel (templates/partials/analysis.html, views/analysis.js):
// the pairs as pasted lines ("clean | corrupt [| answer | wrong]") or a template with {slots} and one filler line per
// pair; the answer (POST /api/text/patching with `pairs` or `template`) drawn as each head's mean effect, the
// attribution estimate's mean beside it, an error-bar strip of the top heads (mean ± std, every pair's value, the
// estimate) and how well each estimate ranks the heads (Spearman ρ, top-k overlap).
import { byId, el } from "../dom.js";
import { fmt } from "../mathx.js";

const CONFIG = { responsive: true, displaylogo: false };
const DIVERGING = [[0, "#b2182b"], [0.5, "#f7f7f7"], [1, "#2166ac"]];
const NAMES = { atp_star: "AtP*", atp: "AtP", head_output: "attribution (head output)" };
const STRIP_HEADS = 12;

// An answer typed after "|" is a next word: it gets one leading space (" Paris"), the token a prompt ending in a
// word is followed by.
const answerText = (s) => (s === undefined || s.trim() === "" ? undefined : ` ${s.trim()}`);

// "clean | corrupt [| answer | wrong]" per line → [{clean, corrupt, answer?, wrong?}]; throws naming the line.
export function parsePairLines(text) {
  const pairs = [];
  text.split("\n").forEach((line, i) => {
    if (!line.trim()) return;
    const parts = line.split("|");
    if (parts.length < 2 || parts.length > 4) throw new Error(`line ${i + 1}: write "clean | corrupt" (optionally "| answer | wrong")`);
    const pair = { clean: parts[0].trim(), corrupt: parts[1].trim() };
    if (answerText(parts[2])) pair.answer = answerText(parts[2]);
    if (answerText(parts[3])) pair.wrong = answerText(parts[3]);
    pairs.push(pair);
  });
  if (!pairs.length) throw new Error("no pairs: one line per pair, \"clean | corrupt\"");
  return pairs;
}

// A template "The capital of {country} is" and filler lines "France | Italy [| Paris | Rome]" (several slots: the
// values comma-separated in the slots' order) → {text, fillers}; throws naming the line.
export function parseTemplate(template, fillerText) {
  const slots = [...new Set([...template.matchAll(/\{([A-Za-z_]\w*)\}/g)].map((m) => m[1]))];
  if (!slots.length) throw new Error("the template has no {slot}: e.g. The capital of {country} is");
  const fillers = [];
  fillerText.split("\n").forEach((line, i) => {
    if (!line.trim()) return;
    const parts = line.split("|");
    if (parts.length < 2 || parts.length > 4) throw new Error(`filler line ${i + 1}: write "clean value | corrupt value"`);
    const side = (part) => {
      const values = slots.length === 1 ? [part.trim()] : part.split(",").map((v) => v.trim());
      if (values.length !== slots.length) throw new Error(`filler line ${i + 1}: ${slots.length} values (${slots.join(", ")}) on each side`);
      return Object.fromEntries(slots.map((s, k) => [s, values[k]]));
    };
    const filler = { clean: side(parts[0]), corrupt: side(parts[1]) };
    if (answerText(parts[2])) filler.answer = answerText(parts[2]);
    if (answerText(parts[3])) filler.wrong = answerText(parts[3]);
    fillers.push(filler);
  });
  if (!fillers.length) throw new Error("no fillers: one line per pair");
  return { text: template, fillers };
}

// The set fields of the request from the panel's boxes, or null when the panel scans one pair.
export function setRequestFields() {
  const mode = byId("patch-source")?.value;
  if (mode === "lines") return { pairs: parsePairLines(byId("patch-set-lines").value) };
  if (mode === "template") return { template: parseTemplate(byId("patch-template").value, byId("patch-fillers").value) };
  return null;
}

// Show the boxes of the chosen source (one pair, pasted lines, template).
export function followSource() {
  const mode = byId("patch-source")?.value ?? "pair";
  byId("patch-pair-box").hidden = mode !== "pair";
  byId("patch-lines-box").hidden = mode !== "lines";
  byId("patch-template-box").hidden = mode !== "template";
  byId("patch-scan").disabled = mode !== "pair"; // a set is scanned by heads
  if (mode !== "pair") byId("patch-scan").value = "heads";
}

// The set's figures; returns the status line.
export async function drawSet(Plotly, result) {
  byId("patch-results").hidden = true;
  const box = byId("patch-set-results");
  box.hidden = false;
  const layers = result.effect.length, heads = result.effect[0].length;
  const x = Array.from({ length: heads }, (_, h) => `h${h}`), y = Array.from({ length: layers }, (_, l) => `L${l}`);
  const exact = Boolean(result.agreement);
  const estimateName = byId("patch-set-estimate-name").value;
  const estimate = result.estimates[estimateName];
  const values = (m) => m.flat().filter((v) => v !== null).map(Math.abs);
  const limit = Math.max(1e-6, ...values(result.effect), ...values(estimate.mean));
  const std = result.effect_std;
  const heat = (z, title, spread) => ({
    data: [{
      type: "heatmap", z, x, y, colorscale: DIVERGING, zmin: -limit, zmax: limit, zmid: 0, hoverongaps: false,
      customdata: spread, hovertemplate: "%{y} %{x}<br>mean %{z:.3f} ± %{customdata:.3f}<extra></extra>",
      colorbar: { thickness: 12, title: { text: "effect" } },
    }],
    layout: { title: { text: title, font: { size: 13 } }, margin: { l: 48, r: 10, t: 36, b: 36 },
      yaxis: { autorange: "reversed", type: "category", dtick: 1, tickfont: { size: 10 } }, xaxis: { type: "category" } },
  });
  const n = result.pairs_used?.length ?? result.n_pairs;
  // `effect` of method "attribution" is the attribution estimate on the head output, as a single pair's (docs/api.md)
  const mean = heat(result.effect, `${exact ? "exact patch" : "attribution (head output) estimate"}: mean effect over ${n} pairs`, std);
  await Plotly.react(byId("patch-set-heatmap"), mean.data, mean.layout, CONFIG);
  const side = heat(estimate.mean, `${NAMES[estimateName]}: mean estimate`, estimate.std);
  await Plotly.react(byId("patch-set-estimate"), side.data, side.layout, CONFIG);

  // the strip: the heads with the largest |mean|, each with its spread, every pair's value and the estimate
  const cells = [];
  result.effect.forEach((row, l) => row.forEach((v, h) => { if (v !== null) cells.push({ l, h, v }); }));
  cells.sort((a, b) => Math.abs(b.v) - Math.abs(a.v));
  const top = cells.slice(0, STRIP_HEADS);
  const labels = top.map((c) => `L${c.l} h${c.h}`);
  const perPair = result.effect_per_pair ?? estimate.per_pair;
  const used = result.pairs_used ?? perPair.map((_, k) => k);
  const traces = [{
    type: "scatter", mode: "markers", name: "mean ± std", x: labels, y: top.map((c) => c.v),
    error_y: { type: "data", array: top.map((c) => std[c.l][c.h] ?? 0), visible: true, thickness: 2, width: 6 },
    marker: { size: 10, color: "#2166ac" }, hovertemplate: "%{x}: %{y:.3f} ± %{error_y.array:.3f}<extra></extra>",
  }, {
    type: "scatter", mode: "markers", name: "each pair", x: used.flatMap(() => labels),
    y: used.flatMap((k) => top.map((c) => perPair[k][c.l][c.h])),
    customdata: used.flatMap((k) => top.map(() => k)),
    marker: { size: 6, color: "rgba(0,0,0,0.35)", symbol: "circle-open" },
    hovertemplate: "%{x}, pair %{customdata}: %{y:.3f}<extra></extra>",
  }];
  if (exact) {
    traces.push({
      type: "scatter", mode: "markers", name: NAMES[estimateName], x: labels,
      y: top.map((c) => estimate.mean[c.l][c.h]), marker: { size: 10, symbol: "diamond-open", color: "#b2182b" },
      hovertemplate: `%{x}: ${NAMES[estimateName]} %{y:.3f}<extra></extra>`,
    });
  }
  await Plotly.react(byId("patch-set-strip"), traces, {
    title: { text: `the ${top.length} heads with the largest mean effect`, font: { size: 13 } },
    margin: { l: 55, r: 10, t: 36, b: 50 }, xaxis: { type: "category" }, yaxis: { title: { text: "effect" }, zeroline: true },
    legend: { orientation: "h", y: -0.25 },
  }, CONFIG);

  const table = byId("patch-set-agreement");
  if (exact) {
    const head = el("tr", {}, ...["estimate", "Spearman ρ (all heads)", `top-${result.top_k} overlap`]
      .map((t) => el("th", { textContent: t })));
    const rows = ["atp_star", "atp", "head_output"].map((name) => {
      const a = result.agreement[name];
      const row = el("tr", {}, ...[NAMES[name], fmt(a.spearman, 3), `${Math.round(a.top_k_overlap * a.k)} / ${a.k}`]
        .map((t) => el("td", { textContent: t })));
      row.dataset.estimate = name;
      return row;
    });
    table.replaceChildren(el("thead", {}, head), el("tbody", {}, ...rows));
  } else {
    table.replaceChildren();
  }
  table.hidden = !exact;
  box.dataset.pairs = String(result.n_pairs);
  const warn = result.warnings?.length ? ` · ${result.warnings.join("; ")}` : "";
  if (!exact) return `${n} pairs: the estimates alone${warn}`;
  const best = top[0];
  return `${n} pairs · top head L${best.l} h${best.h} (${fmt(best.v, 3)} ± ${fmt(std[best.l][best.h], 3)}) · ` +
    `AtP* ρ = ${fmt(result.agreement.atp_star.spearman, 3)}, AtP ρ = ${fmt(result.agreement.atp.spearman, 3)}${warn}`;
}
