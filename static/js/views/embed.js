// The embedded view: one attention response's heatmap and head view with the view-mode controls (layer, head,
// β re-normalised from the scores, key masks, colour scale), drawn by the page's own views (heatmap.js,
// headview.js, effects.js, scales.js) and the page's softmax (mathx.js, §2).
//
// Two hosts mount it: the standalone HTML export (attnlab/export.py) with the response inlined and no server, and
// the notebook widget (attnlab/widget.py) with the lab's URL. With a server, run mode re-runs the model there with
// the interventions the text page sends for the shown head (temperature, mask_keys) and draws the effect panel.
import { el, setOptions } from "../dom.js";
import { decodeTensor, fmt, softmaxRow } from "../mathx.js";
import { drawEffect } from "./effects.js";
import { drawHeadView } from "./headview.js";
import { drawHeatmap, paintHeatmap } from "./heatmap.js";
import { SCALES, scaleMatrix } from "./scales.js";

const SETTLE_MS = 150; // as the page (lab.js): cells follow a slider, Plotly redraws once it rests this long
const BETA_RANGE = 3; // the slider is log₁₀(β / the run's β) in [-3, 3], as on the page (log₁₀(β / β₀) there)

const STYLE = `
.attnlab-embed { font: 13px system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d2230; }
.attnlab-embed .ae-title { font-weight: 600; margin: 4px 0; }
.attnlab-embed .ae-controls { display: flex; flex-wrap: wrap; gap: 6px 14px; align-items: center; margin: 6px 0; }
.attnlab-embed .ae-controls input[type=range] { width: 180px; vertical-align: middle; }
.attnlab-embed .ae-mono { font-family: ui-monospace, monospace; }
.attnlab-embed .ae-note { color: #667085; margin: 4px 0; min-height: 1.2em; }
.attnlab-embed .ae-note.error { color: #b42318; }
.attnlab-embed .ae-row { display: flex; flex-wrap: wrap; gap: 12px; align-items: flex-start; }
.attnlab-embed .ae-plot { flex: 1 1 480px; min-width: 320px; height: 460px; position: relative; overflow: hidden; }
.attnlab-embed .ae-headview { flex: 0 0 360px; max-height: 460px; overflow: auto; }
.attnlab-embed .ae-headview svg { width: 100%; }
.attnlab-embed .ae-headview text { font-family: ui-monospace, monospace; font-size: 12px; cursor: pointer; }
.attnlab-embed .ae-headview text.masked { fill: #b42318; text-decoration: line-through; }
.attnlab-embed canvas.fast-cells { position: absolute; pointer-events: none; image-rendering: pixelated; z-index: 1; }
.attnlab-embed .ae-effect { display: flex; flex-wrap: wrap; gap: 12px; }
.attnlab-embed .ae-effect[hidden] { display: none; }
.attnlab-embed .ae-effect dl { flex: 1 1 260px; margin: 0; }
.attnlab-embed .ae-effect dt { color: #667085; font-weight: normal; }
.attnlab-embed .ae-effect dd { margin: 0 0 6px 0; font-family: ui-monospace, monospace; }
.attnlab-embed .ae-effect .ae-small { flex: 1 1 300px; height: 240px; }
`;

// An encoder–decoder's tensor fields hold one tensor per attention kind: the embedded view shows the encoder's.
const ofEncoder = (field) => (field && !Array.isArray(field) && !field.dtype ? field.encoder : field);
const perKind = (field) => Boolean(field && !Array.isArray(field) && !field.dtype);

