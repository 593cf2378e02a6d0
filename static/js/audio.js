// The speech page: a clip (dropped, chosen, recorded, or the bundled sample) → Whisper's log-mel spectrogram with the
// words at their times, one head's token × time cross-attention on the same time axis, a token's row as a curve,
// the heads ranked by alignment; interventions (mask a span by dragging over the spectrogram, β on cross heads,
// ablate heads) re-run the model, and the transcript before/after, per-token Δp and the streamed greedy transcript
// show what the decoder heard.
import { ApiError, getJSON, isAbort, postBinary, readJSON, setStatus } from "./api.js";
import { addNotReady, byId as $, setOptions, visibleToken } from "./dom.js";
import { decodeTensor, fmt } from "./mathx.js";
import { MODEBAR_REMOVE } from "./vendor.js";
import { betaOf, buildSpeechInterventions } from "./lab/interventions.js";
import { mountLab } from "./lab/lab.js";
import { mapName, onWeightingChange, weightingFields, weightingOf } from "./views/weighting.js";
import { postJob } from "./views/jobs.js";

const config = JSON.parse(document.getElementById("page-config").textContent);
const PLOT = { responsive: true, displaylogo: false, modeBarButtonsToRemove: MODEBAR_REMOVE };
const SPECTRO_PLOT = { ...PLOT, modeBarButtonsToRemove: MODEBAR_REMOVE.filter((b) => b !== "select2d") };
const POSITION_S = 0.02; // one encoder position
const NATIVE_BETA = 0.125; // tiny.en: 1/√64 (the response's native_beta replaces it)
// The spectrogram, the cross-attention map and the row curve share one time axis: same margins, so the same
// second lies at the same x on all three.
const TIME_MARGIN = { l: 110, r: 10 };

const state = {
  model: config.model,
  task: "transcribe",
  language: "", // "" = detected from the clip (multilingual models)
  audioId: null,
  duration: 0,
  layer: 3,
  head: 0,
  token: null, // decoder row shown as a curve
  spans: [], // [{kind, first, last, start, end}] masked spans: encoder positions first…last = [start, end) s
  perturbKind: "cross", // the attention whose keys the perturbation's span is ("cross" | "encoder"); queries: cross
  ablated: new Set(), // "layer.head" cross heads
  response: null,
  base: null, // the same view without interventions (for the curve's "before")
  mel: null,
  streaming: null,
};

const spanTokens = (s) => Array.from({ length: Math.max(0, s.last - s.first + 1) }, (_, i) => s.first + i);

// A drawn or typed span [t0, t1) s snapped to whole 20 ms encoder positions (each edge to the nearest position
// boundary, at least one position): the span shown, labelled and sent are then the same positions. null: none.
function snapSpan(t0, t1) {
  const limit = Math.min(1500, Math.ceil((state.duration || 30) / POSITION_S - 1e-9));
  const first = Math.max(0, Math.min(limit - 1, Math.round(Math.min(t0, t1) / POSITION_S)));
  const stop = Math.min(limit, Math.max(first + 1, Math.round(Math.max(t0, t1) / POSITION_S)));
  if (!(stop > first)) return null;
  return { first, last: stop - 1, start: first * POSITION_S, end: stop * POSITION_S };
}
const spanLabel = (s) => `${s.start.toFixed(2)}–${s.end.toFixed(2)} s = positions ${s.first}–${s.last}`;

// The lab (static/js/lab/lab.js) is mounted below, once the page's helpers are defined: `speechLab` is its controller,
// `lab` its state and `store` its store. Masked spans and ablated cross heads are this page's own (spans of time,
// heads picked one by one).

// The list sent and shown: the lab's builder for the speech family (lab/interventions.js) over this page's spans and
// ablated heads (the lab's activeList(): its active list shows it and its interventions() sends it).
function labelledInterventions() {
  return buildSpeechInterventions(lab, {
    spans: state.spans.map((s) => ({ kind: s.kind, tokens: spanTokens(s), text: `mask ${spanLabel(s)} (${s.kind})`,
      remove: () => state.spans.splice(state.spans.indexOf(s), 1) })),
    ablated: [...state.ablated].map((key) => {
      const [layer, head] = key.split(".").map(Number);
      return { layer, head, remove: () => state.ablated.delete(key) };
    }),
    layer: state.layer, head: state.head, perturbKind: state.perturbKind, nativeBeta: nativeBeta(),
  });
}

const interventions = () => speechLab.interventions();

const nativeBeta = () => state.response?.native_beta ?? NATIVE_BETA;

function showError(message) {
  const box = $("upload-error");
  box.textContent = message;
  box.hidden = !message;
}

// ---- input ---------------------------------------------------------------------------------------------------
async function uploadBlob(blob, name) {
  showError("");
  setStatus(`uploading ${name}…`);
  const form = new FormData();
  form.append("file", blob, name);
  const response = await fetch("/api/audio", { method: "POST", body: form });
  let payload;
  try {
    payload = await readJSON(response);
  } catch (err) {
    if (!(err instanceof ApiError)) throw err;
    showError(err.message);
    setStatus("upload refused", { error: true });
    return;
  }
  await openClip(payload);
}

