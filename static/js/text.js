// The text page: sentence → every layer and head of a text encoder, a decoder LM or an encoder–decoder, with
// the laboratory (static/js/lab/lab.js: β, masks, ablation, perturbations, effects, summaries, softmax panel,
// export, shareable URL). Language models add the next-token panel and the two continuations (lm.js);
// encoder–decoders add the attention kind (encoder / decoder / cross) and the decoded target.
import { getJSON, isAbort, postBinary, setStatus } from "./api.js";
import { jobClock, postJob, savedJob } from "./views/jobs.js";
import { addNotReady, byId as $, numbered, setOptions, visibleToken } from "./dom.js";
import { decodeTensor, entropy, fmt, maxAbs, softmaxRow } from "./mathx.js";
import { drawDiff } from "./views/diff.js";
import { drawHeadView } from "./views/headview.js";
import { drawHeatmap, paintHeatmap, paintPreview, tokenLabels } from "./views/heatmap.js";
import { drawModelView } from "./views/modelview.js";
import { bandOf, layerLabel, rowLabel } from "./views/layerkinds.js";
import { mountHeadKinds } from "./views/headkinds.js";
import { mountLab } from "./lab/lab.js";
import { figureToParams, intParam, paramsToFigure } from "./lab/urlstate.js";
import { drawNextToken, drawTarget, kvGroups, mountContinuation } from "./lm.js";
import { mountAnalysis } from "./views/analysis.js";
import { mountCircuit } from "./views/circuit.js";
import { mountWhy } from "./views/why.js";
import { mountScaleStats } from "./views/scalestats.js";
import { ATLAS_SCALES, drawAtlas, hideAtlas, setAtlasBeta, setAtlasScale } from "./views/atlas.js";
import { chosenWeighting, weightingOf } from "./views/weighting.js";
import { scaleMatrix } from "./views/scales.js";
import { loadPlotly } from "./vendor.js";

const config = JSON.parse(document.getElementById("page-config").textContent);
const limits = config.limits ?? {};
const THUMB = 24;
const PLOT = { responsive: true, displaylogo: false };

// The page state: the selection and what the server returned.
const state = {
  model: config.model,
  info: null, // ModelInfo of the selected model
  kind: "encoder", // encoder–decoders: which attention is shown (encoder | decoder | cross)
  layer: 0,
  head: 0,
  query: null, // query row shown in the softmax panel (null: the default row, see defaultQuery)
  position: null, // language models: the query position whose next token is shown (null = last)
  // {tokens (keys), queryTokens, attention, scores, base (without interventions), response, request}
  view: null,
  // a long input (over full_map_tokens, /guide#s10): {response, request, window: {P, rows, cols} | null}; view is null
  long: null,
  thumbs: null,
};

const output = () => state.info?.output;
const isLM = () => output() === "next_token";
const isSeq2seq = () => output() === "seq2seq";
// A tensor field of a response: per attention kind for encoder–decoders, else the field itself.
const ofKind = (field) => (field && isSeq2seq() && !Array.isArray(field) && !field.dtype ? field[state.kind] : field);
const shape = () => (isSeq2seq() && state.kind !== "encoder"
  ? { layers: state.info.decoder_layers ?? state.info.layers, heads: state.info.decoder_heads ?? state.info.heads }
  : { layers: state.info.layers, heads: state.info.heads });
// The shown kind's key and query tokens: cross-attention has target queries (rows) and source keys (columns);
// decoder self-attention is target × target; everything else source × source.
function kindTokens(r) {
  const target = r.target_tokens ?? [];
  return {
    keys: isSeq2seq() && state.kind === "decoder" ? target : r.tokens,
    queries: isSeq2seq() && state.kind !== "encoder" ? target : r.tokens,
  };
}
// A heading's prefix naming the shown kind (encoder–decoders).
const kindPrefix = () => (isSeq2seq() ? `${state.kind} · ` : "");
// The shown map is causal: a decoder LM, or an encoder–decoder's decoder self-attention.
const causalMap = () => isLM() || (isSeq2seq() && state.kind === "decoder");

// partial: while a slider drags, ask only for what the heatmap needs (no effects, no thumbnails); the
// full request follows once input settles, and finds the model run in the server's cache.
function request({ thumbnails = false, partial = false } = {}) {
  const ivs = lab.interventions();
  const compare = ivs.length > 0 && !partial;
  const body = {
    model: state.model,
    text: $("text-input").value,
    layers: [state.layer],
    heads: [state.head],
    include_scores: !isSeq2seq(), // Ŝ for view-mode β and the softmax panel (not offered for encoder–decoders)
    interventions: ivs,
    compare,
    include_base: compare, // P without interventions, for P̂ − P, in the same response
    samples: compare ? lab.samples() : 1,
    thumbnail_size: thumbnails && !partial ? THUMB : null,
    encoding: "f32", // exact, and decoded without parsing a number per cell
  };
  // value-weighted maps ‖P·v W_O‖ (§12.4) instead of P: the server's maps, so no browser-side β (no scores)
  // (encoder–decoders too: every kind, the cross keys weighted by the source tokens' values)
  if (chosenWeighting() === "value_norm") { body.weighting = "value_norm"; body.include_scores = false; }
  if (isLM()) {
    body.position = state.position;
    body.chat = $("chat-toggle").checked && Boolean(state.info.chat);
  } else if (isSeq2seq()) {
    body.target = $("target-input").value.trim() || null;
  } else {
    body.text_pair = $("pair-input").value.trim() || null;
  }
  return body;
}

// A text this long may be a long input (over full_map_tokens): its first view can take seconds on a CPU, so the
// request asks for layer progress (server-sent events) and the page shows a progress bar with Cancel.
const mayBeLong = (text) => text.length > 2 * (limits.full_map_tokens ?? 512);

// POST /api/text/attention; with progress a job (static/js/views/jobs.js): its accepted event (ETA, queue) and
// `{"progress", "total", "run", "runs"}` events drive the bar until the response.
// Cancel (or a newer load) aborts the fetch: the server stops the run at its next layer.
let runController = null;
async function fetchAttention(body, { progress }) {
  runController?.abort();
  // the binary form: the maps' float32 bytes read into one buffer, each a Float32Array (docs/api.md)
  if (!progress) return postBinary("/api/text/attention", body, { channel: "text" });
  const mine = new AbortController();
  runController = mine;
  const clock = jobClock((text) => { if (runController === mine) $("run-progress-eta").textContent = text; });
  showProgress({ progress: 0, total: 0 }, body);
  try {
    return await postJob("/api/text/attention", body, { signal: mine.signal, onEvent: (event) => {
      clock.event(event);
      if (event.progress !== undefined) showProgress({ ...event, total: clock.total(event) }, body); // the accepted event's total
    } });
  } finally {
    clock.stop();
    if (runController === mine) { runController = null; showProgress(null); } // a newer stream keeps its own bar
  }
}

