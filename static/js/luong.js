// The Luong-attention page: one date through a Luong model (the chosen score), its alignment, context vectors and
// output under β, masks and noise on the source states, their effect, and the Transformer's cross-attention per head
// for the same input.
import { getJSON, isAbort, postJSON, setStatus } from "./api.js";
import { byId as $, el, setOptions, showToken } from "./dom.js";

const config = JSON.parse(document.getElementById("page-config").textContent);
const PLOT_CONFIG = { displaylogo: false, responsive: true };
const NARROW = 520;
const WEIGHTS_SCALE = [[0, "#ffffff"], [0.25, "#c5d2f6"], [1, "#1c3fa8"]];  // 0 white: a masked column is blank

const state = {
  text: config.examples[0],
  score: "dot",
  beta: 1,
  mask: new Set(),
  sigma: 0,
  seed: 0,
  answer: null,
  models: null,
};

const fmt = (x, digits = 3) => Number(x).toPrecision(digits);

function report(err) {
  if (isAbort(err)) return;
  setStatus(err.message || String(err), { error: true });
}

// Plotly.react runs asynchronously: each figure's draws run in turn (a slider moved while one is drawn).
const drawing = new WeakMap();
function react(node, traces, layout) {
  const sized = { ...PLOT_CONFIG, displayModeBar: node.clientWidth >= NARROW ? "hover" : false };
  const next = (drawing.get(node) || Promise.resolve()).then(() => Plotly.react(node, traces, layout, sized)).catch(report);
  drawing.set(node, next);
  return next;
}

// ---------------------------------------------------------------------------------------------
// the request

function body() {
  const req = { score: state.score, text: state.text, beta: state.beta, mask: [...state.mask].sort((a, b) => a - b) };
  if (state.sigma > 0) req.perturb = { sigma: state.sigma, seed: state.seed, positions: null };
  return req;
}

let pending = 0;
async function refresh() {
  const ticket = ++pending;
  document.body.dataset.luongBusy = "1";
  try {
    const answer = await postJSON("/api/luong/attention", body(), { channel: "luong" });
    if (ticket !== pending) return;
    state.answer = answer;
    setStatus("");
    await draw(answer);
    // what is drawn, for tests and scripts to wait on: the request's ticket, score and masked positions
    Object.assign(document.body.dataset, { luongDrawn: String(ticket), luongScore: answer.score, luongMask: answer.mask.join(",") });
  } catch (err) {
    report(err);
  } finally {
    if (ticket === pending) delete document.body.dataset.luongBusy;
  }
}

// ---------------------------------------------------------------------------------------------
// drawing

const sourceLabels = (a) => a.source_tokens.map((c, s) => `${s}:${showToken(c)}`);

function heatmap(z, a, rows, { colorscale = WEIGHTS_SCALE, zmax = 1, showscale = true, xaxis = "x", yaxis = "y" } = {}) {
  const S = a.source_tokens.length;
  return {
    type: "heatmap", z, x: [...Array(S).keys()], y: [...Array(z.length).keys()], xaxis, yaxis,
    zmin: 0, zmax, colorscale, showscale, xgap: 1, ygap: 1,
    customdata: z.map((row, t) => row.map((_, s) => [rows[t], showToken(a.source_tokens[s])])),
    hovertemplate: "step %{y} (%{customdata[0]}) → source %{x} “%{customdata[1]}”: %{z:.4f}<extra></extra>",
  };
}

function axes(a, rows) {
  const S = a.source_tokens.length;
  return {
    x: { tickvals: [...Array(S).keys()], ticktext: a.source_tokens.map((c, s) => (state.mask.has(s) ? `✕${showToken(c)}` : showToken(c))),
      tickangle: 0, tickfont: { family: "ui-monospace, monospace", size: 11 }, title: { text: "source character", standoff: 4 } },
    y: { tickvals: rows.map((_, t) => t), ticktext: rows, autorange: "reversed",
      tickfont: { family: "ui-monospace, monospace", size: 11 }, title: { text: "decoder step", standoff: 4 } },
  };
}

function stepLabels(output) {
  return output.tokens.map((tok, t) => `${tok} ${fmt(output.probs[t], 2)}`);
}

function drawAlignment(a) {
  const rows = stepLabels(a.output);
  const ax = axes(a, rows);
  const layout = { margin: { l: 70, r: 10, t: 10, b: 46 }, height: 70 + 22 * rows.length, xaxis: ax.x, yaxis: ax.y };
  return react($("luong-alignment"), [heatmap(a.alignment, a, rows)], layout);
}

