// The circuit view on the text page (templates/partials/circuit.html; docs/science.md "Circuits through attention"):
// POST /api/text/circuit scores every edge between the model's nodes (input, each head a{l}.h{h}, each MLP m{l},
// logits) over a set of prompt pairs, as a job with progress and an ETA; the graph is drawn layer by layer, bottom
// to top, with the edges kept at the chosen budget (top |score|, pruned to paths from input to logits, computed here
// from every edge's score and checked against the server's count), the faithfulness curve beside it. A click on an
// edge asks POST /api/text/circuit/edge for its exact score on the first pair and, for a query or key edge, the
// receiving head's attention row with and without it and its QK attribution with the sender's part marked (drawn by
// views/why.js); a click on a head shows its map in the page's views. Exports: JSON (MIB's form: every edge's score
// and in_graph at the budget) and PNG (the figure's button).
//
// mountCircuit({info, store, selectHead, onError}): info() the page's ModelInfo, store the lab's store (the panel
// follows the model it announces: decoder LMs only), selectHead(l, h) the page's head picker.
import { postJSON } from "../api.js";
import { byId, el, fillList, showToken, visibleToken } from "../dom.js";
import { downloadBlob } from "../lab/export.js";
import { fmt } from "../mathx.js";
import { loadPlotly } from "../vendor.js";
import { jobClock, postJob, showJobFailure } from "./jobs.js";
import { parsePairLines } from "./patchset.js";
import { drawQK } from "./why.js";

const CONFIG = { responsive: true, displaylogo: false };
export const MAX_DRAWN = 300; // more line segments than this make Plotly slow and the figure unreadable
// score = m(edge from the corrupt run) − m(clean): below 0 the edge carries the answer
const HELPS = "#2166ac", HURTS = "#b2182b";
const DASH = { q: "solid", k: "dash", v: "dot", "": "solid" };
const END_DX = { q: -0.28, k: 0, v: 0.28, "": 0 }; // where q, k and v edges end on their head
const WIDTHS = [[0.5, 5], [0.25, 3], [0.1, 1.6], [0, 0.8]]; // (|score| / the largest drawn, line width)

// "a3.h2->a7.h1<k>" → {name, from, to, channel: "k"}; "m4->logits" → channel "".
const EDGE = /^(.+?)->(.+?)(?:<([qkv])>)?$/;
export function parseEdge(name) {
  const m = EDGE.exec(name);
  return m ? { name, from: m[1], to: m[2], channel: m[3] ?? "" } : null;
}

// A node's place in the figure: y = 0 the input, 2l + 1 layer l's heads, 2l + 2 its MLP, 2L + 1 the logits; heads
// side by side at x = h, MLPs in a column right of them, input and logits centred. → {x, y, layer, head} (head null but for heads), or null when unknown.
export function nodePlace(name, layers, heads) {
  const mid = (heads - 1) / 2;
  if (name === "input") return { x: mid, y: 0, layer: null, head: null };
  if (name === "logits") return { x: mid, y: 2 * layers + 1, layer: null, head: null };
  let m = /^a(\d+)\.h(\d+)$/.exec(name);
  if (m) return { x: Number(m[2]), y: 2 * Number(m[1]) + 1, layer: Number(m[1]), head: Number(m[2]) };
  m = /^m(\d+)$/.exec(name);
  if (m) return { x: heads, y: 2 * Number(m[1]) + 2, layer: Number(m[1]), head: null };
  return null;
}

// The sender's name in a QK attribution's parts (models/qk_attribution.py): embed, L{l}.H{h}, L{l}.mlp.
export function partName(node) {
  if (node === "input") return "embed";
  let m = /^a(\d+)\.h(\d+)$/.exec(node);
  if (m) return `L${m[1]}.H${m[2]}`;
  m = /^m(\d+)$/.exec(node);
  return m ? `L${m[1]}.mlp` : null;
}

