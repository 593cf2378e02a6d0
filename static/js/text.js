// The text page: sentence → every layer and head, β slider, masks, ablation, perturbations, effects,
// head summaries, the softmax panel, export and a shareable URL (the laboratory, SPEC §2–6).
import { getJSON, isAbort, postJSON, setStatus } from "./api.js";
import { decodedFields, decodeTensor, entropy, fmt, maxAbs, softmaxRow } from "./mathx.js";
import { drawEffect } from "./views/effects.js";
import { drawHeadView } from "./views/headview.js";
import { drawHeatmap, paintHeatmap, paintPreview, tokenLabels } from "./views/heatmap.js";
import { drawModelView } from "./views/modelview.js";
import { downloadJSON, downloadPNG, installPngButtons } from "./lab/export.js";
import { betaIsNative as labBetaIsNative, betaOf, buildInterventions, createLab, renderActiveList, wire } from "./lab/interventions.js";
import { mountMaskPanel } from "./lab/masks.js";
import { mountPerturbPanel } from "./lab/perturb.js";
import { mountSoftmaxPanel } from "./lab/softmax.js";
import { drawSummaries } from "./lab/summaries.js";
import { intParam, labToParams, paramsToLab, readHash, writeHash } from "./lab/urlstate.js";
import { loadPlotly } from "./vendor.js";

const config = JSON.parse(document.getElementById("page-config").textContent);
const $ = (id) => document.getElementById(id);
const THUMB = 24;
const PLOT = { responsive: true, displaylogo: false };
// While a slider moves, only the heatmap's cells follow it; every other panel (and Plotly's own
// drawing of the heatmap) catches up once no move came for this long.
const SETTLE_MS = 150;

// The page state: the selection, the laboratory's interventions (lab), and what the server returned.
const lab = createLab();
const state = {
  model: config.model,
  info: null, // ModelInfo of the selected model
  layer: 0,
  head: 0,
  query: 0, // query row shown in the softmax panel
  view: null, // {tokens, attention (T×T), scores (T×T), base (T×T, without interventions), response, request}
  thumbs: null,
};

const ctx = () => ({ layer: state.layer, head: state.head, nativeBeta: state.info.native_beta });
const beta = () => betaOf(lab, state.info.native_beta);
const betaIsNative = () => labBetaIsNative(lab);
const interventions = () => buildInterventions(lab, ctx());
const samples = () => (lab.perturb.on ? lab.perturb.samples : 1);

// partial: while a slider drags, ask only for what the heatmap needs (no effects, no thumbnails); the
// full request follows once input settles, and finds the model run in the server's cache.
function request({ thumbnails = false, partial = false } = {}) {
  const ivs = wire(interventions());
  const compare = ivs.length > 0 && !partial;
  const pair = $("pair-input").value.trim();
  return {
    model: state.model,
    text: $("text-input").value,
    text_pair: pair ? pair : null,
    layers: [state.layer],
    heads: [state.head],
    include_scores: true,
    interventions: ivs,
    compare,
    include_base: compare, // P without interventions, for P̂ − P, in the same response
    samples: compare ? samples() : 1,
    thumbnail_size: thumbnails && !partial ? THUMB : null,
    encoding: "f32", // exact, and decoded without parsing a number per cell
  };
}

let loadSeq = 0;
// settle > 0: the load follows a slider; only the heatmap's cells are repainted until input settles.
async function load({ thumbnails = true, settle = 0 } = {}) {
  const started = performance.now();
  const seq = ++loadSeq;
  setStatus("running…");
  try {
    const partial = settle > 0;
    const body = request({ thumbnails, partial });
    const r = await postJSON("/api/text/attention", body, { channel: "text" });
    if (seq !== loadSeq) return; // a newer load started meanwhile
    const attention = decodeTensor(r.attention)[0][0];
    state.view = {
      tokens: r.tokens, attention, scores: decodeTensor(r.scores)[0][0],
      base: r.base_attention ? decodeTensor(r.base_attention)[0][0] : attention, response: r, request: body,
    };
    if (r.thumbnails) state.thumbs = decodeTensor(r.thumbnails);
    state.query = Math.min(state.query, r.tokens.length - 1);
    showHead({ settle, onSettle: partial ? () => load({ thumbnails }) : null });
    setStatus(`${r.tokens.length} tokens${r.truncated ? " (truncated)" : ""} · ${Math.round(performance.now() - started)} ms`);
  } catch (err) {
    if (!isAbort(err)) setStatus(err.message, { error: true });
  }
}