function drawContext(a) {
  const rows = a.output.tokens.map((tok, t) => `${t}:${tok}`);
  const H = a.context[0].length;
  const zmax = Math.max(...a.context.flat().map(Math.abs));
  const traces = [
    { type: "heatmap", z: a.context, x: [...Array(H).keys()], y: rows.map((_, t) => t), zmin: -zmax, zmax,
      colorscale: "RdBu", reversescale: true, showscale: false, xaxis: "x", yaxis: "y",
      hovertemplate: "step %{y}, unit %{x}: %{z:.3f}<extra>c_t</extra>" },
    { type: "bar", orientation: "h", x: a.context_norms, y: rows.map((_, t) => t), xaxis: "x2", yaxis: "y",
      marker: { color: "#3b5bdb" }, hovertemplate: "‖c_%{y}‖ = %{x:.3f}<extra></extra>" },
  ];
  const layout = {
    margin: { l: 70, r: 10, t: 20, b: 30 }, height: 60 + 14 * rows.length, showlegend: false,
    xaxis: { domain: [0, 0.78], title: { text: "c_t (units of H)", standoff: 2 }, showticklabels: false },
    xaxis2: { domain: [0.82, 1], title: { text: "‖c_t‖", standoff: 2 } },
    yaxis: { tickvals: rows.map((_, t) => t), ticktext: rows, autorange: "reversed", tickfont: { size: 10 } },
  };
  return react($("luong-context"), traces, layout);
}

function drawTransformer(a) {
  const tr = a.transformer;
  const rows = stepLabels(tr.output);
  const L = tr.layers, Hh = tr.heads;
  const traces = [];
  const layout = { margin: { l: 70, r: 10, t: 24, b: 40 }, height: L * (50 + 18 * rows.length) + 20, annotations: [] };
  const gap = 0.04, w = (1 - gap * (Hh - 1)) / Hh, hgt = (1 - 0.08 * (L - 1)) / L;
  const S = a.source_tokens.length;
  for (let l = 0; l < L; l++) {
    for (let h = 0; h < Hh; h++) {
      const i = l * Hh + h + 1, sx = i === 1 ? "" : String(i);
      traces.push(heatmap(tr.cross_attention[l][h], a, rows, { showscale: false, xaxis: `x${sx}`, yaxis: `y${sx}` }));
      const x0 = h * (w + gap), y1 = 1 - l * (hgt + 0.08);
      layout[`xaxis${sx}`] = { domain: [x0, x0 + w], anchor: `y${sx}`, tickvals: [...Array(S).keys()],
        ticktext: a.source_tokens.map(showToken), tickangle: 0, tickfont: { size: 7, family: "ui-monospace, monospace" } };
      layout[`yaxis${sx}`] = { domain: [y1 - hgt, y1], anchor: `x${sx}`, autorange: "reversed", tickvals: rows.map((_, t) => t),
        ticktext: h === 0 ? rows : rows.map(() => ""), tickfont: { size: 10, family: "ui-monospace, monospace" } };
      const narrow = $("transformer-heads").clientWidth < 700;  // four long titles would run into each other
      layout.annotations.push({ text: narrow ? `L${l} H${h}` : `layer ${l} head ${h}`, xref: "paper", yref: "paper", x: x0 + w / 2, y: y1,
        yanchor: "bottom", showarrow: false, font: { size: 11 } });
    }
  }
  $("transformer-title").textContent = `${L} layer${L > 1 ? "s" : ""} × ${Hh} heads · held-out exact match ${(100 * tr.heldout_exact_match).toFixed(1)} %`;
  return react($("transformer-heads"), traces, layout);
}

function outputChips(node, output, baseline = null) {
  node.replaceChildren(...output.tokens.map((tok, t) => {
    const changed = baseline && baseline.tokens[t] !== tok;
    return el("span", { className: `out${changed ? " changed" : ""}`, title: `step ${t}: p = ${output.probs[t]}` },
      el("b", { textContent: tok }), el("small", { textContent: fmt(output.probs[t], 3) }));
  }));
}

function drawSource(a) {
  const noisy = state.sigma > 0;
  $("luong-source").replaceChildren(...a.source_tokens.map((c, s) => {
    const b = el("button", {
      type: "button", className: `tok${state.mask.has(s) ? " masked" : ""}${noisy ? " noisy" : ""}`,
      textContent: showToken(c), title: `source ${s}: click to ${state.mask.has(s) ? "unmask" : "mask"}`,
    });
    b.dataset.pos = String(s);
    b.addEventListener("click", () => toggleMask(s));
    return b;
  }));
}