// The circuit at `budget`: the top round(budget · nEdges) edges by |score|, then only those on a path from input to
// logits (docs/api.md "Circuits through attention"). ranked: the edges sorted by |score|, largest first, each with
// its place's y (from, to). → a Set of names.
export function circuitAt(ranked, budget, nEdges = ranked.length) {
  const top = ranked.slice(0, Math.min(ranked.length, Math.round(budget * nEdges)));
  // every edge runs upwards (y of its sender < y of its receiver): one pass in y order settles each node
  const reach = new Set(["input"]), coreach = new Set(["logits"]);
  for (const e of [...top].sort((a, b) => a.fromY - b.fromY)) if (reach.has(e.from)) reach.add(e.to);
  for (const e of [...top].sort((a, b) => b.toY - a.toY)) if (coreach.has(e.to)) coreach.add(e.from);
  return new Set(top.filter((e) => reach.has(e.from) && coreach.has(e.to)).map((e) => e.name));
}

// The answer's edges as {name, from, to, channel, score, fromY, toY}, largest |score| first (unknown names left out).
export function rankEdges(result) {
  const out = [];
  for (const [name, value] of Object.entries(result.edges)) {
    const e = parseEdge(name);
    const a = e && nodePlace(e.from, result.layers, result.heads), b = e && nodePlace(e.to, result.layers, result.heads);
    if (a && b) out.push({ ...e, score: value.score, fromY: a.y, toY: b.y, place: [a, b] });
  }
  return out.sort((p, q) => Math.abs(q.score) - Math.abs(p.score));
}

// The figure's traces: the drawn edges as line segments grouped by (channel, sign, width band) into a few traces,
// a marker on each edge (60 % of the way up: what a click or hover finds), every node, and a legend of the styles.
export function graphTraces(result, drawn) {
  const top = Math.max(1e-12, ...drawn.map((e) => Math.abs(e.score)));
  const groups = new Map();
  for (const e of drawn) {
    const [a, b] = e.place;
    const band = WIDTHS.findIndex(([share]) => Math.abs(e.score) / top >= share);
    const key = `${e.channel}|${e.score < 0}|${band}`;
    if (!groups.has(key)) groups.set(key, { e, band, x: [], y: [] });
    const g = groups.get(key);
    g.x.push(a.x, b.x + END_DX[e.channel], null);
    g.y.push(a.y, b.y - 0.12, null);
  }
  const traces = [...groups.values()].map(({ e, band, x, y }) => ({
    type: "scatter", mode: "lines", x, y, hoverinfo: "skip", showlegend: false, meta: "edges",
    line: { color: e.score < 0 ? HELPS : HURTS, width: WIDTHS[band][1], dash: DASH[e.channel] }, opacity: 0.75,
  }));
  const at = (e, t) => {
    const [a, b] = e.place;
    return [a.x + t * (b.x + END_DX[e.channel] - a.x), a.y + t * (b.y - 0.12 - a.y)];
  };
  traces.push({
    type: "scatter", mode: "markers", meta: "picks", name: "edges", showlegend: false,
    x: drawn.map((e) => at(e, 0.6)[0]), y: drawn.map((e) => at(e, 0.6)[1]), customdata: drawn.map((e) => e.name),
    text: drawn.map((e) => `${e.name}<br>score ${fmt(e.score, 3)}`), hovertemplate: "%{text}<extra></extra>",
    marker: { size: 7, color: drawn.map((e) => (e.score < 0 ? HELPS : HURTS)), opacity: 0.8, symbol: drawn.map((e) => SYMBOL[e.channel]) },
  });
  const used = new Set(drawn.flatMap((e) => [e.from, e.to]));
  const nodes = result.nodes.map((n) => ({ n, p: nodePlace(n, result.layers, result.heads) })).filter((o) => o.p);
  traces.push({
    type: "scatter", mode: "markers", meta: "nodes", name: "nodes", showlegend: false,
    x: nodes.map((o) => o.p.x), y: nodes.map((o) => o.p.y), customdata: nodes.map((o) => o.n),
    hovertemplate: "%{customdata}<extra></extra>",
    marker: {
      size: nodes.map((o) => (o.p.head === null ? 11 : 8)), symbol: nodes.map((o) => (o.p.head === null ? "diamond" : "circle")),
      color: nodes.map((o) => (used.has(o.n) ? "#1d2230" : "#d0d5dd")), line: { width: 0 },
    },
  });
  // the legend: one entry per style, drawn with no data
  const legend = (name, line) => ({ type: "scatter", mode: "lines", x: [null], y: [null], name, line, meta: "legend", hoverinfo: "skip" });
  traces.push(legend("score < 0 (helps the answer)", { color: HELPS, width: 3 }), legend("score > 0", { color: HURTS, width: 3 }),
    legend("&lt;q&gt;", { color: "#667085", dash: "solid" }), legend("&lt;k&gt;", { color: "#667085", dash: "dash" }),
    legend("&lt;v&gt;", { color: "#667085", dash: "dot" }));
  return traces;
}
const SYMBOL = { q: "triangle-left", k: "circle", v: "triangle-right", "": "square" };