// The progress bar: layers done over every model run of the request (a compare runs the model twice: one bar to
// runs × layers, app/streams.py), and the job's time left (null: hidden). Its label says what runs: a compare is not a
// "first view".
const progressLabel = (body) => (body?.compare
  ? `compare (the run with the interventions, then without${(body.samples ?? 1) > 1 ? ` and ${body.samples - 1} more samples` : ""})`
  : "first view");
function showProgress(event, body = null) {
  const box = $("run-progress");
  box.hidden = !event;
  if (!event) { $("run-progress-eta").textContent = ""; return; }
  if (!event.total) { // accepted, no layer done yet (or waiting in the queue)
    $("run-progress-bar").removeAttribute("value");
    $("run-progress-text").textContent = `${progressLabel(body)}: starting`;
    box.dataset.progress = "0";
    return;
  }
  $("run-progress-bar").max = event.total;
  $("run-progress-bar").value = event.progress;
  // passes over the layers: the model runs (a compare's two), then a value-weighted overview's
  const run = (event.runs ?? 1) > 1 ? ` (pass ${event.run} of ${event.runs})` : "";
  $("run-progress-text").textContent = `${progressLabel(body)}: layers done ${event.progress} of ${event.total}${run}`;
  box.dataset.progress = String(event.progress);
  box.dataset.total = String(event.total);
}

let loadSeq = 0;
// settle > 0: the load follows a slider; only the heatmap's cells are repainted until input settles.
// resumed: the request of a job left running before a page reload (resumeJob): sent as it was, it re-attaches.
async function load({ thumbnails = true, settle = 0, resumed = null } = {}) {
  const started = performance.now();
  const seq = ++loadSeq;
  if (!$("text-input").value.trim()) { emptyInput(); return; }
  $("text-error").hidden = true;
  $("run-error").hidden = true;
  setStatus("running…");
  try {
    const partial = settle > 0 && !state.long; // a long input's run is seconds: no partial runs while a slider moves
    const body = resumed ?? request({ thumbnails, partial });
    // the link says what is asked from the moment it is sent: a reload (or a second tab on the link) while a job
    // runs finds its interventions in the URL, not only its effect (the URL was written only once a view was drawn)
    if (!resumed && !partial) lab.writeUrl();
    const r = await fetchAttention(body, { progress: !partial && mayBeLong(body.text) });
    if (seq !== loadSeq) return; // a newer load started meanwhile
    refreshProbed();
    if (r.attention === null && r.overview) { // a long input (/guide#s10): its overview first, exact windows on zoom
      await showLong(r, body);
      setStatus(`${r.tokens.length} tokens · overview (zoom for exact windows) · ${Math.round(performance.now() - started)} ms`);
      return;
    }
    hideAtlas();
    state.long = null;
    longScale(false);
    state.view = viewOf(r, body);
    if (body.thumbnail_size) state.thumbs = r.thumbnails ? decodeTensor(ofKind(r.thumbnails)) ?? null : null;
    state.query = state.query === null ? defaultQuery(state.view.queryTokens.length) : Math.min(state.query, state.view.queryTokens.length - 1);
    showHead({ settle, onSettle: partial ? () => load({ thumbnails }) : null });
    showTruncation(r);
    setStatus(`${r.tokens.length} tokens${r.truncated ? " (truncated)" : ""} · ${Math.round(performance.now() - started)} ms`);
  } catch (err) {
    if (seq !== loadSeq) return;
    if (isAbort(err)) { // the Cancel button (a newer load has another seq)
      if (cancelled) setStatus(`cancelled${cancelled.total ? ` after layer ${cancelled.progress} of ${cancelled.total}` : ""}: the panels show the previous input`);
      cancelled = null;
      return;
    }
    showRunError(err.message);
    lab.fail(err.message);
  }
}

// A refused or failed run: the message under the Run button (the header only says where to look: a long message
// there pushed the navigation onto two lines), and the panels marked as the previous input's.
function showRunError(message) {
  const box = $("run-error");
  box.textContent = `${message}${state.view || state.long ? " — the panels below still show the previous run" : ""}`;
  box.hidden = false;
  setStatus("the run failed: see the message under Run", { error: true });
  markStale(true);
}

// The panels that show a run's numbers; marked (dimmed) while they do not match the text box, cleared on the next
// drawn run (renderDetails, renderLongDetails remove every .stale).
const RUN_PANELS = ["heatmap", "atlas-panel", "headview", "token-strip", "lm-panels", "modelview", "entropy-plot",
  "received-panel", "effect-panel", "summaries-panel", "softmax-panel"];
function markStale(on) {
  for (const id of RUN_PANELS) $(id)?.classList.toggle("stale", on);
  document.body.dataset.stale = on ? "1" : "";
}
// The text box edited away from the text the panels were run on: they no longer match it.
function followTextEdits() {
  const shown = (state.long?.request ?? state.view?.request)?.text;
  if (shown === undefined) return;
  markStale($("text-input").value !== shown);
}

// Cancel: abort the running request (the server stops at its next layer); the page keeps what it showed.
let cancelled = null;
function cancelRun() {
  if (!runController) return;
  const box = $("run-progress");
  cancelled = { progress: Number(box.dataset.progress ?? 0), total: Number(box.dataset.total ?? 0) };
  runController.abort();
}

// A long input: the overview of the shown head first, then the panels that work at any length (model view, head
// summaries, received, the next token and the continuation); the head view follows the zoomed window.
async function showLong(r, body) {
  // the page asks for scores only for view-mode β in the browser; a long input's view β is the server's (windows)
  r.warnings = (r.warnings ?? []).filter((w) => !w.startsWith("scores are not sent"));
  state.view = null;
  state.long = { response: r, request: body, window: null };
  longScale(true);
  clicksWired = false; // the atlas replaces the heatmap's click handler
  // thumbnails (encoder–decoders at long inputs send none: the model view says so)
  if (body.thumbnail_size) state.thumbs = r.thumbnails ? decodeTensor(ofKind(r.thumbnails)) ?? null : null;
  longTitle(r);
  showBetaScope();
  const { keys, queries } = kindTokens(r);
  await drawAtlas($("heatmap"), r, { layer: state.layer, head: state.head, kind: isSeq2seq() ? state.kind : null,
    band: isSeq2seq() ? null : bandOf(state.info, state.layer), layerName: isSeq2seq() ? null : layerLabel(state.info, state.layer),
    queryTokens: queries, keyTokens: keys, beta: atlasBeta(), onWindow: showWindow, onSelectHead: selectHead });
  heatmapShown("attnlab:atlas-overview", { long: true });
  showTruncation(r);
  requestAnimationFrame(() => setTimeout(() => { if (state.long?.response === r) renderLongDetails(); }, 0));
}

// The heading's note when the maps are value-weighted ‖P·v W_O‖ rather than P (the response says which).
const valueWeighted = (r) => (weightingOf(r) === "value_norm" ? " · value-weighted ‖P·v W_O‖" : "");

