// "Why does this head attend there?" on the text page (docs/science.md "Query–key attribution"): a click on a cell
// (i, j) of a decoder's heatmap offers "why?"; the panel then shows POST /api/text/qk_attribution's answer — the
// score β·Ŝ_ij split over query parts × key parts as a heatmap, the two marginals as bars, and the largest key-side
// head parts expanded into the source tokens their head read at j, as chips.
//
// mountWhy(anchor, {request}): the panel goes after `anchor` (the heatmap's row); request() gives the page's
// {model, text, chat, layer, head, interventions}. Returns {offer(query, key, tokens), hide()}.
import { postJSON } from "../api.js";
import { button, el, visibleToken } from "../dom.js";
import { fmt } from "../mathx.js";
import { loadPlotly } from "../vendor.js";

const CONFIG = { responsive: true, displaylogo: false };
const DIVERGING = [[0, "#b2182b"], [0.5, "#f7f7f7"], [1, "#2166ac"]];
const SHOWN_PARTS = 16; // parts per side in the matrix and bars (largest |total| first); the rest are summed as "other"
const SHOWN_SOURCES = 8;

export function mountWhy(anchor, { request }) {
  const offer = el("p", { className: "help", id: "why-offer", hidden: true });
  anchor.after(offer);
  const panel = el("section", { className: "panel", id: "why-panel", hidden: true, style: "scroll-margin-top: 64px" });
  offer.after(panel);
  const title = el("small", { id: "why-title" });
  const status = el("p", { className: "help", id: "why-status", role: "status" });
  const matrixPlot = el("div", { id: "why-matrix", className: "plot", style: "height:460px" });
  const queryBars = el("div", { id: "why-query-bars", className: "plot grow", style: "height:360px" });
  const keyBars = el("div", { id: "why-key-bars", className: "plot grow", style: "height:360px" });
  const expansion = el("div", { id: "why-expanded" });
  panel.append(
    el("h2", {}, "Why this head attends there ", title, " ", button("close", () => { panel.hidden = true; })),
    status, matrixPlot, el("div", { className: "row" }, queryBars, keyBars),
    el("h3", { textContent: "Key-side heads, expanded: the tokens each read at j" }), expansion,
    el("p", { className: "help", textContent:
      "β·Ŝ_ij = Σ over (query part a, key part b) of β·q_i(a)·k_j(b), exactly: the residual stream entering the layer "
      + "is a sum of the embedding, each earlier head (through its slice of W_O), each earlier MLP and the biases, and "
      + "with every norm frozen at its actual scale the query and key are linear in those parts (RoPE at i and j, "
      + "β included; masks and soft-cap come after). An expanded head part splits z_j = Σ_m P[j, m] v_m by the source "
      + "position m it read: a previous-token head carries token j−1 into the key at j, which an induction head's "
      + "query then matches (see the guide, Query–key attribution)." }),
  );
  let pending = null;

  function hide() { offer.hidden = true; }

  function offerCell(query, key, tokens) {
    const req = request();
    offer.replaceChildren(
      `layer ${req.layer}, head ${req.head}: query ${query} (${visibleToken(tokens[query] ?? "")}) → key ${key} `
      + `(${visibleToken(tokens[key] ?? "")}) `,
      key > query ? "— a decoder's query sees only keys ≤ it" : button("why?", () => open({ ...req, query, key }),
        { id: "why-button", title: "split this score over the parts of the residual stream" }),
    );
    offer.hidden = false;
  }

  async function open(body) {
    panel.hidden = false;
    panel.scrollIntoView({ block: "start", behavior: "smooth" });
    status.textContent = "attributing (one run of the model)…";
    title.textContent = `layer ${body.layer}, head ${body.head}: ${body.query} → ${body.key}`;
    const mine = {};
    pending = mine;
    try {
      const answer = await postJSON("/api/text/qk_attribution", { ...body, expand: 3 }, { channel: "why" });
      if (pending !== mine) return;
      await draw(answer);
    } catch (err) {
      if (err?.name === "AbortError" || pending !== mine) return;
      status.textContent = `why? ${err.message ?? err}`;
    }
  }

  async function draw(a) {
    await drawQK(await loadPlotly(), { title, status, matrixPlot, queryBars, keyBars, expansion }, a);
  }

  return { offer: offerCell, hide, open }; // open(body): a continuation's generated token (body.ids: its token ids)
}

