// The text page: sentence → every layer and head, β slider, key masks, effects.
import { getJSON, isAbort, postJSON, setStatus } from "./api.js";
import { decodeTensor, entropy, fmt, softmaxMatrix } from "./mathx.js";
import { drawEffect } from "./views/effects.js";
import { drawHeadView } from "./views/headview.js";
import { drawHeatmap } from "./views/heatmap.js";
import { drawModelView } from "./views/modelview.js";

const config = JSON.parse(document.getElementById("page-config").textContent);
const $ = (id) => document.getElementById(id);
const THUMB = 24;

// The page state; `view` holds what the server last returned for the selected head.
const state = {
  model: config.model,
  info: null, // ModelInfo of the selected model
  layer: 0,
  head: 0,
  logBetaRatio: 0, // slider value: log10(β / β₀)
  scope: "head",
  mode: "run",
  masked: new Set(), // key tokens masked (mask_keys)
  view: null, // {tokens, attention (T×T), scores (T×T), entropy, effect, warnings}
  thumbs: null,
};

const beta = () => state.info.native_beta * 10 ** state.logBetaRatio;
const betaIsNative = () => Math.abs(state.logBetaRatio) < 1e-9;

function scopeFields() {
  if (state.scope === "all") return { layers: null, heads: null };
  if (state.scope === "layer") return { layers: [state.layer], heads: null };
  return { layers: [state.layer], heads: [state.head] };
}

// Interventions the server should apply (view-mode β is done in the browser instead).
function interventions() {
  const list = [];
  if (!betaIsNative() && state.mode === "run") list.push({ op: "temperature", beta: beta(), ...scopeFields() });
  if (state.masked.size) list.push({ op: "mask_keys", tokens: [...state.masked].sort((a, b) => a - b), ...scopeFields() });
  return list;
}

function request({ thumbnails = false } = {}) {
  const ivs = interventions();
  const pair = $("pair-input").value.trim();
  return {
    model: state.model,
    text: $("text-input").value,
    text_pair: pair ? pair : null,
    layers: [state.layer],
    heads: [state.head],
    include_scores: true,
    interventions: ivs,
    compare: ivs.length > 0,
    thumbnail_size: thumbnails ? THUMB : null,
  };
}

async function load({ thumbnails = true } = {}) {
  const started = performance.now();
  setStatus("running…");
  try {
    const r = await postJSON("/api/text/attention", request({ thumbnails }), { channel: "text" });
    state.view = {
      tokens: r.tokens,
      attention: decodeTensor(r.attention)[0][0],
      scores: decodeTensor(r.scores)[0][0],
      entropy: r.entropy,
      effect: r.effect,
      warnings: r.warnings,
      truncated: r.truncated,
      response: r,
    };
    if (r.thumbnails) state.thumbs = decodeTensor(r.thumbnails);
    render();
    setStatus(`${r.tokens.length} tokens${r.truncated ? " (truncated)" : ""} · ${Math.round(performance.now() - started)} ms`);
  } catch (err) {
    if (!isAbort(err)) setStatus(err.message, { error: true });
  }
}

// The shown head's attention: from the server, or re-normalised here in view mode (SPEC §2).
function shownAttention() {
  const v = state.view;
  if (state.mode === "view" && !betaIsNative()) {
    const masked = v.tokens.map((_, j) => state.masked.has(j));
    return softmaxMatrix(v.scores, beta(), masked);
  }
  return v.attention;
}

function render() {
  renderHead();
  renderTokens();
  if (state.thumbs) {
    drawModelView($("modelview"), state.thumbs, {
      layer: state.layer, head: state.head, entropy: state.view.entropy, onSelect: selectHead,
    });
  }
  drawEffect({ outputEl: $("output-effect"), hiddenEl: $("hidden-cosine-plot"), tvEl: $("tv-plot"), warningsEl: $("warnings") },
    state.view.response);
  renderInterventionList();
}

// Everything that depends on the shown head only: cheap, redrawn on every slider move.
function renderHead() {
  const v = state.view;
  const P = shownAttention();
  const label = `layer ${state.layer}, head ${state.head} · β = ${fmt(beta())}`;
  $("heatmap-title").textContent = label;
  drawHeatmap($("heatmap"), P, v.tokens, { zmax: 1 });
  drawHeadView($("headview"), P, v.tokens, { masked: state.masked, onToggleKey: toggleMask });
  const rowEntropy = P.map(entropy);
  Plotly.react($("entropy-plot"), [
    { type: "bar", x: v.tokens.map((t, i) => `${i}:${t}`), y: rowEntropy, name: "row entropy", marker: { color: "#3b5bdb" } },
    { type: "scatter", mode: "lines", x: [`0:${v.tokens[0]}`, `${v.tokens.length - 1}:${v.tokens.at(-1)}`],
      y: [Math.log(v.tokens.length), Math.log(v.tokens.length)], name: "log n (uniform)", line: { dash: "dot", color: "#999" } },
  ], {
    margin: { l: 40, r: 10, t: 10, b: 60 }, showlegend: true, legend: { orientation: "h", y: 1.12 },
    xaxis: { type: "category", tickangle: -60, showticklabels: v.tokens.length <= 40 }, yaxis: { title: { text: "nats" }, rangemode: "tozero" },
  }, { responsive: true, displaylogo: false });
}