function graphLayout(result, title) {
  const L = result.layers;
  const ticks = [0, ...Array.from({ length: L }, (_, l) => 2 * l + 1), 2 * L + 1];
  const labels = ["input", ...Array.from({ length: L }, (_, l) => `L${l}`), "logits"];
  return {
    title: { text: title, font: { size: 13 } }, margin: { l: 52, r: 10, t: 36, b: 36 }, hovermode: "closest",
    xaxis: { tickvals: Array.from({ length: result.heads + 1 }, (_, h) => h),
      ticktext: [...Array.from({ length: result.heads }, (_, h) => `h${h}`), "MLP"], range: [-0.7, result.heads + 0.5],
      zeroline: false, showgrid: false },
    yaxis: { tickvals: ticks, ticktext: labels, tickfont: { size: 9 }, range: [-0.8, 2 * L + 1.8], zeroline: false,
      gridcolor: "#f2f4f7" },
    legend: { orientation: "h", y: -0.06, font: { size: 11 } },
  };
}

export function mountCircuit({ info, store, selectHead = () => {}, onError = () => {} }) {
  const panel = byId("circuit-panel");
  if (!panel) return { follow() {} };
  const isLM = () => info()?.output === "next_token";
  const follow = () => {
    panel.hidden = !isLM();
    if (view.result && view.result.model !== info()?.id) byId("circuit-results").classList.add("stale");
  };
  const view = { result: null, ranked: [], budgets: [], controller: null, inCircuit: new Set() };
  const task = byId("circuit-task");
  const followTask = () => {
    const own = task.value === "pairs";
    byId("circuit-pairs-box").hidden = !own;
    byId("circuit-n-box").hidden = own;
    byId("circuit-seed-box").hidden = own;
    byId("circuit-steps-box").hidden = byId("circuit-method").value !== "eap_ig";
  };
  task.addEventListener("change", followTask);
  byId("circuit-method").addEventListener("change", followTask);
  followTask();
  byId("circuit-run").addEventListener("click", () => score(view, info, onError));
  byId("circuit-stop").addEventListener("click", () => view.controller?.abort());
  byId("circuit-budget").addEventListener("input", () => redraw(view, { settle: true }));
  byId("circuit-budget").addEventListener("change", () => redraw(view));
  byId("circuit-json").addEventListener("click", () => exportJSON(view));
  view.onNode = (name) => openNode(name, selectHead);
  store?.subscribe(({ what }) => { if (what === "model") follow(); });
  if (info()) follow();
  return { follow };
}