function drawEffect(a) {
  const e = a.effect;
  const node = $("luong-effect");
  const plot = $("luong-effect-plot");
  plot.hidden = !e;
  if (!e) {
    node.textContent = "No intervention: β = 1, nothing masked, no noise.";
    return Promise.resolve();
  }
  const parts = [];
  if (a.beta !== 1) parts.push(`β = ${fmt(a.beta)}`);
  if (a.mask.length) parts.push(`masked ${a.mask.map((s) => `${s}:${showToken(a.source_tokens[s])}`).join(" ")}`);
  if (a.perturb && a.perturb.sigma > 0) parts.push(`noise σ = ${fmt(a.perturb.sigma)} (seed ${a.perturb.seed}) on h̄_s`);
  node.textContent = `${parts.join(" · ")}\nplain: ${e.baseline.output.text}  →  intervened: ${a.output.text}` +
    `  (${e.changed ? "the output changed" : "the output is the same"}) · mean KL ${fmt(e.kl_mean)} nats`;
  const steps = e.baseline.output.tokens.map((tok, t) => `${t}:${tok}`);
  const traces = [
    { type: "bar", name: "p(plain char), plain", x: steps, y: e.baseline.output.probs, marker: { color: "#adb5bd" } },
    { type: "bar", name: "p(plain char), intervened", x: steps, y: e.prob_of_baseline_token, marker: { color: "#3b5bdb" } },
    { type: "scatter", mode: "lines+markers", name: "KL per step", x: steps, y: e.kl, yaxis: "y2", line: { color: "#c0342b" } },
  ];
  const layout = { margin: { l: 46, r: 46, t: 10, b: 40 }, height: 220, barmode: "group",
    yaxis: { range: [0, 1.02], title: { text: "probability" } },
    yaxis2: { overlaying: "y", side: "right", title: { text: "KL (nats)" }, rangemode: "tozero" },
    legend: { orientation: "h", y: -0.25 } };
  return react(plot, traces, layout);
}

async function draw(a) {
  const info = state.models && state.models.models.find((m) => m.name === a.score);
  $("luong-title").textContent = `${a.score} score · held-out exact match ${(100 * a.heldout_exact_match).toFixed(1)} %` +
    (info ? ` · ${info.parameters.toLocaleString("en")} parameters` : "");
  drawSource(a);
  outputChips($("luong-output"), a.output, a.effect ? a.effect.baseline.output : null);
  outputChips($("transformer-output"), a.transformer.output);
  await Promise.all([drawAlignment(a), drawContext(a), drawTransformer(a), drawEffect(a)]);
}

// ---------------------------------------------------------------------------------------------
// controls

function toggleMask(s) {
  if (state.mask.has(s)) state.mask.delete(s);
  else state.mask.add(s);
  refresh();
}

function showSliders() {
  $("luong-beta-readout").textContent = `β = ${fmt(state.beta)}`;
  $("luong-sigma-readout").textContent = `σ = ${fmt(state.sigma, 2)}`;
}

function wire() {
  const text = $("luong-text");
  text.value = state.text;
  $("luong-examples").replaceChildren(...config.examples.map((x) => el("option", { value: x })));
  setOptions($("luong-score"), config.scores.map((s) => [s, s]), state.score);
  text.addEventListener("change", () => {
    state.text = text.value;
    state.mask.clear();
    refresh();
  });
  $("luong-score").addEventListener("change", (ev) => { state.score = ev.target.value; refresh(); });
  $("luong-beta").addEventListener("input", (ev) => { state.beta = Number((10 ** Number(ev.target.value)).toPrecision(4)); showSliders(); refresh(); });
  $("luong-sigma").addEventListener("input", (ev) => { state.sigma = Number(ev.target.value); showSliders(); refresh(); });
  $("luong-seed").addEventListener("change", (ev) => { state.seed = Math.max(0, Math.floor(Number(ev.target.value) || 0)); refresh(); });
  $("luong-reset").addEventListener("click", () => {
    state.beta = 1; state.sigma = 0; state.mask.clear();
    $("luong-beta").value = "0"; $("luong-sigma").value = "0";
    showSliders();
    refresh();
  });
  showSliders();
}

async function start() {
  wire();
  try {
    state.models = await getJSON("/api/luong/models");
    const acc = state.models.models.map((m) => `${m.name} ${(100 * m.heldout_exact_match).toFixed(1)} %`).join(" · ");
    $("luong-accuracy").textContent = `held-out exact match (${state.models.split.heldout} dates not seen in training): ${acc}` +
      ` · always answering the commonest training date: ${(100 * state.models.majority_baseline).toFixed(1)} %` +
      ` · all five trained here in ${state.models.train_s_total} s`;
  } catch (err) {
    report(err);
    return;
  }
  await refresh();
}

start();