// One qk_attribution answer `a` drawn into figs {title, status, matrixPlot, queryBars, keyBars, expansion} (any may be
// null): the why panel's, and the circuit view's for an attention edge (static/js/views/circuit.js), which passes
// `mark`, the part its edge comes from ("L3.H2", "L4.mlp", "embed"), and `side`, the side it feeds ("query" or
// "key"): that part is always shown there and outlined.
export async function drawQK(P, figs, a, { mark = null, side = null } = {}) {
  const tok = (i) => visibleToken(a.tokens?.[i] ?? "");
  if (figs.title) figs.title.textContent = `layer ${a.layer}, head ${a.head}: ${a.query} (${tok(a.query)}) → ${a.key} (${tok(a.key)})`;
  if (figs.status) {
    figs.status.textContent = `score β·Ŝ = ${fmt(a.score)} (β = ${fmt(a.beta)}), P[i, j] = ${fmt(a.attention)}; `
      + `the ${a.query_parts.length} × ${a.key_parts.length} parts sum to ${fmt(a.sum)}`
      + (a.softcap ? `; the soft-cap (${fmt(a.softcap)}) applies after this score` : "");
  }
  const qMark = side === "query" ? mark : null, kMark = side === "key" ? mark : null;
  const rows = shown(a.query_parts, a.query_totals, qMark), cols = shown(a.key_parts, a.key_totals, kMark);
  if (figs.matrixPlot) {
    const z = rows.map((r) => cols.map((c) => cellSum(a.matrix, r.indices, c.indices)));
    const top = Math.max(1e-12, ...z.flat().map(Math.abs));
    const label = (marked) => (item) => (item.name === marked ? `▶ ${item.name}` : item.name);
    P.react(figs.matrixPlot, [{
      type: "heatmap", z, x: cols.map(label(kMark)), y: rows.map(label(qMark)), colorscale: DIVERGING,
      zmin: -top, zmax: top, hovertemplate: "query part %{y}<br>key part %{x}<br>β·q(a)·k(b) = %{z:.4g}<extra></extra>",
      colorbar: { title: { text: "β q·k" } },
    }], {
      title: { text: "query parts × key parts (largest first; the rest summed as “other”)", font: { size: 13 } },
      margin: { l: 90, r: 10, t: 40, b: 90 }, yaxis: { autorange: "reversed", title: { text: `query ${a.query} (${tok(a.query)})` } },
      xaxis: { title: { text: `key ${a.key} (${tok(a.key)})` }, tickangle: -45 },
    }, CONFIG);
  }
  if (figs.queryBars) bars(P, figs.queryBars, rows, `query side: Σ over key parts (row totals)`, qMark);
  if (figs.keyBars) bars(P, figs.keyBars, cols, `key side: Σ over query parts (column totals)`, kMark);
  if (figs.expansion) figs.expansion.replaceChildren(...(a.expanded ?? []).map((entry) => expandedRow(entry, tok, a.key)));
}

function bars(P, node, items, text, mark = null) {
  // largest |total| at the top (a horizontal bar chart draws its first bar at the bottom)
  const real = items.filter((item) => item.name !== "other").sort((x, y) => Math.abs(x.total) - Math.abs(y.total));
  P.react(node, [{
    type: "bar", orientation: "h", x: real.map((i) => i.total), y: real.map((i) => i.name),
    marker: { color: real.map((i) => (i.total >= 0 ? "#2166ac" : "#b2182b")),
      line: { color: real.map((i) => (i.name === mark ? "#f08c00" : "rgba(0,0,0,0)")), width: real.map((i) => (i.name === mark ? 3 : 0)) } },
    hovertemplate: "%{y}: %{x:.4g}<extra></extra>",
  }], { title: { text, font: { size: 13 } }, margin: { l: 80, r: 10, t: 36, b: 30 } }, CONFIG);
}

// The parts of one side worth showing: the SHOWN_PARTS with the largest |total| in the model's order (and the part
// named `mark`, wherever it ranks), then "other" (the rest, summed), so that the shown cells still add up to the
// score. → [{name, total, indices}]
function shown(names, totals, mark = null) {
  const order = names.map((_, i) => i).sort((x, y) => Math.abs(totals[y]) - Math.abs(totals[x]));
  const kept = new Set(order.slice(0, SHOWN_PARTS));
  if (names.indexOf(mark) >= 0) kept.add(names.indexOf(mark));
  const items = names.map((name, i) => ({ name, total: totals[i], indices: [i] })).filter((_, i) => kept.has(i));
  const rest = order.filter((i) => !kept.has(i));
  if (rest.length) items.push({ name: "other", total: rest.reduce((s, i) => s + totals[i], 0), indices: rest });
  return items;
}

function cellSum(matrix, rows, cols) {
  let sum = 0;
  for (const r of rows) for (const c of cols) sum += matrix[r][c];
  return sum;
}

// One expanded head part: its total, then chips of the source tokens it read at j (each named by its position and its
// offset from j), tinted by their share.
function expandedRow(entry, tok, key) {
  const row = el("div", { className: "tokens why-expanded" },
    el("strong", { textContent: `${entry.key_part} (${fmt(entry.total)}): ` }));
  if (!entry.sources.length) {
    row.append(entry.note ?? "no sources");
    return row;
  }
  const top = Math.max(1e-12, ...entry.sources.map((s) => Math.abs(s.value)));
  for (const s of entry.sources.slice(0, SHOWN_SOURCES)) {
    const alpha = (0.15 + 0.85 * Math.abs(s.value) / top).toFixed(2);
    const colour = s.value >= 0 ? `rgba(33, 102, 172, ${alpha})` : `rgba(178, 24, 43, ${alpha})`;
    row.append(el("span", {
      className: "token why-source",
      textContent: `${s.position} (${s.position === key ? "j" : `j${s.position - key}`}): ${tok(s.position)} ${fmt(s.value, 3)}`,
      title: `source position ${s.position}: P[j, m] = ${fmt(s.attention)}, its share of the score ${fmt(s.value)}`,
      style: `background:${colour}; color:${Math.abs(s.value) / top > 0.6 ? "#fff" : "inherit"}`,
    }));
  }
  return row;
}