// The heatmap's heading at a long input: kind, head, length (the shown kind's keys), β.
function longTitle(r) {
  const { keys, queries } = kindTokens(r);
  const size = keys === queries ? `${keys.length.toLocaleString("en")} tokens`
    : `${queries.length.toLocaleString("en")} × ${keys.length.toLocaleString("en")} tokens`;
  const layer = isSeq2seq() ? `layer ${state.layer}` : layerLabel(state.info, state.layer); // "layer 2 · local 512"
  $("heatmap-title").textContent = `${kindPrefix()}${layer}, head ${state.head} · ${size}`
    + ` · β = ${fmt(lab.shownBeta())}${lab.viewBeta() ? " (view: windows and rows)" : ""}${valueWeighted(r)}`;
}

// A long input's overview and windows offer the scales that need no full map: linear 0 – max, log and each row
// to its own max (views/atlas.js); "0 – 1" and "max over rows ≥ k" are for full maps, so they are disabled there and
// the menu shows what is drawn.
function longScale(on) {
  const select = $("zscale");
  for (const option of select.options) option.disabled = on && !ATLAS_SCALES.includes(option.value);
  if (on && !ATLAS_SCALES.includes(select.value)) select.value = "max";
  $("zscale-k-box").hidden = select.value !== "rowsk";
  select.title = on ? "long inputs: the overview and windows are drawn 0 – max, on a log scale, or each row to its own max" : "";
  if (on) setAtlasScale(select.value, { redraw: false });
}

// View-mode β of the shown head on a long input, for the server's windows and rows (null: the run's own).
const atlasBeta = () => (lab.viewBeta() ? lab.shownBeta() : null);

// The head view of the zoomed window (exact P over its keys), or a note while the overview is shown.
function showWindow(w) {
  if (!state.long) return;
  state.long.window = w;
  const box = $("headview");
  const { keys: tokens, queries: queryTokens } = kindTokens(state.long.response);
  if (!w) {
    box.replaceChildren(Object.assign(document.createElement("p"), { className: "help",
      textContent: `${tokens.length.toLocaleString("en")} tokens: zoom into the heatmap (a window of at most 160 tokens a side) to see that window's head view.` }));
    box.dataset.window = "";
    return;
  }
  const keys = tokens.slice(w.cols[0], w.cols[1]), queries = queryTokens.slice(w.rows[0], w.rows[1]);
  const masked = new Set([...lab.state.masks.tokens].filter((j) => j >= w.cols[0] && j < w.cols[1]).map((j) => j - w.cols[0]));
  // Rows are normalised over all T keys, so a window's P is small (much of it goes to sinks outside the window):
  // the lines are drawn relative to the window's largest P, and the note says so.
  const top = Math.max(1e-12, maxAbs(w.P));
  drawHeadView(box, w.P.map((row) => row.map((p) => p / top)), keys.map((t, j) => `${w.cols[0] + j}:${t}`), {
    masked, onToggleKey: (j) => lab.toggleMask(w.cols[0] + j), queryTokens: queries.map((t, i) => `${w.rows[0] + i}:${t}`),
  });
  if (box.querySelector("svg")) {
    box.prepend(Object.assign(document.createElement("p"), { className: "help",
      textContent: `window: queries ${w.rows[0]}–${w.rows[1] - 1} → keys ${w.cols[0]}–${w.cols[1] - 1}; line weight ∝ P / ${fmt(top, 3)} (the window's largest P; each row sums to 1 over all ${tokens.length.toLocaleString("en")} keys)` }));
  }
  box.dataset.window = JSON.stringify({ rows: w.rows, cols: w.cols });
  if (w.rowEntropy) drawWindowEntropy(w, queryTokens, tokens.length);
}

// The entropy panel at a long input: each row of the zoomed window, over all the keys (the server's row_entropy).
function drawWindowEntropy(w, queryTokens, nKeys) {
  const labels = w.rowEntropy.map((_, i) => `${w.rows[0] + i}:${visibleToken(queryTokens[w.rows[0] + i])}`);
  const uniform = Math.log(nKeys);
  Plotly.react($("entropy-plot"), [
    { type: "bar", x: labels, y: w.rowEntropy, name: `row entropy (over all ${nKeys.toLocaleString("en")} keys)`, marker: { color: "#3b5bdb" } },
    { type: "scatter", mode: "lines", x: [labels[0], labels.at(-1)], y: [uniform, uniform], name: "log n (uniform)", line: { dash: "dot", color: "#999" } },
  ], {
    margin: { l: 40, r: 10, t: 10, b: 60 }, showlegend: true, legend: { orientation: "h", y: 1.12 },
    xaxis: { type: "category", tickangle: -60, showticklabels: labels.length <= 40 }, yaxis: { title: { text: "nats" }, rangemode: "tozero" },
  }, PLOT);
  $("entropy-plot").dataset.rows = JSON.stringify(w.rows);
}

function renderLongDetails() {
  const { response: r, request: body } = state.long;
  document.querySelectorAll(".stale").forEach((el) => el.classList.remove("stale"));
  document.body.dataset.stale = "";
  renderTokens();
  renderModelView(r);
  lab.render(r, body, derived(r));
  if (r.effect) drawDiff($("diff-heatmap"), null, { empty: r.base_run_id ? "inputs over full_map_tokens: zoom into the map and choose “difference P̂ − P” under it"
    : "P̂ − P needs both runs' maps: not drawn for inputs over full_map_tokens (the effect's other panels are)" });
  if (!state.long.window) {
    showWindow(null);
    Plotly.react($("entropy-plot"), [], {
      margin: { l: 40, r: 10, t: 10, b: 30 }, xaxis: { visible: false }, yaxis: { visible: false },
      annotations: [{ text: "at long inputs: zoom into the map for the entropy of each window row (over all keys)", showarrow: false, font: { color: "#667085" } }],
    }, PLOT);
    delete $("entropy-plot").dataset.rows;
  }
  drawReceived(r);
  if (isLM() && r.output?.kind === "next_token") { // the prediction and the continuation work at any length
    renderPositions(r.tokens);
    drawNextToken(r, r.tokens);
    continuation.followChanges();
  }
  if (isSeq2seq() && r.output) drawTarget(r); // the decoded target and its probabilities work at any length
}

// A text cut to the model's token limit: say so next to the text box, with what was kept and dropped.
function showTruncation(r) {
  const note = $("truncation-note");
  note.hidden = !r.truncated;
  if (!r.truncated) return;
  const kept = r.tokens.length, total = r.input_tokens ?? null;
  const n = (x) => x.toLocaleString("en");
  const where = isSeq2seq() ? "The source was cut" : "The text was cut";
  note.textContent = total !== null && total > kept
    ? `${where} to the model's limit: ${n(kept)} tokens kept, ${n(total - kept)} of ${n(total)} dropped (everything after “${visibleToken(r.tokens.at(-1) ?? "")}”, token ${kept - 1}).`
    : `The second sentence was cut to the model's limit of ${n(kept)} tokens.`;
  note.dataset.kept = String(kept);
  note.dataset.dropped = String(total !== null ? Math.max(0, total - kept) : 0);
}