async function openClip(clip) {
  state.audioId = clip.audio_id;
  state.duration = clip.duration_s;
  state.spans = [];
  state.token = null;
  state.response = state.base = null;
  lab.perturb.on = false; // token and position numbers belong to the clip before
  lab.perturb.tokens.clear();
  store.changed("tokens", { run: false });
  $("clip-info").textContent = `${fmt(clip.duration_s, 3)} s, ${clip.format}, ${clip.sample_rate} Hz, ${clip.channels} channel${clip.channels > 1 ? "s" : ""} (the model hears it at 16 kHz mono)`;
  $("player").src = `/api/audio/${clip.audio_id}/wav`;
  $("span-end").max = $("span-start").max = String(clip.duration_s);
  setStatus("spectrogram…");
  const spec = await getJSON(`/api/audio/${clip.audio_id}/spectrogram`);
  state.mel = spec;
  drawSpectrogram();
  await refresh();
}

function setupInput() {
  const zone = $("drop-zone");
  const input = $("file-input");
  zone.addEventListener("click", () => input.click());
  zone.addEventListener("keydown", (e) => {
    if (e.key === "Enter" || e.key === " ") { e.preventDefault(); input.click(); }
  });
  zone.addEventListener("dragover", (e) => { e.preventDefault(); zone.classList.add("dragover"); });
  zone.addEventListener("dragleave", () => zone.classList.remove("dragover"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("dragover");
    const file = e.dataTransfer.files[0];
    if (file) uploadBlob(file, file.name).catch(fail);
  });
  input.addEventListener("change", () => {
    const file = input.files[0];
    if (file) uploadBlob(file, file.name).catch(fail);
    input.value = "";
  });
  $("sample-button").addEventListener("click", () => openSample());
  $("record-button").addEventListener("click", toggleRecording);
}

let recorder = null;
async function toggleRecording() {
  const button = $("record-button");
  if (recorder) { recorder.stop(); return; }
  if (!navigator.mediaDevices?.getUserMedia || typeof MediaRecorder === "undefined") {
    showError("recording is not available in this browser: choose a file or open the sample");
    return;
  }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (err) {
    showError(`no microphone (${err.name}): choose a file or open the sample instead`);
    return;
  }
  const chunks = [];
  recorder = new MediaRecorder(stream);
  recorder.ondataavailable = (e) => { if (e.data.size) chunks.push(e.data); };
  recorder.onstop = () => {
    stream.getTracks().forEach((t) => t.stop());
    button.textContent = "● Record";
    button.setAttribute("aria-pressed", "false");
    const type = recorder.mimeType || "audio/webm";
    recorder = null;
    uploadBlob(new Blob(chunks, { type }), type.includes("ogg") ? "recording.ogg" : "recording.webm").catch(fail);
  };
  recorder.start();
  button.textContent = "■ Stop";
  button.setAttribute("aria-pressed", "true");
  setStatus(`recording… (at most ${config.max_audio_s} s)`);
  setTimeout(() => recorder?.state === "recording" && recorder.stop(), config.max_audio_s * 1000);
}

// ---- requests ------------------------------------------------------------------------------------------------
async function refresh(attempt = 0) {
  if (!state.audioId) return;
  const ivs = interventions();
  const body = {
    ...modelFields(), audio_id: state.audioId, layers: [state.layer], heads: [state.head],
    encoder_layers: [state.layer], kinds: ["cross", "decoder", "encoder"], encoding: "f16",
    interventions: ivs, compare: ivs.length > 0,
    ...weightingFields(), // P, or every map value-weighted: the cross rows by what each 20 ms frame's value adds
  };
  setStatus(ivs.length ? "running with the interventions…" : "running Whisper…");
  try {
    const [response, base] = await Promise.all([
      postBinary("/api/audio/attention", body, { channel: "audio" }),
      ivs.length ? postBinary("/api/audio/attention", { ...body, interventions: [], compare: false, kinds: ["cross"] }, { channel: "audio-base" }) : null,
    ]);
    state.response = response;
    state.base = base;
    drawAll();
    setStatus(ivs.length ? `${ivs.length} intervention${ivs.length > 1 ? "s" : ""} active` : "ready");
  } catch (err) {
    if (isAbort(err)) return;
    // the model being prepared (fresh start): again when the server says, for as long as it is prepared
    if (beingPrepared(err)) {
      waitForPreparation(err, () => refresh(attempt));
      return;
    }
    // busy (the first use loads the model; a loaded machine may pass the request time limit): try again
    if (err instanceof ApiError && err.status === 503 && attempt < 4) {
      setStatus(`server busy, trying again (${attempt + 1}/4)…`);
      setTimeout(() => refresh(attempt + 1), 1000 * (err.retryAfter || 3));
      return;
    }
    fail(err);
  }
}