// Which keys the browser masks for query row i when it re-normalises in view mode.
function maskedRow(i, n) {
  return Array.from({ length: n }, (_, j) => lab.masks.tokens.has(j) || (lab.causal.on && j > i));
}

// The shown head's attention: from the server, or re-normalised here in view mode (SPEC §2).
function shownAttention() {
  const v = state.view;
  if (lab.beta.mode === "view" && !betaIsNative()) {
    return v.scores.map((row, i) => softmaxRow(row, beta(), maskedRow(i, row.length)));
  }
  return v.attention;
}

// Draw the shown head: the heatmap at once, everything else after the first paint (a new view) or
// once input settles (a slider). With settle > 0 the heatmap's cells are repainted without Plotly.
let settleTimer = null;
// onSettle: what to do once input settles instead of drawing the details (a partial load: the full load).
function showHead({ settle = 0, onSettle = null } = {}) {
  const v = state.view;
  const P = shownAttention();
  const el = $("heatmap");
  $("heatmap-title").textContent = `layer ${state.layer}, head ${state.head} · β = ${fmt(beta())}`;
  clearTimeout(settleTimer);
  if (!window.Plotly) { // the first view: paint the cells now, build the figure once plotly.js is in
    paintPreview(el, P, "loading the interactive figure…");
    heatmapShown("attnlab:first-heatmap", { preview: true });
    loadPlotly().then(() => { if (state.view === v) showHead(); })
      .catch((err) => setStatus(`${err.message}: figures cannot be drawn`, { error: true }));
    return;
  }
  const painted = settle > 0 && paintHeatmap(el, P, v.tokens);
  if (!painted) {
    drawHeatmap(el, P, v.tokens, { zmax: colourMax(P) });
    wireHeatmapClicks();
  }
  heatmapShown(painted ? null : "attnlab:heatmap-figure", { painted });
  const details = () => {
    settleTimer = null;
    if (state.view !== v) return;
    if (onSettle) return onSettle();
    if (painted) { const settled = shownAttention(); drawHeatmap(el, settled, v.tokens, { zmax: colourMax(settled) }); }
    renderDetails();
  };
  // A new view: let the browser paint the heatmap first (a frame), then build the other panels.
  if (settle > 0) settleTimer = setTimeout(details, settle);
  else requestAnimationFrame(() => { settleTimer = setTimeout(details, 0); });
}

// The top of the heatmap's colour scale: 1, or this map's largest value (long inputs spread attention thin:
// at 512 tokens a 0–1 scale shows an almost uniform dark square).
function colourMax(P) {
  return $("zscale").value === "fixed" ? 1 : Math.max(1e-6, maxAbs(P));
}

// Benchmarks time these: an "attnlab:heatmap" event on #heatmap after every repaint of the shown head,
// and a performance mark the first time each kind of drawing happens (first paint, first Plotly figure).
const marked = new Set();
function heatmapShown(mark, detail) {
  if (mark && !marked.has(mark)) { marked.add(mark); performance.mark(mark); }
  $("heatmap").dispatchEvent(new CustomEvent("attnlab:heatmap", { detail }));
}

let clicksWired = false;
function wireHeatmapClicks() {
  if (clicksWired || !$("heatmap").on) return;
  clicksWired = true;
  $("heatmap").on("plotly_click", (ev) => {
    const pt = ev.points?.[0];
    if (pt) selectQuery(pt.pointIndex?.[0] ?? tokenLabels(state.view.tokens).indexOf(pt.y));
  });
}