// An empty (or white-space) text: say so at the input, and clear what showed the previous text.
function emptyInput() {
  const box = $("text-error");
  box.textContent = "The sentence is empty: type or paste some text, then Run (Ctrl+Enter).";
  box.hidden = false;
  $("truncation-note").hidden = true;
  setStatus("nothing to run: the sentence is empty", { error: true });
  state.view = null;
  state.long = null;
  hideAtlas();
  $("received-panel").hidden = true;
  clearTimeout(settleTimer);
  if (window.Plotly) Plotly.purge($("heatmap"));
  clicksWired = false; // purge dropped the figure's click handler
  $("heatmap").replaceChildren();
  $("heatmap-title").textContent = "no input";
  $("token-strip").replaceChildren();
  for (const id of ["modelview", "headview"]) $(id)?.replaceChildren();
  const summary = $("effect-summary");
  summary.textContent = "no input: the panels below are from the previous text";
  summary.classList.add("stale");
  document.querySelectorAll("#effect-panel, #summaries-panel, #softmax-panel").forEach((el) => el.classList.add("stale"));
}

// A textarea holds at most max_text_chars characters: a longer paste is cut by the browser, so say so.
function watchLength(id, noteId) {
  const box = $(id), note = $(noteId), max = Number(box.maxLength);
  if (!(max > 0)) return;
  const show = (text) => { note.textContent = text; note.hidden = !text; };
  box.addEventListener("paste", (e) => {
    const pasted = e.clipboardData?.getData("text")?.length ?? 0;
    const kept = box.value.length - (box.selectionEnd - box.selectionStart);
    if (kept + pasted > max) show(`The paste was cut: this box holds at most ${max.toLocaleString("en")} characters (the server's max_text_chars); ${(kept + pasted - max).toLocaleString("en")} were dropped.`);
  });
  box.addEventListener("input", () => {
    if (box.value.length >= max) { if (note.hidden) show(`At the limit: this box holds at most ${max.toLocaleString("en")} characters (the server's max_text_chars); the rest is cut.`); } else show("");
  });
  if (box.value.length >= max) box.dispatchEvent(new Event("input"));
}

// The shown head's maps from a response. Encoder–decoders: cross-attention has target queries (rows) and
// source keys (columns); decoder self-attention is target × target.
function viewOf(r, body) {
  const attention = decodeTensor(ofKind(r.attention))[0][0];
  const scores = r.scores ? decodeTensor(ofKind(r.scores))?.[0]?.[0] ?? null : null;
  const base = r.base_attention ? decodeTensor(ofKind(r.base_attention))[0][0] : attention;
  const { keys: tokens, queries: queryTokens } = kindTokens(r);
  return { tokens, queryTokens, attention, scores, base, response: r, request: body };
}

// The softmax panel's row when the user has chosen none: the last for a causal map (row 0 of a causal map
// sees one key, p = 1), else the first.
const defaultQuery = (n) => (causalMap() ? Math.max(0, n - 1) : 0);

// Which keys the browser masks for query row i when it re-normalises in view mode.
function maskedRow(i, n) {
  const masks = lab.state.masks.tokens;
  const causal = lab.state.causal.on || causalMap();
  return Array.from({ length: n }, (_, j) => masks.has(j) || (causal && j > i));
}

// The shown head's attention: from the server, or re-normalised here in view mode (§2).
function shownAttention() {
  const v = state.view;
  if (lab.viewBeta() && v.scores) {
    return v.scores.map((row, i) => softmaxRow(row, lab.shownBeta(), maskedRow(i, row.length)));
  }
  return v.attention;
}

// Draw the shown head: the heatmap at once, everything else after the first paint (a new view) or
// once input settles (a slider). With settle > 0 the heatmap's cells are repainted without Plotly.
let settleTimer = null;
// onSettle: what to do once input settles instead of drawing the details (a partial load: the full load).
function showHead({ settle = 0, onSettle = null } = {}) {
  if (state.long) { showLongBeta(settle); return; }
  const v = state.view;
  if (!v) return;
  const P = shownAttention();
  const el = $("heatmap");
  const kind = isSeq2seq() ? `${state.kind} · ` : "";
  $("heatmap-title").textContent = `${kind}layer ${state.layer}, head ${state.head} · β = ${fmt(lab.shownBeta())}`
    + valueWeighted(v.response);
  showBetaScope();
  clearTimeout(settleTimer);
  const forbidden = maskedCells(P.length, v.tokens.length);
  if (!window.Plotly) { // the first view: paint the cells now, build the figure once plotly.js is in
    const { z, zmin, zmax } = scaled(P);
    paintPreview(el, z, "loading the interactive figure…", { zmin, zmax, masked: forbidden });
    heatmapShown("attnlab:first-heatmap", { preview: true });
    loadPlotly().then(() => { if (state.view === v) showHead(); })
      .catch((err) => setStatus(`${err.message}: figures cannot be drawn`, { error: true }));
    return;
  }
  const draw = (matrix) => {
    const { z, ...scale } = scaled(matrix);
    el.dataset.scale = $("zscale").value;
    return drawHeatmap(el, z, v.tokens, { ...scale, yTokens: v.queryTokens, masked: forbidden, maskLegend: maskLegend() });
  };
  const painted = settle > 0 && paintHeatmap(el, scaled(P).z, v.tokens, v.queryTokens, forbidden);
  if (!painted) {
    draw(P);
    wireHeatmapClicks();
  }
  heatmapShown(painted ? null : "attnlab:heatmap-figure", { painted });
  const details = () => {
    settleTimer = null;
    if (state.view !== v) return;
    if (onSettle) return onSettle();
    if (painted) draw(shownAttention());
    renderDetails();
  };
  // A new view: let the browser paint the heatmap first (a frame), then build the other panels.
  if (settle > 0) settleTimer = setTimeout(details, settle);
  else requestAnimationFrame(() => { settleTimer = setTimeout(details, 0); });
}

// View-mode β on a long input: once the slider settles, the server re-normalises the shown window and row.
let longBetaTimer = null;
function showLongBeta(settle) {
  clearTimeout(longBetaTimer);
  const r = state.long.response;
  longTitle(r);
  showBetaScope();
  longBetaTimer = setTimeout(() => {
    if (state.long?.response === r) setAtlasBeta(atlasBeta()).then(() => lab.render(r, state.long.request, derived(r)));
  }, settle);
}