function renderTokens() {
  const strip = $("token-strip");
  strip.replaceChildren(...state.view.tokens.map((tok, i) => {
    const el = document.createElement("span");
    el.className = "tok" + (state.masked.has(i) ? " masked" : "");
    el.textContent = tok;
    el.title = `token ${i}: click to ${state.masked.has(i) ? "unmask" : "mask"} as a key`;
    el.dataset.index = i;
    el.addEventListener("click", () => toggleMask(i));
    return el;
  }));
}

function renderInterventionList() {
  const ivs = interventions();
  if (state.mode === "view" && !betaIsNative()) ivs.unshift({ op: "temperature (view only)", beta: beta() });
  $("interventions-list").textContent = ivs.length
    ? "Active: " + ivs.map((iv) => JSON.stringify(iv)).join("  ·  ")
    : "Active: none";
}

function renderBetaReadout() {
  const b = beta();
  $("beta-readout").textContent = `β = ${fmt(b)}  T = ${fmt(1 / b)}  (β₀ = ${fmt(state.info.native_beta)})`;
}

// ---- interactions ----------------------------------------------------------------------------------
function selectHead(layer, head) {
  state.layer = Math.max(0, Math.min(state.info.layers - 1, layer));
  state.head = Math.max(0, Math.min(state.info.heads - 1, head));
  $("layer-select").value = state.layer;
  $("head-select").value = state.head;
  // Scoped interventions follow the selection, so they must re-run; otherwise the cache answers fast.
  load({ thumbnails: interventions().length > 0 && state.scope !== "all" });
}

function toggleMask(index) {
  if (state.masked.has(index)) state.masked.delete(index);
  else state.masked.add(index);
  load();
}

let betaFrame = null;
function onBetaInput() {
  state.logBetaRatio = Number($("beta-slider").value);
  renderBetaReadout();
  if (state.mode === "view") {
    // Coalesce slider events into one redraw per animation frame.
    if (betaFrame === null) betaFrame = requestAnimationFrame(() => { betaFrame = null; renderHead(); renderInterventionList(); });
  } else {
    load(); // stale requests are aborted by the client
  }
}

function fillSelect(select, n, prefix) {
  select.replaceChildren(...Array.from({ length: n }, (_, i) => new Option(`${prefix} ${i}`, i)));
}

async function init() {
  const { models } = await getJSON("/api/models");
  const textModels = models.filter((m) => m.kind === "text");
  $("model-select").replaceChildren(...textModels.map((m) => new Option(`${m.id} (${m.layers}×${m.heads}, ${m.output})`, m.id)));
  $("model-select").value = state.model;
  const chooseModel = () => {
    state.info = textModels.find((m) => m.id === state.model);
    fillSelect($("layer-select"), state.info.layers, "layer");
    fillSelect($("head-select"), state.info.heads, "head");
    state.layer = Math.min(state.layer, state.info.layers - 1);
    state.head = Math.min(state.head, state.info.heads - 1);
    $("layer-select").value = state.layer;
    $("head-select").value = state.head;
    renderBetaReadout();
  };
  chooseModel();

  $("model-select").addEventListener("change", () => { state.model = $("model-select").value; state.masked.clear(); chooseModel(); load(); });
  $("run-button").addEventListener("click", () => { state.masked.clear(); load(); });
  $("text-input").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { state.masked.clear(); load(); } });
  $("layer-select").addEventListener("change", () => selectHead(Number($("layer-select").value), state.head));
  $("head-select").addEventListener("change", () => selectHead(state.layer, Number($("head-select").value)));
  $("beta-slider").addEventListener("input", onBetaInput);
  $("beta-reset").addEventListener("click", () => { $("beta-slider").value = 0; onBetaInput(); });
  $("scope-select").addEventListener("change", () => { state.scope = $("scope-select").value; load(); });
  $("mode-select").addEventListener("change", () => { state.mode = $("mode-select").value; load(); });
  document.addEventListener("keydown", (e) => {
    if (["INPUT", "TEXTAREA", "SELECT"].includes(document.activeElement?.tagName)) return;
    const moves = { ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0] };
    if (!moves[e.key]) return;
    e.preventDefault();
    selectHead(state.layer + moves[e.key][0], state.head + moves[e.key][1]);
  });
  await load();
}

init().catch((err) => setStatus(`failed to start: ${err.message}`, { error: true }));