// Everything besides the heatmap.
function renderDetails() {
  renderTokens();
  masksPanel.update();
  perturbPanel.setTokens(state.view.tokens);
  if (state.thumbs) {
    drawModelView($("modelview"), state.thumbs, {
      layer: state.layer, head: state.head, entropy: state.view.response.entropy, onSelect: selectHead,
    });
  }
  drawEffect({ outputEl: $("output-effect"), hiddenEl: $("hidden-cosine-plot"), tvEl: $("tv-plot"), warningsEl: $("warnings") },
    state.view.response);
  renderSummaries();
  renderHeadDetails(shownAttention());
  renderInterventionList();
  writeUrl();
}

function renderSummaries() {
  const r = state.view.response;
  drawSummaries({ entropyEl: $("summary-entropy"), distanceEl: $("summary-distance"), tableEl: $("summary-table") }, {
    entropy: r.entropy, distance: r.mean_distance ?? null, distanceUnit: "tokens",
    layer: state.layer, head: state.head, onSelect: selectHead,
  });
}

// The panels that depend on the shown head's P: head view, row entropy, P̂ − P, softmax panel.
function renderHeadDetails(P) {
  const v = state.view;
  drawHeadView($("headview"), P, v.tokens, { masked: lab.masks.tokens, onToggleKey: toggleMask });
  const rowEntropy = P.map(entropy);
  const labels = tokenLabels(v.tokens);
  Plotly.react($("entropy-plot"), [
    { type: "bar", x: labels, y: rowEntropy, name: "row entropy", marker: { color: "#3b5bdb" } },
    { type: "scatter", mode: "lines", x: [labels[0], labels.at(-1)],
      y: [Math.log(v.tokens.length), Math.log(v.tokens.length)], name: "log n (uniform)", line: { dash: "dot", color: "#999" } },
  ], {
    margin: { l: 40, r: 10, t: 10, b: 60 }, showlegend: true, legend: { orientation: "h", y: 1.12 },
    xaxis: { type: "category", tickangle: -60, showticklabels: v.tokens.length <= 40 }, yaxis: { title: { text: "nats" }, rangemode: "tozero" },
  }, PLOT);
  renderDiff(P);
  renderEffectSummary(P);
  softmaxPanel.update({
    tokens: v.tokens, scores: v.scores, beta: beta(), query: state.query,
    masked: maskedRow(state.query, v.tokens.length),
  });
}