// The request from the panel's boxes; throws naming the box.
export function circuitRequest(model) {
  const body = { model, method: byId("circuit-method").value, top: null };
  if (body.method === "eap_ig") body.ig_steps = Number(byId("circuit-steps").value);
  if (byId("circuit-task").value === "pairs") {
    body.pairs = parsePairLines(byId("circuit-pairs").value);
    body.pairs.forEach((p, i) => {
      if (!p.answer || !p.wrong) throw new Error(`line ${i + 1}: write "clean | corrupt | answer | wrong"`);
    });
  } else {
    body.task = { name: byId("circuit-task").value, n: Number(byId("circuit-n").value), seed: Number(byId("circuit-seed").value) };
  }
  return body;
}

async function score(view, info, onError) {
  const panel = byId("circuit-panel"), error = byId("circuit-error"), status = byId("circuit-status");
  const bar = byId("circuit-progress"), eta = byId("circuit-eta"), run = byId("circuit-run"), stop = byId("circuit-stop");
  let body;
  try {
    body = circuitRequest(info().id);
  } catch (err) {
    error.textContent = err.message;
    error.hidden = false;
    return;
  }
  view.controller?.abort();
  const mine = new AbortController();
  view.controller = mine;
  error.hidden = true;
  run.disabled = true;
  stop.disabled = false;
  bar.hidden = false;
  bar.value = 0;
  panel.dataset.state = "running";
  delete panel.dataset.progress;
  status.textContent = "starting…";
  const clock = jobClock((text) => { if (view.controller === mine) eta.textContent = text; });
  try {
    const done = await postJob("/api/text/circuit", body, { signal: mine.signal, onEvent: (event) => {
      clock.event(event);
      if (event.progress === undefined) return;
      bar.max = clock.total(event);
      bar.value = event.progress;
      status.textContent = `scoring: step ${event.progress} of ${bar.max}`;
      panel.dataset.progress = String(event.progress);
    } });
    clock.stop();
    await show(view, done, body);
    status.textContent = `${done.n_edges.toLocaleString("en")} edges scored over ${done.pairs} pair${done.pairs === 1 ? "" : "s"}`;
    panel.dataset.state = "done";
  } catch (err) {
    showJobFailure(err, { mine: view.controller === mine, panel, status, error, onError, what: "circuit" });
  } finally {
    clock.stop();
    if (view.controller === mine) {
      view.controller = null;
      run.disabled = false;
      stop.disabled = true;
      bar.hidden = true;
      eta.textContent = "";
    }
  }
}

// A new answer: the slider's stops are its budgets (0 left out: nothing to draw), starting at the answer's budget.
async function show(view, result, request) {
  view.result = result;
  view.request = request;
  view.ranked = rankEdges(result);
  view.budgets = result.faithfulness.map((f) => f.budget).filter((b) => b > 0).sort((a, b) => a - b);
  const slider = byId("circuit-budget");
  slider.max = String(Math.max(0, view.budgets.length - 1));
  const start = view.budgets.reduce((best, b, i) => (Math.abs(b - result.budget) < Math.abs(view.budgets[best] - result.budget) ? i : best), 0);
  slider.value = String(start);
  byId("circuit-results").hidden = false;
  byId("circuit-results").classList.remove("stale");
  byId("circuit-edge").hidden = true;
  await redraw(view);
}

