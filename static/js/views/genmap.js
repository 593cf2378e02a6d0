// Attention while the model writes (docs/api.md "Generating", issue 39): while a continuation streams, the map of the
// selected head grows one row per new token — the row of the query that produced it, over the prompt and the tokens
// generated before it — without (left) and with (right) the interventions. A click on a row (a generated token) draws
// that row as bars; once the stream is done, "why?" splits the clicked score over the residual stream's parts
// (static/js/views/why.js) on the kept sequence's own token ids.
//
// mountGenMap(root, {why}) fills `root` and returns {start(request, promptTokens), step(event), done(answer), reset()}.
import { button, el, showToken } from "../dom.js";
import { decodeTensor, fmt } from "../mathx.js";

const CONFIG = { responsive: true, displaylogo: false };
const SIDES = [["base_", "without interventions"], ["", "with the interventions"]];

export function mountGenMap(root, { why }) {
  const title = el("div", { className: "help", id: "gen-attention-title" });
  const maps = Object.fromEntries(SIDES.map(([prefix]) => [prefix, el("div", {
    id: prefix ? "gen-map-base" : "gen-map-intervened", className: "plot grow", style: "height:300px; min-width:0" })]));
  const rowPlot = el("div", { id: "gen-row", className: "plot", style: "height:220px", hidden: true });
  const offer = el("p", { className: "help", id: "gen-why-offer" });
  root.replaceChildren(title, el("div", { className: "row" }, maps.base_, maps[""]), rowPlot, offer);
  let shown = null; // {request, layer, head, prompt (tokens or null), P, rows: {prefix: [Float32Array]}, tokens, ids, answer}

  function reset() {
    shown = null;
    root.hidden = true;
    rowPlot.hidden = true;
    offer.replaceChildren();
    for (const node of Object.values(maps)) if (node.data) Plotly.purge(node);
  }

  function start(request, promptTokens) {
    reset();
    const { layers: [layer], heads: [head] } = request.attention;
    shown = { request, layer, head, prompt: promptTokens, P: null, rows: { base_: [], "": [] }, tokens: { base_: [], "": [] },
      ids: { base_: [], "": [] }, answer: null, clicked: null };
    title.textContent = `layer ${layer}, head ${head}: one row per new token, its attention over the prompt and the tokens before it`;
    root.hidden = false;
  }

  // the key labels of a side: the prompt's tokens (or positions), then that side's generated tokens
  function keyLabels(prefix) {
    const prompt = shown.prompt && shown.prompt.length === shown.P ? shown.prompt : Array.from({ length: shown.P }, (_, i) => `#${i}`);
    return [...prompt, ...shown.tokens[prefix]].map((t, i) => `${i}:${showToken(t)}`);
  }

  function draw(prefix) {
    const rows = shown.rows[prefix], width = shown.P + rows.length;
    const z = rows.map((row) => Array.from({ length: width }, (_, j) => (j < row.length ? row[j] : null)));
    const x = keyLabels(prefix).slice(0, width);
    const y = rows.map((_, s) => `${s}:${showToken(shown.tokens[prefix][s] ?? "")}`);
    const label = SIDES.find(([p]) => p === prefix)[1];
    Plotly.react(maps[prefix], [{
      // the page's scale (Viridis from 0 to the map's largest P); keys after a row's query are empty (null)
      type: "heatmap", z, x, y, colorscale: "Viridis", zmin: 0, showscale: prefix === "",
      hovertemplate: "new token %{y}<br>key %{x}<br>P = %{z:.4f}<extra></extra>", xgap: 0, ygap: 1,
    }], {
      title: { text: label, font: { size: 12 } }, margin: { l: 90, r: 10, t: 28, b: 70 },
      xaxis: { type: "category", tickangle: -60, automargin: true, tickfont: { size: 9 } },
      yaxis: { type: "category", autorange: "reversed", automargin: true, tickfont: { size: 9 } },
    }, CONFIG).then(() => {
      if (maps[prefix].dataset.wired) return;
      maps[prefix].dataset.wired = "1";
      maps[prefix].on("plotly_click", (ev) => {
        const pt = ev.points?.[0];
        if (pt) pick(prefix, pt.pointIndex?.[0] ?? 0, pt.pointIndex?.[1] ?? null);
      });
    });
    maps[prefix].dataset.rows = String(rows.length);
  }

  function step(event) {
    if (!shown) return;
    for (const [prefix] of SIDES) {
      if (event[`${prefix}ended`] || !event[`${prefix}attention`]) continue;
      const row = Float32Array.from(decodeTensor(event[`${prefix}attention`])[0][0]); // (P + s)
      if (shown.P === null) shown.P = row.length - event.step;
      shown.rows[prefix].push(row);
      shown.tokens[prefix].push(event[`${prefix}token`]);
      shown.ids[prefix].push(event[`${prefix}id`]);
      draw(prefix);
    }
  }

  function done(answer) {
    if (!shown) return;
    shown.answer = answer;
    if (shown.clicked) pick(...shown.clicked);
  }

  // A generated token's row as bars; the key `key` (else the row's largest) offered to "why?" once the stream is done.
  function pick(prefix, s, key) {
    const row = shown.rows[prefix][s];
    if (!row) return;
    const best = key ?? row.indexOf(Math.max(...row));
    shown.clicked = [prefix, s, key];
    const labels = keyLabels(prefix).slice(0, row.length);
    const query = shown.P + s - 1;
    rowPlot.hidden = false;
    Plotly.react(rowPlot, [{ type: "bar", x: labels, y: Array.from(row), marker: { color: labels.map((_, j) => (j === best ? "#e8590c" : j >= shown.P ? "#7048e8" : "#3b5bdb")) },
      hovertemplate: "key %{x}<br>P = %{y:.4f}<extra></extra>" }], {
      title: { text: `${prefix ? "without" : "with"} interventions · new token ${s} (${showToken(shown.tokens[prefix][s])}): the row of query ${query} over ${row.length} keys (violet: generated)`, font: { size: 12 } },
      margin: { l: 50, r: 10, t: 30, b: 70 }, xaxis: { type: "category", tickangle: -60, tickfont: { size: 9 } }, yaxis: { title: { text: "P" }, rangemode: "tozero" },
    }, CONFIG);
    rowPlot.dataset.step = String(s);
    rowPlot.dataset.side = prefix || "intervened";
    const answer = shown.answer;
    if (!answer?.prompt_ids) {
      offer.replaceChildren(`query ${query} → key ${best} (${showToken(labels[best].split(":").slice(1).join(":"))}): P = ${fmt(row[best], 4)}; “why?” once the continuation is done`);
      return;
    }
    const ids = [...answer.prompt_ids, ...shown.ids[prefix].slice(0, s)];
    const r = shown.request;
    offer.replaceChildren(`query ${query} → key ${best}: P = ${fmt(row[best], 4)} `, button("why?", () => why.open({
      model: r.model, text: r.text, chat: Boolean(r.chat), ids, layer: shown.layer, head: shown.head, query, key: best,
      interventions: prefix ? [] : r.interventions,
    }), { id: "gen-why-button", title: "split this score over the parts of the residual stream (the generated tokens' own ids)" }));
  }

  reset();
  return { start, step, done, reset };
}