// P̂ − P at the selected head (SPEC §4): after the interventions minus the same input without them.
function renderDiff(P) {
  const v = state.view;
  const active = v.request.interventions.length > 0 || (lab.beta.mode === "view" && !betaIsNative());
  if (!active) {
    $("diff-heatmap").dataset.maxAbs = "0";
    Plotly.react($("diff-heatmap"), [], {
      title: { text: `P̂ − P at layer ${state.layer}, head ${state.head}`, font: { size: 13 } },
      margin: { l: 40, r: 10, t: 30, b: 30 }, xaxis: { visible: false }, yaxis: { visible: false },
      annotations: [{ text: "no interventions active: P̂ = P", showarrow: false, font: { color: "#667085" } }],
    }, PLOT);
    return;
  }
  const diff = P.map((row, i) => row.map((p, j) => p - v.base[i][j]));
  const maxAbsDiff = maxAbs(diff, 1e-9);
  const labels = tokenLabels(v.tokens);
  const dense = v.tokens.length > 40;
  $("diff-heatmap").dataset.maxAbs = String(maxAbsDiff === 1e-9 ? 0 : maxAbsDiff);
  if ($("diff-kind").value === "ratio") {
    // P̂ / P where P > 1e-6 (else blank); log scale colours: 1 = unchanged.
    const ratio = P.map((row, i) => row.map((p, j) => (v.base[i][j] > 1e-6 ? p / v.base[i][j] : null)));
    const logs = ratio.flat().filter((x) => x !== null && x > 0).map((x) => Math.abs(Math.log10(x)));
    const span = maxAbs(logs, 1e-6);
    Plotly.react($("diff-heatmap"), [{
      type: "heatmap", z: ratio.map((row) => row.map((x) => (x === null || x <= 0 ? null : Math.log10(x)))), x: labels, y: labels,
      customdata: ratio, colorscale: "RdBu", reversescale: true, zmid: 0, zmin: -span, zmax: span,
      hovertemplate: "query %{y}<br>key %{x}<br>P̂ / P = %{customdata:.5f}<extra></extra>",
      colorbar: { thickness: 12, title: { text: "log₁₀" } },
    }], {
      title: { text: `P̂ / P at layer ${state.layer}, head ${state.head} (log₁₀ colour; blank where P ≈ 0)`, font: { size: 13 } },
      margin: { l: dense ? 40 : 90, r: 10, t: 30, b: dense ? 40 : 90 },
      xaxis: { title: { text: "key" }, tickangle: -60, type: "category", showticklabels: !dense },
      yaxis: { title: { text: "query" }, autorange: "reversed", type: "category", showticklabels: !dense },
    }, PLOT);
    return;
  }
  Plotly.react($("diff-heatmap"), [{
    type: "heatmap", z: diff, x: labels, y: labels, colorscale: "RdBu", reversescale: true, zmid: 0, zmin: -maxAbsDiff, zmax: maxAbsDiff,
    hovertemplate: "query %{y}<br>key %{x}<br>P̂ − P = %{z:.5f}<extra></extra>", colorbar: { thickness: 12 },
  }], {
    title: { text: `P̂ − P at layer ${state.layer}, head ${state.head}  (max |Δ| = ${fmt(maxAbsDiff === 1e-9 ? 0 : maxAbsDiff, 3)})`, font: { size: 13 } },
    margin: { l: dense ? 40 : 90, r: 10, t: 30, b: dense ? 40 : 90 },
    xaxis: { title: { text: "key" }, tickangle: -60, type: "category", showticklabels: !dense },
    yaxis: { title: { text: "query" }, autorange: "reversed", type: "category", showticklabels: !dense },
  }, PLOT);
}

function renderEffectSummary(P) {
  const r = state.view.response;
  const e = r.effect;
  const parts = [];
  if (lab.beta.mode === "view" && !betaIsNative()) {
    const tv = P.reduce((acc, row, i) => acc + 0.5 * row.reduce((s, p, j) => s + Math.abs(p - state.view.base[i][j]), 0), 0) / P.length;
    parts.push(`view-only TV at L${state.layer} h${state.head}: ${fmt(tv)}`);
  }
  if (e) {
    const pm = (x, s) => fmt(x) + (s !== undefined && s !== null ? ` ± ${fmt(s, 2)}` : "");
    parts.push(`TV at L${state.layer} h${state.head}: ${pm(e.attention_tv[0][0], e.attention_tv_std?.[0]?.[0])}`);
    const last = e.hidden_cosine.length - 1;
    parts.push(`last-layer hidden cosine: ${pm(e.hidden_cosine[last], e.hidden_cosine_std?.[last])}`);
    if (e.output?.embedding_cosine !== undefined) parts.push(`embedding cosine: ${pm(e.output.embedding_cosine, e.output.embedding_cosine_std)}`);
    if (e.samples) parts.push(`n = ${e.samples} samples`);
  }
  $("effect-summary").textContent = parts.length ? parts.join("  ·  ") : "no interventions active: change β in run mode, mask a token, ablate, or perturb";
}

function renderTokens() {
  const strip = $("token-strip");
  strip.replaceChildren(...state.view.tokens.map((tok, i) => {
    const el = document.createElement("span");
    el.className = "tok" + (lab.masks.tokens.has(i) ? " masked" : "") + (i === state.query ? " query" : "");
    el.textContent = tok;
    el.title = `token ${i}: click to ${lab.masks.tokens.has(i) ? "unmask" : "mask"} as a key`;
    el.dataset.index = i;
    el.addEventListener("click", () => toggleMask(i));
    return el;
  }));
}