// The shown head outside a β layer range: say so beside the heatmap, with a way to the first changed layer.
function showBetaScope() {
  const scope = lab.betaScope(), note = $("beta-scope-note");
  note.hidden = !scope;
  if (!scope) return;
  $("beta-scope-text").textContent = scope.text;
  const jump = $("beta-scope-jump");
  jump.textContent = `show layer ${scope.layer}`;
  jump.onclick = () => selectHead(scope.layer, state.head);
}

// The heatmap's colour scales (#zscale, static/js/views/scales.js): the values to colour, their range, and P for
// the hover where the colours are on another scale.
function scaled(P) { return scaleMatrix(P, $("zscale").value, { rowsFrom: rowsFrom(P.length) }); }
// "rowsk": the first query row the scale's top is taken over (clamped to the map).
const rowsFrom = (n) => Math.max(0, Math.min(n - 1, Math.round(Number($("zscale-k").value) || 0)));

// The cells a mask forbids in the shown map (rows = queries): drawn grey, not as near-zero attention.
function maskedCells(nQueries, nKeys) {
  const cells = Array.from({ length: nQueries }, (_, i) => maskedRow(i, nKeys));
  return cells.some((row) => row.some(Boolean)) ? cells : null;
}

// The legend of the grey cells: which masks forbid them.
function maskLegend() {
  const parts = [];
  if (causalMap()) parts.push(`causal (built into this ${isLM() ? "decoder" : "decoder self-attention"}): key j > query i`);
  else if (lab.state.causal.on) parts.push("causal mask: key j > query i");
  if (lab.state.masks.tokens.size) parts.push(`masked key${lab.state.masks.tokens.size > 1 ? "s" : ""} ${[...lab.state.masks.tokens].sort((a, b) => a - b).join(", ")}`);
  return `masked, P = 0: ${parts.join("; ")}`;
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
    if (pt && state.view) selectQuery(pt.pointIndex?.[0] ?? tokenLabels(state.view.queryTokens).indexOf(pt.y));
    if (pt && state.view && isLM()) why.offer(state.query, pt.pointIndex?.[1] ?? tokenLabels(state.view.tokens).indexOf(pt.x), state.view.tokens);
  });
}
// "why?" on a clicked cell of a decoder's map: the score split over residual-stream parts (static/js/views/why.js)
const why = mountWhy($("map-area"), { request: () => {
  const r = state.view.request;
  return { model: r.model, text: r.text, chat: Boolean(r.chat), layer: r.layers[0], head: r.heads[0], interventions: r.interventions };
} });

// "Why the scale is 1/√d": the shown head's raw scores and the attention's counts (static/js/views/scalestats.js)
mountScaleStats($("received-panel"), { request: () => {
  const r = state.view?.request;
  return r ? { model: r.model, text: r.text, layer: Number($("layer-select").value), head: Number($("head-select").value) } : null;
} });

// Everything besides the heatmap.
function renderDetails() {
  const v = state.view, r = v.response;
  document.querySelectorAll(".stale").forEach((el) => el.classList.remove("stale"));
  document.body.dataset.stale = "";
  renderTokens();
  renderModelView(r);
  lab.render(r, v.request, derived(r));
  renderHeadDetails(shownAttention());
  drawReceived(r);
  if (isLM() && r.output) {
    renderPositions(r.tokens);
    drawNextToken(r, r.tokens);
    continuation.followChanges(); // only full views reach here: a drag's partial loads do not
  }
  if (isSeq2seq() && r.output) drawTarget(r);
}

// The model view's colouring by a head score (static/js/views/headkinds.js): redrawn when a choice or scores arrive.
const headKinds = mountHeadKinds($("modelview-colour"), $("modelview-colour-status"), {
  model: () => state.model, isLM,
  redraw: () => { const r = state.view?.response ?? state.long?.response; if (r) renderModelView(r); },
});

function renderModelView(r) {
  if (state.thumbs) {
    drawModelView($("modelview"), state.thumbs, {
      layer: state.layer, head: state.head, entropy: ofKind(r.entropy), onSelect: selectHead, colour: headKinds.colour(r),
      rowLabel: isSeq2seq() ? null : (l) => rowLabel(state.info, l), // local / global layers
    });
  } else {
    const why = state.long && isSeq2seq()
      ? "thumbnails are not computed for an encoder–decoder input over full_map_tokens (the run keeps an overview per kind instead)"
      : "the server sends no thumbnails for this model";
    $("modelview").replaceChildren(Object.assign(document.createElement("p"), { className: "help", textContent: `${why}: use the layer and head selectors or the head summaries` }));
  }
}

// Attention received by each key, received[j] = (1/T) Σ_i P[i, j] of the shown head (§10), over the whole context:
// keys far above 1/T are "attention sinks". Encoder–decoders: the shown kind's (cross: source keys, averaged over
// the target's queries); short encoder–decoder responses carry none.
function drawReceived(r) {
  const box = $("received-panel");
  const field = r.received ? decodeTensor(ofKind(r.received)) : null;
  box.hidden = !field;
  if (!field) return;
  const received = field[0][0], tokens = kindTokens(r).keys;
  const x = received.map((_, j) => j), text = tokens.map((t, j) => `${j}:${visibleToken(t)}`);
  let top = 0;
  received.forEach((p, j) => { if (p > received[top]) top = j; });
  const el = $("received-plot");
  Plotly.react(el, [
    { type: received.length > 2000 ? "scattergl" : "scatter", mode: "lines", x, y: received, text, name: "received",
      line: { color: "#3b5bdb", width: 1 }, hovertemplate: "key %{text}<br>received %{y:.4g}<extra></extra>" },
    { type: "scatter", mode: "lines", x: [0, received.length - 1], y: [1 / received.length, 1 / received.length], name: "1/T (even)",
      line: { dash: "dot", color: "#999", width: 1 }, hoverinfo: "skip" },
  ], {
    margin: { l: 55, r: 10, t: 30, b: 40 }, showlegend: false,
    title: { text: `${kindPrefix()}layer ${state.layer}, head ${state.head} · most received: key ${text[top]} (${fmt(received[top], 3)})`, font: { size: 12 } },
    xaxis: { title: { text: "key token" } }, yaxis: { title: { text: "received (log)" }, type: "log", exponentformat: "power" },
  }, PLOT);
  el.dataset.top = String(top);
  el.dataset.n = String(received.length);
}

// What the lab draws that differs by model: encoder–decoders report TV, entropy and distance per kind.
// attention_tv is the requested slice when attention_tv_all (every head) comes with it.
function derived(r) {
  const e = r.effect;
  const out = { entropy: ofKind(r.entropy), distance: ofKind(r.mean_distance) ?? null };
  if (e) {
    const all = ofKind(e.attention_tv_all), sliced = ofKind(e.attention_tv), std = ofKind(e.attention_tv_std);
    out.tv = all ?? sliced;
    out.tvAt = all ? [sliced?.[0]?.[0], std?.[0]?.[0]] : [sliced?.[state.layer]?.[state.head], std?.[state.layer]?.[state.head]];
  }
  return out;
}