// The graph and the curve at the slider's budget. settle: the slider is moving (the curve's marker waits).
async function redraw(view, { settle = false } = {}) {
  const result = view.result;
  if (!result) return;
  const budget = view.budgets[Number(byId("circuit-budget").value)] ?? result.budget;
  view.budget = budget;
  view.inCircuit = circuitAt(view.ranked, budget, result.n_edges);
  const kept = view.ranked.filter((e) => view.inCircuit.has(e.name));
  const drawn = kept.slice(0, MAX_DRAWN);
  const point = result.faithfulness.find((f) => f.budget === budget);
  const pct = (b) => `${Number((100 * b).toPrecision(3))} %`;
  byId("circuit-budget-text").textContent = `${pct(budget)} of ${result.n_edges.toLocaleString("en")} edges: `
    + `${kept.length.toLocaleString("en")} kept on paths from input to logits`
    + (kept.length > drawn.length ? `, the ${drawn.length} largest drawn` : "")
    + (point ? `; faithfulness ${fmt(point.value, 3)}` : "");
  const panel = byId("circuit-panel");
  panel.dataset.budget = String(budget);
  panel.dataset.kept = String(kept.length);
  panel.dataset.drawn = String(drawn.length);
  const P = await loadPlotly();
  const graph = byId("circuit-graph");
  const method = { eap: "EAP", eap_ig: "EAP-IG", exact: "exact" }[result.method] ?? result.method;
  await P.react(graph, graphTraces(result, drawn),
    graphLayout(result, `${result.model}: ${method} over ${result.pairs} pair${result.pairs === 1 ? "" : "s"}, the circuit at ${pct(budget)}`), CONFIG);
  if (!graph.dataset.bound) {
    graph.dataset.bound = "1";
    graph.on("plotly_click", (event) => {
      const pt = event.points?.[0];
      const meta = pt?.data?.meta ?? (pt?.customdata && parseEdge(pt.customdata) ? "picks" : "nodes");
      if (!pt?.customdata) return;
      if (meta === "picks") openEdge(view, pt.customdata);
      else if (meta === "nodes") view.onNode(pt.customdata);
    });
  }
  if (!settle) await drawCurve(P, result, budget);
  if (view.budget === budget) panel.dataset.shown = String(budget); // the figures show this budget (tests wait on it)
  fillList(byId("circuit-summary"), [
    ["m = logit(answer) − logit(wrong)", `clean ${fmt(result.metric.clean, 4)}, corrupt ${fmt(result.metric.corrupt, 4)}`],
    ["faithfulness at this budget", point ? `${fmt(point.value, 3)} (the server kept ${point.n_edges.toLocaleString("en")} edges)` : "–"],
    ["CPR (area under f)", fmt(result.cpr, 3)], ["CMD (area under |1 − f|)", fmt(result.cmd, 3)],
    ["edges listed", `${Object.keys(result.edges).length.toLocaleString("en")} of ${result.n_edges.toLocaleString("en")}`],
  ]);
}

async function drawCurve(P, result, budget) {
  const points = result.faithfulness.filter((f) => f.budget > 0);
  await P.react(byId("circuit-faith"), [{
    type: "scatter", mode: "lines+markers", x: points.map((f) => f.budget), y: points.map((f) => f.value),
    customdata: points.map((f) => f.n_edges), name: "f(budget)",
    hovertemplate: "budget %{x:.3%}: f = %{y:.3f}<br>%{customdata} edges kept<extra></extra>", line: { color: "#3b5bdb" },
  }], {
    title: { text: `faithfulness · CPR ${fmt(result.cpr, 3)}, CMD ${fmt(result.cmd, 3)}`, font: { size: 13 } },
    margin: { l: 50, r: 10, t: 34, b: 40 }, showlegend: false,
    xaxis: { type: "log", title: { text: "edge budget (fraction of edges; f = 0 with none)" },
      tickvals: [0.001, 0.01, 0.1, 1], ticktext: ["0.1 %", "1 %", "10 %", "100 %"] },
    yaxis: { title: { text: "f" }, zeroline: true,
      range: [Math.min(0, ...points.map((f) => f.value ?? 0)) - 0.05, Math.max(1, ...points.map((f) => f.value ?? 0)) + 0.05] },
    shapes: [
      { type: "line", xref: "paper", x0: 0, x1: 1, y0: 1, y1: 1, line: { color: "#98a2b3", dash: "dot", width: 1 } },
      { type: "line", x0: budget, x1: budget, yref: "paper", y0: 0, y1: 1, line: { color: "#f08c00", width: 2 } },
    ],
  }, CONFIG);
}