function renderInterventionList() {
  const extra = lab.beta.mode === "view" && !betaIsNative() ? [`temperature (view only, in the browser): β = ${fmt(beta())} on the shown head`] : [];
  renderActiveList($("interventions-list"), lab, ctx(), {
    tokens: state.view?.tokens, extra, samples: samples(), onChange: labChanged,
  });
}

function renderBetaReadout() {
  const b = beta();
  $("beta-readout").textContent = `β = ${fmt(b)}  T = ${fmt(1 / b)}  (β₀ = ${fmt(state.info.native_beta)})`;
}

// Controls mirror the lab state (after a URL restore or an edit in the active list).
function syncControls() {
  $("beta-slider").value = String(lab.beta.logRatio);
  $("scope-select").value = lab.beta.scope;
  $("mode-select").value = lab.beta.mode;
  $("layer-select").value = state.layer;
  $("head-select").value = state.head;
  renderBetaReadout();
  masksPanel.update();
  perturbPanel.update();
}

function writeUrl() {
  const params = new URLSearchParams();
  params.set("m", state.model);
  params.set("t", $("text-input").value);
  const pair = $("pair-input").value.trim();
  if (pair) params.set("p", pair);
  params.set("l", String(state.layer));
  params.set("h", String(state.head));
  params.set("q", String(state.query));
  labToParams(lab, params);
  writeHash(params);
  $("share-url").value = window.location.href;
}

// ---- interactions ----------------------------------------------------------------------------------
function labChanged() {
  syncControls();
  load({ thumbnails: true });
}

function selectHead(layer, head) {
  state.layer = Math.max(0, Math.min(state.info.layers - 1, layer));
  state.head = Math.max(0, Math.min(state.info.heads - 1, head));
  $("layer-select").value = state.layer;
  $("head-select").value = state.head;
  // Scoped interventions follow the selection, so they must re-run; otherwise the cache answers fast.
  const scoped = interventions().some((iv) => iv.layers !== null);
  load({ thumbnails: scoped });
}

function selectQuery(i) {
  state.query = i;
  renderTokens();
  softmaxPanel.setSource("row");
  renderHeadDetails(shownAttention());
  writeUrl();
}

function toggleMask(index) {
  if (lab.masks.tokens.has(index)) lab.masks.tokens.delete(index);
  else lab.masks.tokens.add(index);
  masksPanel.update();
  load();
}

// Run mode: one model run in flight per slider; moves meanwhile collapse into one run of the latest β.
let betaRun = null;
let betaRunWanted = false;
function runBeta() {
  if (betaRun) { betaRunWanted = true; return; }
  betaRun = load({ settle: SETTLE_MS }).finally(() => {
    betaRun = null;
    if (betaRunWanted) { betaRunWanted = false; runBeta(); }
  });
}

function onBetaInput() {
  lab.beta.logRatio = Number($("beta-slider").value);
  renderBetaReadout();
  if (!state.view) return;
  if (lab.beta.mode === "view") showHead({ settle: SETTLE_MS }); // re-normalised here: a few ms at 128 tokens
  else runBeta();
}

function fillSelect(select, n, prefix) {
  select.replaceChildren(...Array.from({ length: n }, (_, i) => new Option(`${prefix} ${i}`, i)));
}

const tokenName = (j) => state.view?.tokens[j] ?? "?";
const masksPanel = mountMaskPanel($("masks-panel"), lab, { onChange: labChanged, tokenName, pickHint: "click tokens in the strip above or key labels in the head view" });
const perturbPanel = mountPerturbPanel($("perturb-panel"), lab, { onChange: labChanged });
const softmaxPanel = mountSoftmaxPanel($("softmax-panel"), { onError: (msg) => setStatus(msg, { error: true }) });