// The panels that depend on the shown head's P: head view, row entropy, P̂ − P, softmax panel.
function renderHeadDetails(P) {
  const v = state.view;
  drawHeadView($("headview"), P, v.tokens, { masked: lab.state.masks.tokens, onToggleKey: lab.toggleMask, queryTokens: v.queryTokens });
  const rowEntropy = P.map(entropy);
  const labels = tokenLabels(v.queryTokens);
  const uniform = Math.log(v.tokens.length);
  Plotly.react($("entropy-plot"), [
    { type: "bar", x: labels, y: rowEntropy, name: "row entropy", marker: { color: "#3b5bdb" } },
    { type: "scatter", mode: "lines", x: [labels[0], labels.at(-1)], y: [uniform, uniform], name: "log n (uniform)", line: { dash: "dot", color: "#999" } },
  ], {
    margin: { l: 40, r: 10, t: 10, b: 60 }, showlegend: true, legend: { orientation: "h", y: 1.12 },
    xaxis: { type: "category", tickangle: -60, showticklabels: v.queryTokens.length <= 40 }, yaxis: { title: { text: "nats" }, rangemode: "tozero" },
  }, PLOT);
  lab.renderDiff();
  lab.renderSoftmax();
}

function renderTokens() {
  const masks = lab.state.masks.tokens;
  const square = state.view ? state.view.tokens === state.view.queryTokens : false;
  const tokens = state.view?.tokens ?? kindTokens(state.long.response).keys; // the shown kind's keys
  const strip = $("token-strip");
  strip.classList.toggle("scroll", Boolean(state.long)); // thousands of chips: a scrolling box
  // The chips stay while the tokens are the same (a response to a mask click brings the same tokens): rebuilding them
  // on every response lost a click held across the rebuild (6 clicks 150 ms apart masked 4).
  const key = tokens.join("\u0000");
  if (strip.dataset.tokensKey !== key) {
    strip.dataset.tokensKey = key;
    strip.replaceChildren(...tokens.map((tok, i) => {
      const el = document.createElement("span");
      el.textContent = visibleToken(tok); // a newline token reads "\n", not an empty chip
      el.dataset.index = i;
      el.tabIndex = 0; // keyboard: Tab to a token, Enter or Space masks it
      el.setAttribute("role", "button");
      el.addEventListener("click", () => lab.toggleMask(i));
      el.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); lab.toggleMask(i); } });
      return el;
    }));
  }
  tokens.forEach((tok, i) => {
    const el = strip.children[i];
    el.className = "tok" + (masks.has(i) ? " masked" : "") + (square && i === state.query ? " query" : "");
    if (el.textContent !== tok) el.classList.add("ws");
    el.title = `token ${i}: click to ${masks.has(i) ? "unmask" : "mask"} as a key`;
    el.setAttribute("aria-pressed", String(masks.has(i)));
  });
}

// Language models: which query position's next token is shown (the last by default).
function renderPositions(tokens) {
  const options = [["", `the last token (${tokens.length - 1})`], ...tokens.map((t, i) => [i, `${i}: ${visibleToken(t)}`])];
  setOptions($("position-select"), options, state.position ?? "");
}

// ---- the lab ---------------------------------------------------------------------------------------
const lab = mountLab({
  run: ({ settle = 0 } = {}) => load({ settle }),
  redraw: ({ settle = 0 } = {}) => showHead({ settle }),
  labels: () => state.view?.tokens ?? state.long?.response.tokens ?? [],
  selection: () => ({ layer: state.layer, head: state.head, query: state.query, kind: isSeq2seq() ? state.kind : undefined }),
  shape: () => shape(),
  nativeBeta: () => state.info?.native_beta ?? 1,
  selectHead: (layer, head) => selectHead(layer, head),
  pageParams,
  mainFigure: () => $("heatmap"),
  exportName: () => `attnlab-${state.model}-L${state.layer}-H${state.head}`,
  modelName: () => state.model,
  diff: () => {
    const v = state.view;
    if (!v || !(v.request.interventions.length > 0 || lab.viewBeta())) return null;
    const kind = isSeq2seq() ? `${state.kind}, ` : "";
    const masks = lab.state.masks.tokens;
    return { after: shownAttention(), before: v.base, x: tokenLabels(v.tokens), y: tokenLabels(v.queryTokens), where: `${kind}layer ${state.layer}, head ${state.head}`,
      masked: (_i, j) => masks.has(j) };
  },
  softmax: () => {
    const v = state.view;
    if (!v?.scores) return null;
    return {
      tokens: v.tokens, scores: v.scores, beta: lab.shownBeta(), query: state.query,
      queryLabels: v.queryTokens.map((t, i) => `${i}: ${visibleToken(t)}`), keyLabels: tokenLabels(v.tokens),
      masked: (i) => maskedRow(i, v.tokens.length), onQuery: selectQuery,
    };
  },
  softmaxEmpty: () => (state.long ? `${state.long.response.tokens.length.toLocaleString("en")} tokens is a long input (over full_map_tokens): `
    + "its response holds no full scores; click a row of the map to draw it over every key"
    : isSeq2seq() ? "an encoder–decoder's response holds no scores" : "this input's response holds no scores"),
  summaryExtra: () => {
    if (!lab.viewBeta() || !state.view) return [];
    const P = shownAttention(), base = state.view.base;
    const tv = P.reduce((acc, row, i) => acc + 0.5 * row.reduce((s, p, j) => s + Math.abs(p - base[i][j]), 0), 0) / P.length;
    return [`view-only TV at L${state.layer} h${state.head}: ${fmt(tv)}`];
  },
  builtInCausal: () => (!causalMap() ? null : isLM() ? "this model is a decoder: each token attends only to itself and earlier tokens"
    : "decoder self-attention: each target token attends only to itself and earlier target tokens"),
  activeExtra: () => (!lab.viewBeta() ? [] : state.long
    ? [`temperature (view only, the windows and rows re-normalised by the server): β = ${fmt(lab.shownBeta())} on the shown head`]
    : [`temperature (view only, in the browser): β = ${fmt(lab.shownBeta())} on the shown head`]),
}, {
  maxSamples: limits.samples ?? 64, pickHint: "click tokens in the strip above or key labels in the head view",
  // "Download standalone HTML" in the export panel (static/js/lab/export-html.js)
  htmlExport: { body: () => state.view?.request ?? state.long?.request ?? null,
    filename: () => `attnlab-${state.model}-L${state.layer}-H${state.head}.html`, shownLayer: () => state.layer,
    shownHead: () => state.head },
});

const continuation = mountContinuation({
  body: () => ({
    model: state.model, text: $("text-input").value, chat: $("chat-toggle").checked && Boolean(state.info?.chat),
    max_new_tokens: Math.max(1, Math.min(Number($("max-new-tokens").max) || 64, Math.round(Number($("max-new-tokens").value) || 1))),
    interventions: lab.interventions(),
  }),
  onError: (msg) => setStatus(msg, { error: true }),
  // the shown head's map grows a row per new token; the prompt's tokens label it when the shown view is of this text
  attention: () => (!isLM() ? null : { layer: state.layer, head: state.head,
    promptTokens: state.view?.request?.text === $("text-input").value && !state.view?.request?.chat ? state.view.tokens : null }),
  why,
});