// A head: its map in the page's views (the head picker's selection), scrolled to; an MLP, the input or the logits
// have no map of their own.
function openNode(name, selectHead) {
  const place = nodePlace(name, 1e9, 1);
  const status = byId("circuit-status");
  if (!place || place.head === null) {
    status.textContent = `${name}: ${name.startsWith("m") ? "an MLP" : "the " + name} has no attention map; click a head`;
    return;
  }
  selectHead(place.layer, place.head);
  status.textContent = `${name}: layer ${place.layer}, head ${place.head} shown in the attention map`;
  byId("circuit-panel").dataset.opened = name;
  byId("map-area")?.scrollIntoView({ block: "start", behavior: "smooth" });
}

// An edge: its exact score on the first pair, and why (POST /api/text/circuit/edge).
async function openEdge(view, name) {
  const box = byId("circuit-edge"), status = byId("circuit-edge-status");
  const edge = view.ranked.find((e) => e.name === name) ?? { ...parseEdge(name), score: view.result.edges[name]?.score };
  const first = view.result.prompts?.[0] ?? {};
  const pair = { clean: first.clean, corrupt: first.corrupt, answer: first.answer, wrong: first.wrong }; // not its token count
  box.hidden = false;
  box.dataset.state = "running";
  box.dataset.edge = name;
  byId("circuit-edge-title").textContent = name;
  byId("circuit-edge-qk").hidden = true;
  byId("circuit-edge-writes-box").hidden = true;
  status.textContent = "scoring the edge exactly (two runs of the model)…";
  let r;
  try {
    r = await postJSON("/api/text/circuit/edge", { model: view.result.model, pair, edge: name }, { channel: "circuit-edge" });
  } catch (err) {
    if (err.name === "AbortError") return;
    box.dataset.state = "error";
    status.textContent = `edge: ${err.message}`;
    return;
  }
  byId("circuit-edge-title").textContent = r.edge ?? name;
  const method = view.result.method === "eap_ig" ? "EAP-IG" : "EAP";
  fillList(byId("circuit-edge-summary"), [
    [`${method} score (mean over ${view.result.pairs} pair${view.result.pairs === 1 ? "" : "s"})`, fmt(edge.score, 4)],
    ["exact score (first pair)", `${fmt(r.score, 4)} = m(edge from the corrupt run) − m(clean)`],
    ["m on the first pair", `clean ${fmt(r.metric.clean, 4)}, corrupt ${fmt(r.metric.corrupt, 4)}, edge patched ${fmt(r.metric.patched, 4)}`],
    ["in the circuit at this budget", view.inCircuit.has(name) ? "yes" : "no"],
    ["pair", `${pair.clean} → ${showToken(pair.answer)} (corrupt: ${pair.corrupt} → ${showToken(pair.wrong)})`],
  ]);
  const P = await loadPlotly();
  if (r.channel === "q" || r.channel === "k") await drawRow(P, r);
  else if (r.channel === "v") drawWrites(r);
  else P.purge(byId("circuit-edge-row"));
  byId("circuit-edge-row-box").hidden = !(r.channel === "q" || r.channel === "k");
  status.textContent = r.channel ? "" : "an edge into an MLP or the logits: its exact score only (no attention to show)";
  box.dataset.state = "done";
  box.dataset.score = String(r.score);
  box.scrollIntoView({ block: "nearest", behavior: "smooth" });
}