// Restore a shared view from the URL hash (model, input, selection, β, masks, perturbations).
function restoreFromUrl(models) {
  const params = readHash();
  if (![...params.keys()].length) return;
  const model = params.get("m");
  if (model && models.some((m) => m.id === model)) state.model = model;
  if (params.has("t")) $("text-input").value = params.get("t");
  $("pair-input").value = params.get("p") ?? (params.has("t") ? "" : $("pair-input").value);
  state.layer = intParam(params, "l", state.layer);
  state.head = intParam(params, "h", state.head);
  state.query = intParam(params, "q", state.query);
  paramsToLab(params, lab);
}

async function init() {
  const { models } = config.models ? { models: config.models } : await getJSON("/api/models?kind=text");
  const textModels = models.filter((m) => m.kind === "text");
  $("model-select").replaceChildren(...textModels.map((m) => new Option(`${m.id} (${m.layers}×${m.heads}, ${m.output})`, m.id)));
  restoreFromUrl(textModels);
  $("model-select").value = state.model;
  const chooseModel = () => {
    state.info = textModels.find((m) => m.id === state.model) ?? textModels[0];
    state.model = state.info.id;
    fillSelect($("layer-select"), state.info.layers, "layer");
    fillSelect($("head-select"), state.info.heads, "head");
    state.layer = Math.min(state.layer, state.info.layers - 1);
    state.head = Math.min(state.head, state.info.heads - 1);
    syncControls();
  };
  chooseModel();
  // A new input makes token indices meaningless: drop masks and the chosen tokens (and switch a
  // token-targeted perturbation off rather than let it silently become "every token").
  const resetInput = () => {
    lab.masks.tokens.clear();
    if (lab.perturb.tokens.size) { lab.perturb.tokens.clear(); lab.perturb.on = false; }
    state.query = 0;
    masksPanel.update();
    perturbPanel.update();
  };

  $("model-select").addEventListener("change", () => { state.model = $("model-select").value; resetInput(); chooseModel(); load(); });
  $("run-button").addEventListener("click", () => { resetInput(); load(); });
  $("text-input").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { resetInput(); load(); } });
  $("layer-select").addEventListener("change", () => selectHead(Number($("layer-select").value), state.head));
  $("head-select").addEventListener("change", () => selectHead(state.layer, Number($("head-select").value)));
  $("beta-slider").addEventListener("input", onBetaInput);
  $("beta-reset").addEventListener("click", () => { $("beta-slider").value = 0; onBetaInput(); });
  $("scope-select").addEventListener("change", () => { lab.beta.scope = $("scope-select").value; load(); });
  $("mode-select").addEventListener("change", () => { lab.beta.mode = $("mode-select").value; load(); });
  $("diff-kind").addEventListener("change", () => { if (state.view) renderDiff(shownAttention()); });
  $("zscale").addEventListener("change", () => { if (state.view) showHead(); });
  $("export-json").addEventListener("click", () => {
    if (!state.view) return setStatus("nothing to export yet", { error: true });
    downloadJSON({ request: state.view.request, response: decodedFields(state.view.response), url: window.location.href },
      `attnlab-${state.model}-L${state.layer}-H${state.head}.json`);
  });
  $("export-png").addEventListener("click", () => downloadPNG($("heatmap"), `attnlab-${state.model}-L${state.layer}-H${state.head}`)
    .catch((err) => setStatus(`PNG export failed: ${err.message}`, { error: true })));
  $("copy-link").addEventListener("click", async () => {
    $("share-url").select();
    try { await navigator.clipboard.writeText(window.location.href); setStatus("link copied"); } catch { setStatus("select the link and copy it"); }
  });
  document.addEventListener("keydown", (e) => {
    if (["INPUT", "TEXTAREA", "SELECT"].includes(document.activeElement?.tagName)) return;
    const moves = { ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0] };
    if (!moves[e.key]) return;
    e.preventDefault();
    selectHead(state.layer + moves[e.key][0], state.head + moves[e.key][1]);
  });
  await load();
  installPngButtons(document, `attnlab-${state.model}`);
}

init().catch((err) => setStatus(`failed to start: ${err.message}`, { error: true }));