// A 503 that says the model (or the sample clip, made by its preparation) is being prepared: not an error to show,
// the next step is to wait; the page tries again after the server's Retry-After, by itself.
const beingPrepared = (err) => err instanceof ApiError && err.status === 503 && /being prepared/.test(err.message);
let preparationTimer = null;
function waitForPreparation(err, again) {
  const wait = err.retryAfter || 10;
  // the server's reason, short enough for the status line: "… is being prepared on this server"
  const said = String(err.detail ?? err.message).split(/ \(|, and its |;/)[0];
  setStatus(`${said} — trying again in ${wait} s, by itself…`);
  document.body.dataset.waiting = "preparation";
  clearTimeout(preparationTimer);
  preparationTimer = setTimeout(() => { delete document.body.dataset.waiting; again(); }, 1000 * wait);
}

// The bundled sample: while the speech model is being prepared it is not made yet (503 + Retry-After): the page waits
// and opens it once it is there; a 404 says why there is none (espeak-ng not installed, or not prepared).
async function openSample() {
  try {
    await openClip(await getJSON("/api/audio/sample"));
  } catch (err) {
    if (beingPrepared(err)) { waitForPreparation(err, openSample); return; }
    fail(err);
  }
}

function fail(err) {
  console.error(err);
  setStatus(err.message || String(err), { error: true });
  if (err instanceof ApiError && err.status === 404) showError(err.message);
}

// ---- drawing -------------------------------------------------------------------------------------------------
function spanShapes(yref = "paper") {
  const shapes = state.spans.map((s) => ({
    type: "rect", xref: "x", yref, x0: s.start, x1: s.end, y0: 0, y1: 1,
    fillcolor: s.kind === "cross" ? "rgba(220,38,38,0.25)" : "rgba(37,99,235,0.25)", line: { width: 1, color: "#b42318" },
  }));
  const p = lab.perturb;
  if (p.on && p.target === "keys" && p.tokens.size) { // the perturbed keys: hatched outline, not a fill
    const ids = [...p.tokens];
    shapes.push({ type: "rect", xref: "x", yref, x0: Math.min(...ids) * POSITION_S, x1: (Math.max(...ids) + 1) * POSITION_S, y0: 0, y1: 1,
      fillcolor: "rgba(245,158,11,0.18)", line: { width: 2, color: "#b54708", dash: "dash" } });
  }
  return shapes;
}

function drawSpectrogram() {
  const spec = state.mel;
  if (!spec) return;
  const times = Array.from({ length: spec.frames }, (_, i) => (i + 0.5) * spec.frame_s);
  const words = state.response?.words ?? [];
  // an invisible scatter row makes the box-select brush report a time range over the heatmap
  const brush = { type: "scatter", mode: "markers", x: times.filter((_, i) => i % 2 === 0), y: times.filter((_, i) => i % 2 === 0).map(() => 40),
    marker: { opacity: 0, size: 4 }, hoverinfo: "skip", showlegend: false };
  const placed = placedWords(words, spec.duration_s);
  const rows = Math.max(1, ...placed.map(({ row }) => row + 1));
  Plotly.react("spectrogram", [
    { type: "heatmap", z: spec.mel, x: times, colorscale: "Electric", showscale: false, hovertemplate: "%{x:.2f} s · mel %{y}<extra></extra>" },
    brush,
  ], {
    margin: { ...TIME_MARGIN, t: 28 + WORD_ROW_PX * (rows - 1), b: 36 }, dragmode: "select", selectdirection: "h",
    xaxis: { title: { text: "time (s)" }, range: [0, spec.duration_s] }, yaxis: { title: { text: "mel" }, fixedrange: true },
    shapes: spanShapes(),
    annotations: placed.map(({ w, index, row }) => ({
      x: (w.start_s + w.end_s) / 2, y: 1.02, yref: "paper", yshift: row * WORD_ROW_PX, text: w.word, showarrow: false,
      captureevents: true, font: { size: 11 }, yanchor: "bottom", name: String(index),
    })),
  }, SPECTRO_PLOT);
  const el = $("spectrogram");
  if (!el.dataset.bound) {
    el.dataset.bound = "1";
    el.on("plotly_selected", (event) => {
      const range = event?.range?.x ?? (event?.points?.length ? [Math.min(...event.points.map((p) => p.x)), Math.max(...event.points.map((p) => p.x))] : null);
      if (!range) return;
      addSpan(Math.max(0, Math.min(...range)), Math.min(state.duration, Math.max(...range)));
      Plotly.relayout(el, { selections: [] }).catch(() => {});
    });
    el.on("plotly_clickannotation", (event) => {
      const word = (state.response?.words ?? [])[Number(event.annotation?.name ?? event.index)];
      if (word) play(word.start_s);
    });
  }
  drawWordStrip();
}

// Every word over the spectrogram, each on the first of a few rows where it does not run into the word before it
// (a short word between two others, "the", was left out when there was one row); with no room on any row, on the row
// that frees up first. {w, index, row}.
const WORD_ROW_PX = 13;
const WORD_ROWS = 3;
function placedWords(words, duration) {
  const width = Math.max(100, ($("spectrogram").clientWidth || 600) - TIME_MARGIN.l - TIME_MARGIN.r);
  const pxPerSecond = width / Math.max(duration, 0.1);
  const ends = Array(WORD_ROWS).fill(-Infinity); // each row's last label's right edge (px)
  return words.map((w, index) => {
    const centre = ((w.start_s + w.end_s) / 2) * pxPerSecond;
    const half = (w.word.length * 6.5) / 2 + 3;
    let row = ends.findIndex((end) => centre - half >= end);
    if (row < 0) row = ends.indexOf(Math.min(...ends));
    ends[row] = centre + half;
    return { w, index, row };
  });
}

function drawWordStrip() {
  const strip = $("word-strip");
  strip.replaceChildren(...(state.response?.words ?? []).map((w) => {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = w.word;
    b.title = `${fmt(w.start_s, 3)}–${fmt(w.end_s, 3)} s: play from here`;
    b.addEventListener("click", () => play(w.start_s));
    return b;
  }));
}

function play(seconds) {
  const player = $("player");
  player.currentTime = seconds;
  player.play().catch(() => {});
}

function crossRows(response, kindField = "cross") {
  const maps = decodeTensor(response.attention[kindField]); // [1][1][N][1500]
  const n = response.clip_positions;
  return maps[0][0].map((row) => Array.from(row).slice(0, n));
}

function tokenLabels(tokens) {
  return tokens.map((t, i) => `${i}:${visibleToken(t)}`);
}

function drawCross() {
  const r = state.response;
  const rows = crossRows(r);
  const times = Array.from({ length: r.clip_positions }, (_, j) => (j + 0.5) * POSITION_S);
  const labels = tokenLabels(r.tokens);
  const name = mapName(r);
  $("cross-title").textContent = `${name === "P" ? "" : `${name} · `}layer ${state.layer}, head ${state.head} · ${r.tokens.length} tokens × ${r.clip_positions} positions of 20 ms`;
  Plotly.react("cross-map", [{
    type: "heatmap", z: rows, x: times, y: labels, colorscale: "Viridis", zmin: 0, showscale: false,
    hovertemplate: `%{y} · %{x:.2f} s · ${name} = %{z:.3f}<extra></extra>`,
  }], {
    margin: { ...TIME_MARGIN, t: 10, b: 36 }, shapes: spanShapes(),
    xaxis: { title: { text: "time (s)" }, range: [0, r.duration_s] },
    yaxis: { autorange: "reversed", type: "category", tickfont: { size: 10 } },
  }, PLOT);
  const el = $("cross-map");
  if (!el.dataset.bound) {
    el.dataset.bound = "1";
    el.on("plotly_click", (event) => {
      const label = event.points?.[0]?.y;
      if (label === undefined) return;
      chooseToken(Number(String(label).split(":")[0]));
    });
  }
  el.dataset.rows = String(rows.length);
}

function chooseToken(index) {
  state.token = index;
  $("token-select").value = String(index);
  drawCurve();
  drawSoftmax().catch(fail);
}

const shownToken = (r) => state.token ?? Math.min(r.tokens.length - 1, 2 + Math.floor((r.tokens.length - 2) / 2));

// The lab's softmax panel on the shown cross head's row of a token. The scores come from the kept run (POST
// /api/runs/{run_id}/window with include_scores: q̂·k̂ as it ran, perturbations included); Whisper's queries are
// pre-scaled by 1/√d, so Ŝ/β₀ is q·k, and p = softmax(β (q·k)) at the shown β is the run's row. The row is
// normalised over all 1,500 keys, the silence after the clip included: those keys are shown as one key whose score
// is their log-sum-exp, (1/β) log Σ exp(β s_j), so the clip's p are exact, the last bar is the mass after the clip,
// and the Jacobian stays readable (a 1,500² heatmap would be mostly that silence).
async function drawSoftmax() {
  const r = state.response;
  if (!r?.run_id) return;
  const q = shownToken(r);
  const n = r.clip_positions;
  const w = await postBinary(`/api/runs/${r.run_id}/window`, {
    layer: state.layer, head: state.head, kind: "cross", rows: [q, q + 1], cols: [0, r.positions], include_scores: true, encoding: "f32",
  }, { channel: "softmax-row" });
  if (state.response !== r) return;
  const beta = betaOf(lab, nativeBeta());
  const all = Array.from(decodeTensor(w.scores)[0], (v) => v / r.native_beta); // q·k over the 1,500 keys
  const masked = new Array(n).fill(false);
  for (const span of state.spans) if (span.kind === "cross") for (const j of spanTokens(span)) if (j < n) masked[j] = true;
  const row = all.slice(0, n);
  const keyLabels = row.map((_, j) => `${fmt(j * POSITION_S, 3)} s`);
  if (n < all.length) {
    const after = all.slice(n).map((v) => beta * v);
    const top = Math.max(...after);
    row.push((top + Math.log(after.reduce((sum, v) => sum + Math.exp(v - top), 0))) / beta);
    masked.push(false);
    keyLabels.push(`after the clip (${all.length - n} keys)`); // their log-sum-exp, as one key
  }
  const scores = [];
  scores[q] = row;
  speechLab.renderSoftmax({ context: {
    tokens: r.tokens, scores, query: q, beta, masked, keyLabels,
    queryLabels: r.tokens.map((t, i) => `${i}: ${visibleToken(t)}`),
    onQuery: (i) => chooseToken(i),
  } });
  $("softmax-panel").dataset.row = String(q);
  $("softmax-panel").dataset.view = document.body.dataset.views; // the response it was drawn for
}

function drawCurve() {
  const r = state.response;
  if (!r) return;
  const token = state.token ?? Math.min(r.tokens.length - 1, 2 + Math.floor((r.tokens.length - 2) / 2));
  const times = Array.from({ length: r.clip_positions }, (_, j) => (j + 0.5) * POSITION_S);
  const traces = [{ type: "scatter", mode: "lines", x: times, y: crossRows(r)[token], name: state.base ? "after" : "P", line: { color: "#3b5bdb" } }];
  if (state.base) traces.unshift({ type: "scatter", mode: "lines", x: times, y: crossRows(state.base)[token], name: "before", line: { color: "#98a2b3", dash: "dot" } });
  Plotly.react("row-curve", traces, {
    margin: { ...TIME_MARGIN, t: 26, b: 64 }, shapes: spanShapes(),
    title: { text: `row ${token} (${visibleToken(r.tokens[token])}) over time`, font: { size: 12 }, x: 0, xanchor: "left", xref: "paper" },
    xaxis: { range: [0, r.duration_s], ticksuffix: " s" }, yaxis: { title: { text: mapName(r) }, rangemode: "tozero" },
    legend: { orientation: "h", y: -0.18, x: 1, xanchor: "right", yanchor: "top" },
  }, PLOT);
}

function wordDiff(before, after) {
  // LCS over words: deleted words struck through, inserted ones marked
  const a = before.split(/\s+/).filter(Boolean);
  const b = after.split(/\s+/).filter(Boolean);
  const lcs = Array.from({ length: a.length + 1 }, () => new Array(b.length + 1).fill(0));
  for (let i = a.length - 1; i >= 0; i--) for (let j = b.length - 1; j >= 0; j--) {
    lcs[i][j] = a[i] === b[j] ? lcs[i + 1][j + 1] + 1 : Math.max(lcs[i + 1][j], lcs[i][j + 1]);
  }
  const out = [];
  let i = 0; let j = 0;
  while (i < a.length || j < b.length) {
    if (i < a.length && j < b.length && a[i] === b[j]) { out.push(["same", a[i]]); i++; j++; }
    else if (j < b.length && (i >= a.length || lcs[i][j + 1] >= lcs[i + 1][j])) { out.push(["ins", b[j]]); j++; }
    else { out.push(["del", a[i]]); i++; }
  }
  return out;
}

function drawTranscript() {
  const r = state.response;
  const box = $("transcript-diff");
  const out = r.effect?.output;
  if (!out) {
    box.replaceChildren(document.createTextNode(r.transcript || "(no speech)"));
    box.dataset.changed = "0";
    Plotly.react("dp-bars", [], { margin: { l: 40, r: 10, t: 10, b: 30 }, xaxis: { visible: false }, yaxis: { visible: false },
      annotations: [{ text: "no interventions: nothing to compare", showarrow: false, font: { color: "#667085" } }] }, PLOT);
    return;
  }
  const parts = wordDiff(out.text_before, out.text_after);
  box.replaceChildren(...parts.flatMap(([kind, word]) => {
    const node = kind === "same" ? document.createElement("span") : document.createElement(kind);
    node.textContent = word;
    return [node, document.createTextNode(" ")];
  }));
  box.dataset.changed = parts.some(([kind]) => kind !== "same") ? "1" : "0";
  // One numbering with the cross-attention map: a token's index in the decoder's sequence, the prompt's special
  // tokens (<|startoftranscript|>, language, task, <|notimestamps|>) counted, so the transcript starts at 2 on tiny.en.
  const first = promptLength(r.tokens);
  const tokens = r.output.tokens.map((t, k) => `${first + k}:${visibleToken(t.token)}`);
  Plotly.react("dp-bars", [{
    type: "bar", x: tokens, y: out.prob_change, marker: { color: out.prob_change.map((d) => (d < 0 ? "#c0342b" : "#1f7a4d")) },
    hovertemplate: "%{x}: Δp = %{y:.3f}<extra></extra>",
  }], {
    margin: { l: 50, r: 10, t: 26, b: 70 }, title: { text: `Δp per token (teacher-forced on the plain transcript) · mean KL ${fmt(out.kl_mean, 3)} nats`, font: { size: 12 } },
    xaxis: { type: "category", tickangle: -60, tickfont: { size: 10 } }, yaxis: { title: { text: "Δp" }, range: [-1, 1] },
  }, PLOT);
}

// The decoder's prompt: its leading special tokens (the transcript's first token follows them).
function promptLength(tokens) {
  const n = tokens.findIndex((t) => !/^<\|.*\|>$/.test(t));
  return n < 0 ? tokens.length : n;
}

function drawAlignment() {
  const ranking = state.response.alignment;
  const table = document.createElement("table");
  table.innerHTML = "<thead><tr><th>#</th><th>head</th><th>monotonicity</th><th>focus</th><th>score</th><th></th></tr></thead>";
  const body = document.createElement("tbody");
  ranking.forEach((item, rank) => {
    const tr = document.createElement("tr");
    if (item.layer === state.layer && item.head === state.head) tr.className = "chosen";
    const cells = [rank + 1, `${item.alignment_head ? "★ " : ""}L${item.layer} H${item.head}`, fmt(item.monotonicity, 3), fmt(item.focus, 3), fmt(item.score, 3)];
    for (const value of cells) {
      const td = document.createElement("td");
      td.textContent = String(value);
      tr.appendChild(td);
    }
    const td = document.createElement("td");
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = "show";
    b.setAttribute("aria-label", `show layer ${item.layer} head ${item.head}`);
    b.addEventListener("click", () => { chooseHead(item.layer, item.head); });
    td.appendChild(b);
    tr.appendChild(td);
    body.appendChild(tr);
  });
  table.appendChild(body);
  $("alignment-table").replaceChildren(table);
}

function drawSelfMaps() {
  const r = state.response;
  const decoder = decodeTensor(r.attention.decoder)[0][0].map((row) => Array.from(row));
  const labels = tokenLabels(r.tokens);
  Plotly.react("decoder-map", [{ type: "heatmap", z: decoder, x: labels, y: labels, colorscale: "Viridis", zmin: 0, showscale: false,
    hovertemplate: `%{y} → %{x}: ${mapName(r)} %{z:.3f}<extra></extra>` }], {
    margin: { l: 90, r: 10, t: 10, b: 90 }, xaxis: { type: "category", tickangle: -60, tickfont: { size: 9 } },
    yaxis: { type: "category", autorange: "reversed", tickfont: { size: 9 } },
  }, PLOT);
  const enc = r.attention.encoder;
  if (!enc) return;
  const overview = decodeTensor(enc.overview)[0][0].map((row) => Array.from(row));
  const step = enc.block_positions * POSITION_S;
  const edges = overview.map((_, i) => (i + 0.5) * step);
  const name = mapName(r) === "P" ? "" : `${mapName(r)} · `;
  $("encoder-title").textContent = `${name}layer ${state.layer}, head ${state.head} · blocks of ${fmt(step * 1000, 3)} ms`;
  drawEncoder(overview, edges, edges, "overview");
  const el = $("encoder-map");
  if (!el.dataset.bound) {
    el.dataset.bound = "1";
    // zooming into a small enough region fetches the exact window of P from the kept run (no model re-run)
    el.on("plotly_relayout", (event) => {
      if (el.dataset.drawing === "1") return;
      if (event["xaxis.autorange"] || event["yaxis.autorange"]) { drawSelfMaps(); return; }
      const x = [event["xaxis.range[0]"], event["xaxis.range[1]"]];
      const y = [event["yaxis.range[0]"], event["yaxis.range[1]"]];
      if (x.some((v) => v === undefined) || y.some((v) => v === undefined)) return;
      encoderWindow(Math.min(...y), Math.max(...y), Math.min(...x), Math.max(...x)).catch(fail);
    });
  }
}

const MAX_WINDOW_SIDE = 300; // encoder positions (6 s) a side: finer than that, the overview is shown

function drawEncoder(z, x, y, mode) {
  const el = $("encoder-map");
  el.dataset.drawing = "1";
  el.dataset.mode = mode;
  Plotly.react(el, [{ type: "heatmap", z, x, y, colorscale: "Viridis", zmin: 0, showscale: false,
    hovertemplate: "query %{y:.2f} s → key %{x:.2f} s: %{z:.2e}<extra></extra>" }], {
    margin: { l: 50, r: 10, t: 10, b: 40 }, xaxis: { title: { text: "key time (s)" }, constrain: "domain" },
    yaxis: { title: { text: "query time (s)" }, autorange: "reversed", scaleanchor: "x" },
  }, PLOT).finally(() => { el.dataset.drawing = "0"; });
}

async function encoderWindow(t0, t1, s0, s1) {
  const r = state.response;
  if (!r?.run_id) return;
  const n = r.clip_positions;
  const clamp = (v) => Math.max(0, Math.min(n, v));
  const rows = [clamp(Math.floor(t0 / POSITION_S)), clamp(Math.ceil(t1 / POSITION_S))];
  const cols = [clamp(Math.floor(s0 / POSITION_S)), clamp(Math.ceil(s1 / POSITION_S))];
  if (rows[1] - rows[0] < 2 || cols[1] - cols[0] < 2) return;
  if (rows[1] - rows[0] > MAX_WINDOW_SIDE || cols[1] - cols[0] > MAX_WINDOW_SIDE) return; // the overview is as good
  const w = await postBinary(`/api/runs/${r.run_id}/window`, {
    layer: state.layer, head: state.head, kind: "encoder", rows, cols, weighting: weightingOf(r), encoding: "f16" },
    { channel: "encoder-window" });
  const z = decodeTensor(w.attention).map((row) => Array.from(row));
  const times = (a, b) => Array.from({ length: b - a }, (_, i) => (a + i + 0.5) * POSITION_S);
  $("encoder-title").textContent = `${mapName(r) === "P" ? "" : `${mapName(r)} · `}layer ${state.layer}, head ${state.head} · exact window ${fmt(rows[0] * POSITION_S, 3)}–${fmt(rows[1] * POSITION_S, 3)} s × ${fmt(cols[0] * POSITION_S, 3)}–${fmt(cols[1] * POSITION_S, 3)} s (double-click: overview)`;
  drawEncoder(z, times(cols[0], cols[1]), times(rows[0], rows[1]), "window");
}

// The lab's list of active interventions (static/js/lab/interventions.js), with this page's items: a row each, its
// scope where it has one (β, the perturbation), × to remove it.
function drawActiveList() {
  speechLab.renderActive();
  drawAblateButton();
}

function drawAblateButton() {
  $("ablate-button").textContent = state.ablated.has(`${state.layer}.${state.head}`) ? "Restore this cross head" : "Ablate this cross head";
}

function drawAll() {
  const r = state.response;
  if (r.shape) setShape(r.shape);
  syncModelControls(r);
  setOptions($("token-select"), r.tokens.map((t, i) => [i, `${i}: ${visibleToken(t)}`]), state.token ?? Math.min(r.tokens.length - 1, 2 + Math.floor((r.tokens.length - 2) / 2)));
  $("warnings").textContent = (r.warnings || []).join(" · ");
  drawSpectrogram();
  drawCross();
  drawCurve();
  drawTranscript();
  drawAlignment();
  drawSelfMaps();
  speechLab.render(r); // the lab's panels follow the response: the β readout, the perturbation's tokens, the active list
  drawAblateButton();
  document.body.dataset.views = String(Number(document.body.dataset.views || 0) + 1); // responses drawn (tests wait on it)
  drawSoftmax().catch(fail);
  document.body.dataset.ready = "1";
}

// ---- controls ------------------------------------------------------------------------------------------------
let timer = null;
function update() {
  drawActiveList();
  clearTimeout(timer);
  timer = setTimeout(refresh, 150);
}

function clearAll() {
  state.spans = [];
  lab.perturb.on = false;
  lab.perturb.tokens.clear();
  lab.beta.logRatio = 0;
  state.ablated.clear();
}

function addSpan(start, end) {
  if (!(end - start >= POSITION_S / 2)) return; // under half a position: a click, not a span
  const span = snapSpan(start, end);
  if (!span) return;
  const kind = $("mask-kind").value;
  if ($("span-action").value === "perturb") { // the span's positions become the perturbation's keys, and it is on
    const p = lab.perturb;
    p.target = "keys";
    p.tokens = new Set(spanTokens(span));
    p.on = true;
    perturbTarget = "keys";
    state.perturbKind = kind;
    store.changed("perturb", { run: false }); // the panels show it; the run follows below
  } else {
    state.spans.push({ kind, ...span });
  }
  update();
}

function chooseHead(layer, head) {
  state.layer = layer;
  state.head = head;
  $("layer-select").value = String(layer);
  $("head-select").value = String(head);
  update();
}

// The model, its task and language (multilingual models: whisper-base where the server prepared it).
// none while whisper-tiny-en is being prepared (`make run`): its option is then listed as not ready, requests get 503
const models = config.models?.length || config.not_ready?.length ? config.models : [{ id: config.model, multilingual: false }];
const multilingual = () => models.find((m) => m.id === state.model)?.multilingual ?? false;
const modelFields = () => ({ model: state.model, task: state.task, language: state.language || null });

function setShape(shape) { // layer and head choices of the model shown (decoder layers; the encoder has as many)
  state.layer = Math.min(state.layer, shape.decoder_layers - 1);
  state.head = Math.min(state.head, shape.heads - 1);
  setOptions($("layer-select"), Array.from({ length: shape.decoder_layers }, (_, l) => [l, `layer ${l}`]), state.layer);
  setOptions($("head-select"), Array.from({ length: shape.heads }, (_, h) => [h, `head ${h}`]), state.head);
}

function syncModelControls(r = null) {
  const many = multilingual();
  $("task-select").disabled = $("language-select").disabled = !many;
  $("task-select").title = $("language-select").title = many ? "" : `${state.model} is English-only: it transcribes English`;
  const select = $("language-select");
  if (r?.languages && select.options.length < 2) {
    select.append(...r.languages.map((code) => new Option(code, code)));
  }
  select.options[0].textContent = !many ? "English" : r && !state.language && r.language
    ? `detect (${r.language}, p = ${fmt(r.language_prob, 2)})` : "detect";
  select.value = state.language;
}

function changeModel() {
  state.model = $("model-select").value;
  if (!multilingual()) { state.task = "transcribe"; state.language = ""; $("task-select").value = "transcribe"; }
  const select = $("language-select");
  while (select.options.length > 1) select.remove(1); // the next response lists this model's languages
  lab.perturb.on = false; // decoder token numbers change with the prompt
  lab.perturb.tokens.clear();
  store.changed("tokens", { run: false });
  state.token = null;
  syncModelControls();
  update();
}

function setupControls() {
  setOptions($("model-select"), models.map((m) => [m.id, m.multilingual ? `${m.id} (multilingual)` : m.id]), state.model);
  addNotReady($("model-select"), config.not_ready);
  if (!models.length) $("model-select").selectedIndex = 0; // shows "… (being prepared…)" rather than an empty menu
  $("model-select").addEventListener("change", changeModel);
  $("task-select").addEventListener("change", (e) => { state.task = e.target.value; update(); });
  $("language-select").addEventListener("change", (e) => { state.language = e.target.value; update(); });
  syncModelControls();
  setShape({ decoder_layers: 4, heads: 6 }); // tiny.en's, until a response gives the model's
  $("layer-select").addEventListener("change", (e) => chooseHead(Number(e.target.value), state.head));
  $("head-select").addEventListener("change", (e) => chooseHead(state.layer, Number(e.target.value)));
  onWeightingChange(() => update());
  $("token-select").addEventListener("change", (e) => chooseToken(Number(e.target.value)));
  $("add-span").addEventListener("click", () => addSpan(Number($("span-start").value), Math.min(state.duration || 30, Number($("span-end").value))));
  $("clear-all").addEventListener("click", () => { clearAll(); store.changed("all"); });
  $("ablate-button").addEventListener("click", () => {
    const key = `${state.layer}.${state.head}`;
    if (state.ablated.has(key)) state.ablated.delete(key); else state.ablated.add(key);
    update();
  });
  $("stream-button").addEventListener("click", streamTranscript);
}

async function streamTranscript() {
  if (!state.audioId) return;
  state.streaming?.abort();
  const controller = new AbortController();
  state.streaming = controller;
  const out = $("stream-out");
  out.textContent = "…";
  try {
    // a job (static/js/views/jobs.js): accepted, a token event per token, done; a cut stream re-attaches, and a
    // newer transcript's abort cancels this one on the server
    const body = { ...modelFields(), audio_id: state.audioId, interventions: interventions() };
    const done = await postJob("/api/audio/transcribe", body, { signal: controller.signal, onEvent: (event) => {
      if ("text" in event) out.textContent = event.text || "…";
    } });
    if ("text" in done) out.textContent = done.text || "…";
    out.dataset.done = "1";
  } catch (err) {
    if (!isAbort(err)) fail(err);
  }
}

// ---- the lab ---------------------------------------------------------------------------------------------------
// The lab module (static/js/lab/lab.js), as on the text and image pages: its β panel on cross-attention (scope: every
// cross layer, this layer or this head), its perturbation panel (the chosen set holds encoder positions, 20 ms each,
// when the target is keys, decoder tokens when it is queries), its softmax panel, the active list and the standalone
// HTML export. Every change of the store re-runs through run() (debounced), unless it needs no run.
const speechLab = mountLab({
  run: () => update(),
  labels: () => state.response?.tokens ?? [],
  selection: () => ({ layer: state.layer, head: state.head, kind: "cross" }),
  shape: () => ({ layers: $("layer-select").options.length, heads: $("head-select").options.length }),
  nativeBeta,
  activeList: labelledInterventions,
}, {
  unit: "token", maxSamples: 1, scopes: { beta: "all", perturb: "all" },
  // the lab's panels this page does not have, and why (tests/browser/test_lab_on_every_page.py)
  lacks: {
    masks: "its masks are spans of time dragged over the spectrogram, and its ablations single cross heads: the page's own controls",
    effect: "the transcript before → after and the Δp per token show what the interventions did",
    summaries: "the alignment table ranks the heads by how their cross-attention follows the speech",
    export: "no JSON/PNG export panel on this page yet",
    url: "the view (clip, spans, heads) is not written into the link yet",
  },
  beta: { where: "cross-attention" },
  perturb: {
    showStrip: (p) => p.target === "queries",
    chosenText: (ids, p) => {
      $("perturb-chosen-label").textContent = p.target === "keys" ? "chosen keys:" : "chosen decoder tokens (queries):";
      if (p.target !== "keys") return null;
      if (!ids.length) return "none: every key (drag a span over the spectrogram with “perturb” chosen)";
      return `${ids.length} positions, ${fmt(ids[0] * POSITION_S, 3)}–${fmt((ids[ids.length - 1] + 1) * POSITION_S, 3)} s of the ${state.perturbKind === "cross" ? "cross-attention" : "encoder"} keys`;
    },
  },
  // A row has a key per 20 ms: the Jacobian shows the 32 keys with the most probability, large enough to read.
  softmax: { jacobianKeys: 32, jacobianHeight: 520 },
  listOptions: { betaRange: false, clearAll },
  // "Download standalone HTML" under the decoder map: the file holds the decoder self-attention (the embedded view
  // draws square token × token maps; the cross-attention, tokens × 1,500 positions, is not in it)
  htmlExport: {
    panel: $("decoder-map").closest("section"),
    body: () => (state.audioId ? { ...modelFields(), audio_id: state.audioId, interventions: interventions(), ...weightingFields() } : null),
    url: "/api/audio/export.html", what: "the decoder self-attention (every layer and head; not the cross-attention)",
    filename: () => `attnlab-${state.model}-decoder-L${state.layer}-H${state.head}.html`,
    shownLayer: () => state.layer, shownHead: () => state.head,
  },
});
const lab = speechLab.state;
const store = speechLab.store;
// Changes that need no run redraw the list; before the first response the lab has no view to re-run for a β move,
// so the page's (debounced) update takes it, as it did every change before the lab was mounted here.
store.subscribe(({ run }) => { if (!run) drawActiveList(); else if (!state.response) update(); });
// keys are positions, queries decoder tokens: a new target starts with none chosen
let perturbTarget = lab.perturb.target;
$("perturb-target").addEventListener("change", () => {
  if (lab.perturb.target === perturbTarget) return;
  perturbTarget = lab.perturb.target;
  lab.perturb.tokens.clear();
  store.changed("perturb", { run: lab.perturb.on });
});
setupInput();
setupControls();
drawActiveList();
if (new URLSearchParams(location.search).has("sample") && config.sample) getJSON("/api/audio/sample").then(openClip).catch(fail);