// A query or key edge: the receiving head's row at the query, with and without the edge, and its QK attribution at
// the key that moved most, the sender's part marked on the side the edge feeds.
async function drawRow(P, r) {
  const x = r.tokens.map((t, i) => `${i}:${visibleToken(t)}`);
  await P.react(byId("circuit-edge-row"), [
    { type: "bar", name: "clean", x, y: r.row_before, marker: { color: "#98a2b3" } },
    { type: "bar", name: "edge from the corrupt run", x, y: r.row_after, marker: { color: "#3b5bdb" } },
  ], {
    title: { text: `${r.receiver}'s row at query ${r.query} (${visibleToken(r.tokens[r.query] ?? "")}); moved most: key ${r.key}`,
      font: { size: 13 }, x: 0, xanchor: "left", xref: "paper" },
    barmode: "group", margin: { l: 45, r: 10, t: 40, b: 80 }, xaxis: { type: "category", tickangle: -45 },
    yaxis: { title: { text: "P[query, key]" }, range: [0, 1.02] },
    legend: { orientation: "h", x: 1, xanchor: "right", y: 1.02, yanchor: "bottom" },
  }, CONFIG);
  if (!r.qk) return;
  const place = nodePlace(r.receiver, 1e9, 1);
  const answer = { tokens: r.tokens, layer: place.layer, head: place.head, query: r.query, key: r.key, expanded: [], ...r.qk };
  const side = r.channel === "q" ? { queryBars: byId("circuit-qk-keys") } : { keyBars: byId("circuit-qk-keys") };
  byId("circuit-edge-qk").hidden = false;
  await drawQK(P, { title: byId("circuit-qk-title"), status: byId("circuit-qk-status"), matrixPlot: byId("circuit-qk-matrix"), ...side },
    answer, { mark: r.part ?? partName(r.sender), side: r.channel === "q" ? "query" : "key" });
  const share = r.part_share?.[r.channel === "q" ? "query" : "key"];
  byId("circuit-qk-status").append(` · ${r.part ?? partName(r.sender)} (this edge's sender, outlined) gives ${fmt(share, 4)} of the score on the ${r.channel === "q" ? "query" : "key"} side`);
  byId("circuit-edge").dataset.part = r.part ?? partName(r.sender);
}

// A value edge: what the receiving head writes, through the logit lens, with and without the edge.
function drawWrites(r) {
  const table = byId("circuit-edge-writes");
  const before = r.writes?.before ?? [], after = r.writes?.after ?? [];
  const head = el("tr", {}, ...["#", "writes (clean)", "logit", "edge from the corrupt run", "logit"].map((t) => el("th", { textContent: t })));
  const rows = before.map((b, i) => el("tr", {}, ...[String(i + 1), showToken(b.token), fmt(b.logit, 3),
    after[i] ? showToken(after[i].token) : "", after[i] ? fmt(after[i].logit, 3) : ""].map((t) => el("td", { textContent: t }))));
  table.replaceChildren(el("thead", {}, head), el("tbody", {}, ...rows));
  byId("circuit-edge-writes-title").textContent = `what ${r.receiver} writes at query ${r.query} `
    + `(${visibleToken(r.tokens?.[r.query] ?? "")}), through the unembedding: its top tokens with the edge and with it `
    + `read from the corrupt run`;
  table.hidden = false;
  byId("circuit-edge-writes-box").hidden = false;
}

// Every edge listed, in MIB's circuit form: {edges: {name: {score, in_graph}}, nodes: {name: {in_graph}}}, with what
// made it.
function exportJSON(view) {
  const result = view.result;
  if (!result) return;
  const edges = {}, nodes = Object.fromEntries(result.nodes.map((n) => [n, { in_graph: false }]));
  for (const e of view.ranked) {
    const kept = view.inCircuit.has(e.name);
    edges[e.name] = { score: e.score, in_graph: kept };
    if (kept) nodes[e.from].in_graph = nodes[e.to].in_graph = true;
  }
  const payload = {
    model: result.model, method: result.method, budget: view.budget, metric: result.metric, pairs: result.prompts,
    request: view.request, faithfulness: result.faithfulness, cpr: result.cpr, cmd: result.cmd, n_edges: result.n_edges,
    edges, nodes,
  };
  const name = `attnlab-circuit-${result.model}-${result.method}-${Number((100 * view.budget).toPrecision(3))}pct.json`;
  downloadBlob(new Blob([JSON.stringify(payload)], { type: "application/json" }), name);
}