// Patching between two prompts, the logit lens and the faithfulness check (static/js/views/analysis.js)
mountAnalysis({ info: () => state.info, text: () => $("text-input").value, interventions: () => lab.interventions(), store: lab.store,
  onError: (msg) => setStatus(msg, { error: true }) });
// The circuit view beside it (static/js/views/circuit.js): a click on a head shows its map here
mountCircuit({ info: () => state.info, store: lab.store, selectHead: (layer, head) => selectHead(layer, head),
  onError: (msg) => setStatus(msg, { error: true }) });

// Arrow keys move the head and layer (lab.js, a listener on the document) only while the focus is inside the map,
// the controls or the lab's panels (.keys-area is focusable: a click anywhere in it gives it the focus): with nothing
// focused they scroll the page, as on any page. Heard on <body>, after the focused element's own handlers (the model
// view's arrows) and before the document's.
const KEY_AREAS = ".keys-area, #masks-panel, #perturb-panel, #summaries-panel, #softmax-panel, #effect-panel";
document.body.addEventListener("keydown", (e) => {
  if (!["ArrowLeft", "ArrowRight", "ArrowUp", "ArrowDown"].includes(e.key)) return;
  if (!(e.target instanceof Element) || !e.target.closest(KEY_AREAS)) e.stopPropagation();
});

function pageParams() {
  const params = new URLSearchParams();
  params.set("m", state.model);
  params.set("t", $("text-input").value);
  if (isLM()) {
    if (state.position !== null) params.set("pos", String(state.position));
    if ($("chat-toggle").checked) params.set("chat", "1");
  } else if (isSeq2seq()) {
    params.set("k", state.kind);
    const target = $("target-input").value.trim();
    if (target) params.set("tg", target);
  } else {
    const pair = $("pair-input").value.trim();
    if (pair) params.set("p", pair);
  }
  params.set("l", String(state.layer));
  params.set("h", String(state.head));
  figureToParams({ scale: $("zscale").value, rowsFrom: rowsFrom(Infinity), diff: $("diff-kind").value }, params);
  if (state.query !== null) params.set("q", String(state.query));
  return params;
}

// ---- interactions ----------------------------------------------------------------------------------
function selectHead(layer, head) {
  const { layers, heads } = shape();
  state.layer = Math.max(0, Math.min(layers - 1, layer));
  state.head = Math.max(0, Math.min(heads - 1, head));
  $("layer-select").value = state.layer;
  $("head-select").value = state.head;
  // Scoped interventions follow the selection, so they must re-run; otherwise the cache answers fast.
  const scoped = lab.interventions().some((iv) => iv.layers !== null);
  load({ thumbnails: scoped });
}

function selectQuery(i) {
  state.query = i;
  renderTokens();
  lab.renderSoftmax({ row: true });
  lab.writeUrl();
}

// Layer and head selects for the shown model (and kind); GQA: which query heads share a K/V head.
function fillHeadSelects() {
  const { layers, heads } = shape();
  state.layer = Math.min(state.layer, layers - 1);
  state.head = Math.min(state.head, heads - 1);
  const b = lab.state.beta; // a β layer range of another model (or kind) must fit this one
  [b.from, b.to] = [Math.min(b.from, layers - 1), Math.min(b.to, layers - 1)];
  const kv = state.info.kv_heads;
  const group = kv && kv < heads && !(isSeq2seq() && state.kind !== "encoder") ? heads / kv : null;
  setOptions($("layer-select"), numbered(layers, "layer").map(([l, label]) => [l, isSeq2seq() ? label : layerLabel(state.info, l)]), state.layer);
  setOptions($("head-select"), numbered(heads, "head").map(([h, label]) => [h, group ? `${label} · K/V ${Math.floor(h / group)}` : label]), state.head);
}

// A model not used yet is listed from its files, not loaded (docs/api.md): no parity yet. After its first run the
// list is asked once more and the badge shows the load-time probe's parity.
async function refreshProbed() {
  const info = state.info;
  if (!info || typeof info.parity === "number" || info.parityAsked) return;
  info.parityAsked = true;
  const fresh = (await getJSON("/api/models?kind=text").catch(() => ({ models: [] }))).models.find((m) => m.id === info.id);
  if (typeof fresh?.parity !== "number") return;
  Object.assign(info, fresh);
  if (state.info === info) showModelInfo();
}

function showModelInfo() {
  const info = state.info;
  $("pair-box").hidden = isLM() || isSeq2seq();
  $("target-box").hidden = !isSeq2seq();
  $("kind-box").hidden = !isSeq2seq();
  $("position-box").hidden = !isLM();
  $("chat-box").hidden = !(isLM() && info.chat);
  $("lm-panels").hidden = !isLM();
  $("seq2seq-panel").hidden = !isSeq2seq();
  const groups = kvGroups(info.heads, info.kv_heads);
  $("gqa-note").hidden = !groups;
  $("gqa-note").textContent = groups ? `Grouped-query attention: ${info.heads} query heads per layer, ${info.kv_heads} key/value heads; ${groups}. Scopes name query heads; a key perturbation on one head leaves the heads that share its K/V head alone.` : "";
  const parity = typeof info.parity === "number" ? info.parity : null;
  $("parity-badge").hidden = parity === null;
  $("parity-badge").textContent = parity === null ? "" : `parity ${parity === 0 ? "0" : parity.toExponential(0)} vs eager`;
  $("parity-badge").title = "max |Δ logits| of the load-time probe: this model through attnlab's attention function vs its own eager attention";
  const maxNew = Math.min(limits.max_new_tokens ?? 64, info.max_new_tokens ?? 64);
  $("max-new-tokens").max = String(maxNew);
  if (Number($("max-new-tokens").value) > maxNew) $("max-new-tokens").value = String(maxNew);
  $("kind-select").value = state.kind;
  // Encoder–decoders: no scores from the server, so no browser-side re-normalisation (view mode).
  $("mode-select").disabled = isSeq2seq();
  if (isSeq2seq() && lab.state.beta.mode === "view") { lab.state.beta.mode = "run"; lab.syncControls(); }
}