// What the run did to one head, from the request's interventions (models/interventions.py plan_layer: an item with
// layers/heads null covers every one, a later temperature overrides an earlier one): its β, the keys it masked and
// whether it applied a causal mask. viewKind: the attention kind the view shows ("encoder", "decoder"; an item with
// another kind does not touch it), null for a model with one kind of attention.
export function runSettings(interventions, layer, head, nativeBeta, viewKind = null) {
  const run = { beta: nativeBeta, masked: new Set(), causal: false };
  for (const iv of interventions ?? []) {
    if ((iv.kind ?? null) !== null && iv.kind !== viewKind) continue;
    if ((iv.layers ?? null) !== null && !iv.layers.includes(layer)) continue;
    if ((iv.heads ?? null) !== null && !iv.heads.includes(head)) continue;
    if (iv.op === "temperature") run.beta = Number(iv.beta);
    else if (iv.op === "mask_keys") for (const j of iv.tokens ?? []) run.masked.add(j);
    else if (iv.op === "causal") run.causal = true;
  }
  return run;
}

// response: POST /api/text/attention's answer (nested lists or encoded tensors) for the slices it names
// (response.layers × response.heads); request: the body that asked for it (model, text, … for run mode and the
// title); server: the lab's base URL, or null (run mode is offered only with one).
// Returns {state, redraw, destroy}; the root carries data-state ("ready", "running", "error") for its hosts.
// layer, head: the head shown first, in the model's numbering (default: the response's first).
export function mountEmbed(root, { response, request = null, server = null, layer = null, head = null } = {}) {
  const r = response;
  const tokens = r.tokens ?? [];
  const attention = decodeTensor(ofEncoder(r.attention)); // (L, H, T, T) over the returned slices
  const scores = r.scores ? decodeTensor(ofEncoder(r.scores)) : null; // (L, H, T, T) Ŝ, or null
  const nativeBeta = r.native_beta ?? 1;
  const layers = r.layers ?? attention?.map((_, i) => i) ?? [];
  const heads = r.heads ?? attention?.[0]?.map((_, i) => i) ?? [];

  const ui = buildDom(root, { server: Boolean(server) });
  ui.title.textContent = titleOf(r, request);
  if (!attention) {
    note(`${tokens.length.toLocaleString("en")} tokens: a long input's response holds an overview, not full maps; ask for fewer tokens to embed it`, { error: true });
    root.dataset.state = "error";
    return { state: null, redraw() {}, destroy() {} };
  }
  const causal = r.output?.kind === "next_token" || upperTriangleZero(attention[0][0]);
  const state = { li: Math.max(0, layers.indexOf(layer)), hi: Math.max(0, heads.indexOf(head)), logRatio: 0, mode: "view",
    scale: causal ? "log" : "max", masks: new Set(), run: null };

  setOptions(ui.layer, layers.map((l, i) => [i, `layer ${l}`]), state.li);
  setOptions(ui.head, heads.map((h, i) => [i, `head ${h}`]), state.hi);
  setOptions(ui.scale, SCALES.filter(([v]) => v !== "rowsk"), state.scale);

  // The shown head as the run made it (its β, masks): the map drawn unmoved, and where the slider starts from.
  const viewKind = r.view_kind ?? (perKind(r.attention) ? "encoder" : null);
  const run = () => runSettings(request?.interventions, layers[state.li], heads[state.hi], nativeBeta, viewKind);
  const beta = () => run().beta * 10 ** state.logRatio;
  const betaMoved = () => Math.abs(state.logRatio) > 1e-9;
  // Query row i's keys the browser leaves out when it re-normalises: the run's masked keys and the page's, and j > i
  // on a causal map (the model's or the run's causal mask).
  const maskedRow = (i, n, shown = run()) => Array.from({ length: n },
    (_, j) => state.masks.has(j) || shown.masked.has(j) || ((causal || shown.causal) && j > i));

  // The shown head's P: the response's; in view mode with β moved or keys masked, softmax(β·Ŝ) over the kept keys
  // (§2); in run mode, the server's run with the interventions once it has answered.
  function shownAttention() {
    const P = attention[state.li][state.hi];
    if (state.mode === "run") return state.run?.P ?? P;
    if (!(betaMoved() || state.masks.size) || !scores) return P;
    const S = scores[state.li][state.hi];
    const shown = run(), b = beta();
    return S.map((row, i) => softmaxRow(row, b, maskedRow(i, row.length, shown)));
  }

  // Grey cells: forbidden by a mask (the causal mask, masked keys), not near-zero attention.
  function maskedCells(n, m) {
    const shown = run();
    const cells = Array.from({ length: n }, (_, i) => maskedRow(i, m, shown));
    return cells.some((row) => row.some(Boolean)) ? cells : null;
  }
  function maskLegend() {
    const parts = [], shown = run();
    const keys = (set) => [...set].sort((a, b) => a - b).join(", ");
    if (causal || shown.causal) parts.push(`causal${causal ? "" : " (the run's mask)"}: key j > query i`);
    if (shown.masked.size) parts.push(`masked in the run: key${shown.masked.size > 1 ? "s" : ""} ${keys(shown.masked)}`);
    if (state.masks.size) parts.push(`masked key${state.masks.size > 1 ? "s" : ""} ${keys(state.masks)}`);
    return `masked, P = 0: ${parts.join("; ")}`;
  }
  // The readout beside the slider: the β drawn, and what it is relative to (the run's β for this head, β₀).
  function betaReadout() {
    const runBeta = run().beta, ofRun = Math.abs(runBeta - nativeBeta) > 1e-12 * nativeBeta;
    if (betaMoved()) return `β = ${fmt(beta())} (the run's β = ${fmt(runBeta)}${ofRun ? `, β₀ = ${fmt(nativeBeta)}` : ", native β₀"})`;
    return `β = ${fmt(runBeta)}${ofRun ? ` (the run's temperature; β₀ = ${fmt(nativeBeta)})` : " (native β₀)"}`;
  }

  let settleTimer = null;
  // settle > 0: a slider moves; the heatmap's cells are repainted now and Plotly redraws once it rests.
  function redraw({ settle = 0 } = {}) {
    const P = shownAttention();
    const forbidden = maskedCells(P.length, tokens.length);
    const scale = scaleMatrix(P, state.scale);
    ui.readout.textContent = betaReadout();
    clearTimeout(settleTimer);
    if (settle > 0 && paintHeatmap(ui.heatmap, scale.z, tokens, tokens, forbidden)) {
      settleTimer = setTimeout(() => redraw(), settle);
      return;
    }
    const { z, ...range } = scale;
    const where = `layer ${layers[state.li]}, head ${heads[state.hi]} · β = ${fmt(beta())}`;
    const how = state.mode === "run" ? (state.run ? " (run on the server)" : " (running…)") : scores && (betaMoved() || state.masks.size) ? " (view: re-normalised here)" : "";
    drawHeatmap(ui.heatmap, z, tokens, { ...range, masked: forbidden, maskLegend: maskLegend(), title: where + how });
    ui.heatmap.dataset.beta = String(beta());
    ui.heatmap.dataset.layer = String(layers[state.li]);
    ui.heatmap.dataset.head = String(heads[state.hi]);
    ui.heatmap.dataset.scale = state.scale;
    drawHeadView(ui.headview, P, tokens, { masked: state.masks, onToggleKey: toggleMask });
    showMaskNote();
    root.dispatchEvent(new CustomEvent("attnlab:drawn", { detail: { beta: beta(), layer: layers[state.li], head: heads[state.hi] } }));
  }

  function note(text, { error = false } = {}) {
    ui.note.textContent = text;
    ui.note.classList.toggle("error", error);
  }
  function showMaskNote() {
    // β and masks in view mode re-normalise the scores: without them (encoder–decoders, value-weighted maps, a
    // response asked without include_scores) they are off, and the note says why
    const viewOnly = state.mode === "view" && !scores;
    ui.beta.disabled = viewOnly;
    ui.betaReset.disabled = viewOnly;
    if (viewOnly) {
      note(`this ${server ? "result" : "file"} holds no scores (include_scores): the maps are the run's; view-mode β and key masks need the scores${server ? " (run mode re-runs on the lab)" : ""}`);
      return;
    }
    if (ui.note.classList.contains("error") && root.dataset.state === "error") return;
    note(state.masks.size ? `masked keys: ${[...state.masks].sort((a, b) => a - b).map((j) => `${j}:${tokens[j]}`).join(", ")} (click a key in the head view to unmask)`
      : "click a key token in the head view to mask it");
  }

  function toggleMask(j) {
    if (state.mode === "view" && !scores) return; // nothing to re-normalise (showMaskNote says so)
    if (state.masks.has(j)) state.masks.delete(j); else state.masks.add(j);
    changed();
  }

  // Run mode: the page's interventions for the shown head, the model re-run on the server (compare: the effect).
  let runController = null;
  async function runOnServer() {
    runController?.abort();
    const mine = new AbortController();
    runController = mine;
    const scope = { layers: [layers[state.li]], heads: [heads[state.hi]] };
    const ours = [];
    if (betaMoved()) ours.push({ op: "temperature", beta: beta(), ...scope });
    if (state.masks.size) ours.push({ op: "mask_keys", tokens: [...state.masks].sort((a, b) => a - b), ...scope });
    const interventions = [...(request?.interventions ?? []), ...ours];
    const body = { ...runFields(request, r), layers: scope.layers, heads: scope.heads, include_scores: false,
      interventions, compare: ours.length > 0, encoding: "f32" };
    root.dataset.state = "running";
    state.run = null;
    redraw();
    try {
      const res = await fetch(`${server.replace(/\/$/, "")}/api/text/attention`, {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal: mine.signal,
      });
      const answer = await res.json().catch(() => ({ detail: res.statusText }));
      if (!res.ok) throw new Error(`${res.status}: ${typeof answer.detail === "string" ? answer.detail : JSON.stringify(answer.detail)}`);
      if (runController !== mine) return;
      state.run = { P: decodeTensor(ofEncoder(answer.attention))[0][0] };
      root.dataset.state = "ready";
      redraw();
      showEffect(answer);
    } catch (err) {
      if (err.name === "AbortError" || runController !== mine) return;
      root.dataset.state = "error";
      // fetch() rejects with a TypeError when the lab is down or its CORS answer leaves this page's origin out
      const origin = window.location.origin;
      note(err instanceof TypeError
        ? `the lab at ${server} could not be reached from this page (${origin}): is it running, and does it allow this origin? `
          + `Start it with ATTNLAB_CORS_ORIGINS='["${origin}"]' (or Lab.start(settings={"cors_origins": ["${origin}"]}))`
        : `the lab at ${server} answered: ${err.message}`, { error: true });
    }
  }

  function showEffect(answer) {
    ui.effect.hidden = false;
    drawEffect({ outputEl: ui.effectOutput, hiddenEl: ui.effectHidden, tvEl: ui.effectTv, warningsEl: ui.effectWarnings }, answer);
  }

  // Something changed: view mode redraws here; run mode asks the server once the slider rests.
  function changed({ settle = 0 } = {}) {
    if (state.mode === "view") { ui.effect.hidden = true; redraw({ settle }); return; }
    clearTimeout(runTimer);
    if (settle > 0) { runTimer = setTimeout(runOnServer, settle); return; }
    runOnServer();
  }
  let runTimer = null;

  ui.layer.addEventListener("change", () => { state.li = Number(ui.layer.value); changed(); });
  ui.head.addEventListener("change", () => { state.hi = Number(ui.head.value); changed(); });
  ui.scale.addEventListener("change", () => { state.scale = ui.scale.value; redraw(); });
  ui.beta.addEventListener("input", () => { state.logRatio = Number(ui.beta.value); changed({ settle: SETTLE_MS }); });
  ui.betaReset.addEventListener("click", () => { state.logRatio = 0; ui.beta.value = "0"; changed(); });
  ui.mode?.addEventListener("change", () => {
    state.mode = ui.mode.value;
    state.run = null;
    root.dataset.state = "ready";
    note("");
    changed();
  });

  // A notebook's output area settles its width after the first draw: the figure follows its box (Plotly's own
  // `responsive` follows the window only), so the colour bar is never cut off or drawn over the head view.
  const resize = new ResizeObserver(() => { if (ui.heatmap.data) Plotly.Plots.resize(ui.heatmap); });
  resize.observe(ui.heatmap);

  root.dataset.state = "ready";
  redraw();
  return { state, redraw, destroy: () => { runController?.abort(); clearTimeout(settleTimer); clearTimeout(runTimer); resize.disconnect(); } };
}

// The request fields that say what ran (model and input), for run mode's requests.
function runFields(request, response) {
  const fields = { model: request?.model ?? response.model, text: request?.text };
  for (const name of ["text_pair", "position", "chat", "target"]) if (request?.[name] !== undefined && request[name] !== null) fields[name] = request[name];
  return fields;
}

function titleOf(r, request) {
  const text = request?.text ?? r.tokens?.join(" ") ?? "";
  const short = text.length > 120 ? `${text.slice(0, 117)}…` : text;
  return `${r.model ?? request?.model ?? "attnlab"} · ${r.tokens?.length ?? 0} tokens · “${short}”`;
}

// A causal map is zero above its diagonal in every row (the mask, not attention).
function upperTriangleZero(P) {
  if (!P || P.length < 2) return false;
  return P.every((row, i) => row.every((p, j) => j <= i || p === 0));
}

function buildDom(root, { server }) {
  const select = (label, role) => {
    const s = el("select", { className: "ae-select" });
    s.dataset.role = role;
    s.setAttribute("aria-label", label);
    return [el("label", {}, `${label} `, s), s];
  };
  const [layerBox, layer] = select("layer", "layer");
  const [headBox, head] = select("head", "head");
  const [scaleBox, scale] = select("colour", "scale");
  const beta = el("input", { type: "range", min: String(-BETA_RANGE), max: String(BETA_RANGE), step: "0.01", value: "0" });
  beta.dataset.role = "beta";
  beta.setAttribute("aria-label", "log10 of β / the run's β");
  const readout = el("span", { className: "ae-mono" });
  const betaReset = el("button", { type: "button", textContent: "reset β", title: "back to the run's β (the model's β₀ where the run set no temperature)" });
  betaReset.dataset.role = "beta-reset";
  let mode = null, modeBox = null;
  if (server) {
    [modeBox, mode] = select("mode", "mode");
    setOptions(mode, [["view", "view (re-normalise here)"], ["run", "run (re-run on the lab, show effects)"]], "view");
  }
  const heatmap = el("div", { className: "ae-plot" });
  heatmap.dataset.role = "heatmap";
  const headview = el("div", { className: "ae-headview" });
  headview.dataset.role = "headview";
  const effectOutput = el("dl"), effectHidden = el("div", { className: "ae-small" }), effectTv = el("div", { className: "ae-small" });
  const effectWarnings = el("p", { className: "ae-note" });
  const effect = el("div", { className: "ae-effect", hidden: true }, effectOutput, effectHidden, effectTv, effectWarnings);
  effect.dataset.role = "effect";
  const title = el("div", { className: "ae-title" });
  const note = el("p", { className: "ae-note", role: "status" });
  note.dataset.role = "note";
  const controls = el("div", { className: "ae-controls" }, layerBox, headBox,
    el("label", {}, "β ", beta), readout, betaReset, ...(modeBox ? [modeBox] : []), scaleBox);
  root.classList.add("attnlab-embed");
  root.replaceChildren(el("style", { textContent: STYLE }), title, controls, note, el("div", { className: "ae-row" }, heatmap, headview), effect);
  return { title, layer, head, scale, beta, readout, betaReset, mode, heatmap, headview, note, effect, effectOutput, effectHidden, effectTv, effectWarnings };
}