// Restore a shared view from the URL hash (model, input, selection, β, masks, perturbations).
function restoreFromUrl(models) {
  const params = lab.restore();
  if (!params) return;
  const model = params.get("m");
  if (model && models.some((m) => m.id === model)) state.model = model;
  if (params.has("t")) $("text-input").value = params.get("t");
  $("pair-input").value = params.get("p") ?? (params.has("t") ? "" : $("pair-input").value);
  $("target-input").value = params.get("tg") ?? "";
  if (["encoder", "decoder", "cross"].includes(params.get("k"))) state.kind = params.get("k");
  $("chat-toggle").checked = params.get("chat") === "1";
  state.position = params.has("pos") ? intParam(params, "pos", null) : null;
  state.layer = intParam(params, "l", state.layer);
  state.head = intParam(params, "h", state.head);
  state.query = intParam(params, "q", state.query);
  const figure = paramsToFigure(params);
  if (figure.scale) { $("zscale").value = figure.scale; scaleChosen = true; }
  if (figure.rowsFrom !== null) $("zscale-k").value = String(figure.rowsFrom);
  if (figure.diff) $("diff-kind").value = figure.diff;
}

// A first view this tab left running before a page reload (views/jobs.js keeps its request and last event id in
// sessionStorage): its model, text and head back in the controls, and its request to send as it was (postJob then
// re-attaches to the job instead of sending it again; a job the server no longer knows is sent again). Its
// interventions come back from the URL, written when the job was sent (load): the lab lists what the answer shows.
function resumeJob(models) {
  const body = savedJob("/api/text/attention")?.body;
  if (!body || typeof body.text !== "string" || !models.some((m) => m.id === body.model)) return null;
  state.model = body.model;
  $("text-input").value = body.text;
  if (typeof body.text_pair === "string") $("pair-input").value = body.text_pair;
  if (typeof body.target === "string") $("target-input").value = body.target;
  if (typeof body.chat === "boolean") $("chat-toggle").checked = body.chat;
  state.position = Number.isInteger(body.position) ? body.position : null;
  if (Number.isInteger(body.layers?.[0])) state.layer = body.layers[0];
  if (Number.isInteger(body.heads?.[0])) state.head = body.heads[0];
  return body;
}

// The example text follows the model (a prompt for a language model, a sentence for an encoder) unless the
// box holds text of the user's own.
function followExample() {
  $("text-label").textContent = isLM() ? "Prompt" : "Sentence";
  const examples = Object.values(config.examples ?? {});
  const box = $("text-input");
  if (box.value.trim() && !examples.includes(box.value)) return;
  box.value = config.examples?.[output()] ?? config.examples?.default ?? box.value;
}

// The colour scale follows the model (log for a causal map, see scaled()) until the user picks one.
let scaleChosen = false;
function defaultScale() {
  if (!scaleChosen) $("zscale").value = causalMap() ? "log" : "max";
  $("zscale-k-box").hidden = $("zscale").value !== "rowsk";
}

function modelLabel(m) {
  const kv = m.kv_heads && m.kv_heads < m.heads ? `, ${m.kv_heads} K/V` : "";
  return `${m.id} (${m.layers}×${m.heads}${kv}, ${m.output})`;
}

async function init() {
  const { models, not_ready: notReady } = config.models ? { models: config.models, not_ready: config.not_ready }
    : await getJSON("/api/models?kind=text");
  const textModels = models.filter((m) => m.kind === "text");
  setOptions($("model-select"), textModels.map((m) => [m.id, modelLabel(m)]));
  addNotReady($("model-select"), notReady); // being prepared while the server serves (`make run`)
  restoreFromUrl(textModels);
  let resumed = resumeJob(textModels);
  $("model-select").value = state.model;
  const chooseModel = () => {
    state.info = textModels.find((m) => m.id === state.model) ?? textModels[0];
    state.model = state.info.id;
    if (!isSeq2seq()) state.kind = "encoder";
    followExample();
    showModelInfo();
    fillHeadSelects();
    defaultScale();
    lab.syncControls();
    lab.store.setModel(state.info); // views that follow the model (views/analysis.js) subscribe to the store
  };
  chooseModel();
  // a saved job whose interventions the URL does not hold (the link was edited, or written by an older page) is not
  // re-attached: the link's view is asked, so that the lab lists what the answer shows
  if (resumed && lab.stale(resumed)) resumed = null;
  // A new input makes token indices meaningless.
  const resetInput = () => {
    lab.forgetTokens();
    state.query = null;
    state.position = null;
  };
  const rerun = () => { resetInput(); load(); };

  $("model-select").addEventListener("change", () => {
    state.model = $("model-select").value;
    resetInput();
    continuation.reset();
    chooseModel();
    load();
  });
  $("run-button").addEventListener("click", rerun);
  $("text-input").addEventListener("input", followTextEdits);
  // The long sample (README, /guide#s10): its language model, its text (trailing white space stripped: a last query
  // row of "\n" predicts "\n" and puts almost nothing on the fact), streamed with progress (mayBeLong).
  $("long-sample-button").addEventListener("click", async () => {
    let text;
    try {
      const res = await fetch("/static/samples/long-sample.txt");
      if (!res.ok) throw new Error(`${res.status} ${res.statusText}`);
      text = (await res.text()).trimEnd();
    } catch (err) { showRunError(`the long sample did not load: ${err.message}`); return; }
    const lm = textModels.find((m) => m.output === "next_token");
    if (lm && state.model !== lm.id) {
      state.model = lm.id;
      $("model-select").value = lm.id;
      continuation.reset();
      chooseModel();
    }
    $("text-input").value = text;
    rerun();
  });
  $("run-cancel").addEventListener("click", cancelRun);
  for (const id of ["text-input", "pair-input", "target-input"]) { // Ctrl+Enter runs from any text box
    $(id).addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); rerun(); } });
  }
  watchLength("text-input", "text-note");
  watchLength("pair-input", "pair-note");
  watchLength("target-input", "target-note");
  $("kind-select").addEventListener("change", () => {
    state.kind = $("kind-select").value;
    lab.forgetTokens(); // key indices belong to another sequence now
    state.query = null;
    fillHeadSelects();
    defaultScale();
    load();
  });
  $("position-select").addEventListener("change", () => {
    state.position = $("position-select").value === "" ? null : Number($("position-select").value);
    load({ thumbnails: false });
  });
  $("chat-toggle").addEventListener("change", rerun);
  $("layer-select").addEventListener("change", () => selectHead(Number($("layer-select").value), state.head));
  $("head-select").addEventListener("change", () => selectHead(state.layer, Number($("head-select").value)));
  const rescale = () => {
    $("zscale-k-box").hidden = $("zscale").value !== "rowsk";
    if (state.view) showHead();
    else if (state.long) setAtlasScale($("zscale").value);
    lab.writeUrl();
  };
  $("zscale").addEventListener("change", () => { scaleChosen = true; rescale(); });
  $("zscale-k").addEventListener("change", rescale);
  $("diff-kind").addEventListener("change", () => lab.writeUrl());
  $("weighting-select")?.addEventListener("change", () => load({ thumbnails: false }));
  await load({ resumed });
  lab.installPngButtons(() => `attnlab-${state.model}`); // the model shown when the button is pressed
}

init().catch((err) => setStatus(`failed to start: ${err.message}`, { error: true }));
