// The laboratory's controller: one module mounted by the text, image and speech pages. The state lives in the store
// (store.js: β, masks, causal mask, ablation, perturbation, the shown model), with one change event; the panels are
// small modules mounted on it (β: beta.js, masks: masks.js, perturbation: perturb.js, softmax: softmax.js, standalone
// HTML: export-html.js); this controller subscribes and re-runs or redraws, and draws the effect panel, head
// summaries, export and the shareable URL. The markup is server-rendered (templates/partials/lab.html,
// effect_panel.html).
//
// Every panel of LAB_PANELS is mounted on every page, except those a page says it lacks (options.lacks, each with
// why): a panel added to the lab appears on all pages that support it. What was mounted is listed in
// window.attnlab.lab ({all, panels, lacks}) and <body data-lab-panels>.
//
// The page says how to run and draw, through callbacks:
//   run({settle})      run the model with lab.interventions() (returns a promise); settle > 0: a slider
//                      moves, the page may ask for the shown slice only and repaint lightly
//   redraw({settle})   redraw without a run (view-mode β re-normalises in the browser)
//   labels()           token or patch labels of the shown input
//   selection()        {layer, head, query, li, hi, kind?}: the shown head in model numbering, and its
//                      index (li, hi) in the response's arrays
//   shape()            {layers, heads} of the shown model (kind)
//   nativeBeta()       β₀ of the shown model
//   selectHead(l, h)   select a head (summaries, arrow keys)
//   pageParams()       the page's own part of the link (URLSearchParams)
//   mainFigure()       the element #export-png downloads
//   exportName()       file name stem for downloads
//   modelName()        the model's name for the exported figure's title, optional
//   titleExtra()       more for that title (e.g. the query), optional
//   diff()             {after, before, x, y, title, square} matrices for the P̂ − P figure, or null
//   softmax()          the softmax panel's context ({tokens, scores, query, beta, masked, …}) or null
//   softmaxEmpty()     optional: why the panel has no row when softmax() is null ("a long input …")
//   summaryExtra()     extra parts for the effect summary line (e.g. view-only TV), optional
//   activeExtra()      extra rows for the active-interventions list, optional
//   activeList()       the page's own labelled list where it builds its interventions itself (the speech page:
//                      lab/interventions.js buildSpeechInterventions), optional; else the lab's own
//   builtInCausal()    null, or why the shown attention is causal by itself (a decoder), optional
// selectHead is optional too: without it the arrow keys do not move the head (the speech page).
// Pages read the state from the store: `lab.state.masks.tokens`, `lab.store.subscribe(…)`.
import { setStatus } from "../api.js";
import { byId, onArrowKeys } from "../dom.js";
import { decodedFields, fmt } from "../mathx.js";
import { drawDiff } from "../views/diff.js";
import { drawEffect } from "../views/effects.js";
import { downloadJSON, downloadPNG, installPngButtons } from "./export.js";
import { mountHtmlExport } from "./export-html.js";
import { SETTLE_MS, mountBetaPanel } from "./beta.js";
import { betaIsNative, betaOf, buildInterventions, forServer, renderActiveList } from "./interventions.js";
import { mountMaskPanel } from "./masks.js";
import { mountPerturbPanel } from "./perturb.js";
import { mountSoftmaxPanel } from "./softmax.js";
import { drawSummaries } from "./summaries.js";
import { createLabStore } from "./store.js";
import { labToParams, paramsToLab, readHash, writeHash } from "./urlstate.js";

export { SETTLE_MS };

// The lab's panels, in the order they are mounted: β, key masks/causal/ablation, perturbation, softmax, the effect
// panel (list, summary line, figures, P̂ − P), head summaries, export (JSON, PNG, copy link), standalone HTML, and
// the view in the URL. A new panel goes here; a page without it says so in options.lacks.
export const LAB_PANELS = ["beta", "masks", "perturb", "softmax", "effect", "summaries", "export", "html-export", "url"];

// options: {unit ("token" | "patch"), showTokenStrip, maskScope, pickHint, distanceUnit, maxSamples,
//           outputId, warningsId, diffId,
//           lacks: {panel: why} the panels of LAB_PANELS this page does not have,
//           scopes: {beta, perturb}: the scopes they start with (default: the lab's; the masks': maskScope),
//           beta, perturb, softmax: more options for that panel's builder (beta.js, perturb.js, softmax.js),
//           htmlExport: {body, filename, shownLayer, shownHead, url, what, panel (default #export-panel)}
//                       (export-html.js), required unless the page lacks "html-export",
//           listOptions: more options for the active list (interventions.js renderActiveList: betaRange, clearAll)}
export function mountLab(page, options = {}) {
  const {
    unit = "token", showTokenStrip = true, maskScope = "head", pickHint = "click a token to mask it as a key",
    distanceUnit = "tokens", maxSamples = 64, outputId = "output-effect", warningsId = "warnings", diffId = "diff-heatmap",
    lacks = {}, scopes = {}, beta: betaOptions = {}, perturb: perturbOptions = {},
    softmax: softmaxOptions = {}, htmlExport = null, listOptions = {},
  } = options;
  const unknown = Object.keys(lacks).filter((panel) => !LAB_PANELS.includes(panel));
  if (unknown.length) throw new Error(`mountLab: no lab panel ${unknown.join(", ")} (the panels: ${LAB_PANELS.join(", ")})`);
  const has = (panel) => !(panel in lacks);
  const store = createLabStore();
  const lab = store.state;
  lab.masks.scope = maskScope;
  if (scopes.beta) lab.beta.scope = scopes.beta;
  if (scopes.perturb) lab.perturb.scope = scopes.perturb;
  const modeSelect = byId("mode-select"); // absent: the page has run mode only
  let response = null, request = null;

  const ctx = () => {
    const s = page.selection();
    return { layer: s.layer, head: s.head, kind: s.kind, nativeBeta: page.nativeBeta() };
  };
  const beta = () => betaOf(lab, page.nativeBeta());
  // Scope "layers" covers only layers from … to …; every other scope follows the selection, so it covers the
  // shown head. The shown head's β is the slider's where the scope covers it, else the model's own β₀.
  const betaRange = () => [Math.min(lab.beta.from, lab.beta.to), Math.max(lab.beta.from, lab.beta.to)];
  const betaCovers = (layer = page.selection().layer) => lab.beta.scope !== "layers"
    || (layer >= betaRange()[0] && layer <= betaRange()[1]);
  const shownBeta = () => (betaCovers() ? beta() : page.nativeBeta());
  const samples = () => (lab.perturb.on ? lab.perturb.samples : 1);
  // The list with its labels (_key, _text, …): the page's own where it builds it, else the lab's.
  const labelled = () => page.activeList?.() ?? buildInterventions(lab, ctx());
  const interventions = () => forServer(labelled());
  const viewBeta = () => lab.beta.mode === "view" && !betaIsNative(lab) && betaCovers();
  // The shown head lies outside a β layer range: what to say, and the first layer β changes (or null).
  function betaScope() {
    if (betaIsNative(lab) || betaCovers()) return null;
    const [from, to] = betaRange();
    return { text: `β applies to layers ${from === to ? from : `${from}–${to}`}; this head runs at its native β₀ = ${fmt(page.nativeBeta())}`, layer: from };
  }

  const changed = (key) => store.changed(key);
  const masks = !has("masks") ? null : mountMaskPanel(byId("masks-panel"), store, {
    tokenName: (j) => page.labels()[j] ?? "?", pickHint, builtInCausal: () => page.builtInCausal?.() ?? null,
  });
  const perturb = !has("perturb") ? null
    : mountPerturbPanel(byId("perturb-panel"), store, { showTokenStrip, unit, maxSamples, ...perturbOptions });
  const softmax = !has("softmax") ? null
    : mountSoftmaxPanel(byId("softmax-panel"), { onError: (msg) => setStatus(msg, { error: true }), ...softmaxOptions });
  const betaPanel = !has("beta") ? null : mountBetaPanel(store, {
    nativeBeta: () => page.nativeBeta(), selection: () => page.selection(), shape: () => page.shape(), ...betaOptions,
  });
  if (has("html-export")) {
    if (!htmlExport) throw new Error('mountLab: options.htmlExport is missing (or the page lacks "html-export")');
    mountHtmlExport(htmlExport.panel ?? byId("export-panel"), htmlExport);
  }

  // Run mode: one model run in flight; β moves meanwhile collapse into one run of the latest β.
  let betaRun = null, betaRunWanted = false;
  function runBeta() {
    if (betaRun) { betaRunWanted = true; return; }
    betaRun = Promise.resolve(page.run({ settle: SETTLE_MS })).finally(() => {
      betaRun = null;
      if (betaRunWanted) { betaRunWanted = false; runBeta(); }
    });
  }

  // Every change of the store: a slider move redraws (view mode, re-normalised here: a few ms at 128 tokens) or
  // runs once per settled move; any other change re-runs, unless it says it needs no run.
  store.subscribe(({ what, settle, run }) => {
    if (!run || what === "model") return;
    if (what === "beta" && settle) {
      if (!response) return;
      if (lab.beta.mode === "view") page.redraw({ settle });
      else runBeta();
      return;
    }
    page.run({});
  });

  // Controls mirror the lab state (after a URL restore or an edit in the active list): every panel redraws.
  function syncControls() {
    betaPanel?.update();
    store.changed("all", { run: false });
  }

  // ---- after each response ---------------------------------------------------------------------------
  // derived: what differs between kinds of models: {tv [L][H], entropy [L][H], distance [L][H] | null}.
  // A page without the effect panel, summaries or URL (the speech page) gets its β, perturbation and active list
  // brought up to date; a page without softmax() draws that panel itself (renderSoftmax({context})).
  function render(r, body = null, derived = {}) {
    response = r;
    request = body;
    const { li = 0, hi = 0, layer, head } = page.selection();
    betaPanel?.update(); // β₀ may be known only now
    masks?.update(); // a decoder's built-in causal mask follows the model shown
    perturb?.setTokens(page.labels());
    renderActive();
    if (!has("effect")) { renderRest({ layer, head, derived }); return; }
    // Nothing to compare yet (no intervention ran, no view-only β): the panel keeps its heading, list and summary
    // line, and its figures stay folded away (about 600 px of empty plots otherwise) until an intervention is used.
    const panel = byId("effect-panel");
    const wasUnused = panel?.classList.contains("unused") ?? false;
    const used = Boolean(r.effect) || (page.activeExtra?.() ?? []).length > 0;
    panel?.classList.toggle("unused", !used);
    const tv = derived.tv ?? r.effect?.attention_tv_all ?? r.effect?.attention_tv;
    drawEffect({ outputEl: byId(outputId), hiddenEl: byId("hidden-cosine-plot"), tvEl: byId("tv-plot"), warningsEl: byId(warningsId) },
      r, { tv });
    renderSummaryLine({ li, hi, layer, head, tvAt: derived.tvAt });
    renderDiff();
    renderRest({ layer, head, derived });
    // figures drawn while folded took a default size: fit them to the panel now that it shows
    if (used && wasUnused) for (const plot of panel.querySelectorAll(".js-plotly-plot")) Plotly.Plots.resize(plot);
  }

  // After the effect panel: the head summaries, the softmax panel (where the page gives its context) and the link.
  function renderRest({ layer, head, derived }) {
    const r = response;
    if (has("summaries")) {
      drawSummaries({ entropyEl: byId("summary-entropy"), distanceEl: byId("summary-distance"), tableEl: byId("summary-table") }, {
        entropy: derived.entropy ?? r.entropy, distance: derived.distance ?? r.mean_distance ?? null, distanceUnit,
        layer, head, onSelect: (l, h) => page.selectHead(l, h),
      });
    }
    if (page.softmax) renderSoftmax();
    writeUrl();
  }

  // The active-interventions list: a row each, its scope, × to remove it.
  function renderActive() {
    renderActiveList(byId("interventions-list"), lab, ctx(), {
      tokens: page.labels(), extra: page.activeExtra?.() ?? [], samples: samples(), onChange: changed,
      list: page.activeList?.() ?? null, ...listOptions,
    });
  }

  // The effect summary line: attention TV at the shown head, the last hidden cosine, the output's change.
  function renderSummaryLine({ li, hi, layer, head, tvAt = null }) {
    const e = response?.effect;
    const parts = [...(page.summaryExtra?.() ?? [])];
    if (e) {
      const pm = (x, s) => fmt(x) + (s !== undefined && s !== null ? ` ± ${fmt(s, 2)}` : "");
      const [tv, tvStd] = tvAt ?? [e.attention_tv[li]?.[hi], e.attention_tv_std?.[li]?.[hi]];
      // attention_tv is the mean over every query row (docs/science.md §5): say so, on every page
      parts.push(`TV at L${layer} h${head}, mean over query rows: ${pm(tv, tvStd)}`);
      const last = e.hidden_cosine.length - 1;
      parts.push(`last-layer hidden cosine: ${pm(e.hidden_cosine[last], e.hidden_cosine_std?.[last])}`);
      const o = e.output ?? {};
      if (o.embedding_cosine !== undefined) parts.push(`embedding cosine: ${pm(o.embedding_cosine, o.embedding_cosine_std)}`);
      if (o.cls_cosine !== undefined) parts.push(`CLS cosine: ${pm(o.cls_cosine, o.cls_cosine_std)}`);
      if (typeof o.kl === "number") parts.push(`KL(before ‖ after): ${pm(o.kl, o.kl_std)}`);
      if (o.prob_change !== undefined) parts.push(`Δp(top): ${pm(o.prob_change, o.prob_change_std)}`);
      if (e.samples) parts.push(`n = ${e.samples} samples`);
    }
    const note = perturb?.maskedNote({ applied: true }); // the summary speaks of what ran
    if (note) parts.push(note);
    byId("effect-summary").classList.remove("stale");
    byId("effect-summary").textContent = parts.length ? parts.join("  ·  ")
      : `no interventions active: change β${modeSelect ? " in run mode" : ""}, mask a ${unit}, ablate, or perturb`;
  }

  function renderDiff() {
    const el = byId(diffId);
    if (!el || !response) return;
    const d = page.diff();
    const ratio = byId("diff-kind")?.value === "ratio";
    drawDiff(el, d, { ratio });
  }
  byId("diff-kind")?.addEventListener("change", renderDiff);

  // row: show the selected query row (a click on a map picks a row) rather than the user's score vector.
  // context: the panel's context where the page computes it itself (the speech page fetches a row's scores), else
  // page.softmax()'s.
  function renderSoftmax({ row = false, context = page.softmax?.() ?? null } = {}) {
    if (!softmax) return;
    const c = context;
    if (!c) { softmax.update({ empty: page.softmaxEmpty?.() ?? "this input's response holds no scores" }); return; }
    if (row) softmax.setSource("row");
    softmax.update(c);
  }

  // A request failed: the panels say what the lab holds now, and that the effects shown are older.
  function fail(message) {
    renderActive();
    syncControls();
    const el = byId("effect-summary");
    if (!el) return;
    el.textContent = `the last run failed (${message}): the effects below are from the run before it`;
    el.classList.add("stale");
  }

  // ---- URL ------------------------------------------------------------------------------------------
  function writeUrl() {
    if (!has("url")) return;
    const params = new URLSearchParams();
    for (const [k, v] of page.pageParams()) params.set(k, v);
    labToParams(lab, params);
    writeHash(params);
    byId("share-url").value = window.location.href;
  }

  // The link's parameters, with the lab's part applied (null when the URL holds no view).
  function restore() {
    if (!has("url")) return null;
    const params = readHash();
    if (![...params.keys()].length) return null;
    paramsToLab(params, lab);
    lab.perturb.samples = Math.min(maxSamples, lab.perturb.samples); // the server's limit, from the page config
    if (!modeSelect) lab.beta.mode = "run";
    syncControls();
    return params;
  }

  // The exported figure's title: model, layer, head and β (drawn into the PNG).
  function exportTitle() {
    const { layer, head, kind } = page.selection();
    const b = shownBeta();
    return [page.modelName?.() ?? "", `${kind ? `${kind} attention, ` : ""}layer ${layer}, head ${head}`,
      `β = ${fmt(b)}${betaIsNative(lab) || !betaCovers() ? " (native β₀)" : ` (β₀ = ${fmt(page.nativeBeta())})`}`, page.titleExtra?.() ?? ""]
      .filter(Boolean).join(" · ");
  }

  // ---- export -----------------------------------------------------------------------------------------
  if (has("export")) {
    byId("export-json").addEventListener("click", () => {
      if (!response) return setStatus("nothing to export yet", { error: true });
      downloadJSON({ request, response: decodedFields(response), url: window.location.href }, `${page.exportName()}.json`);
    });
    byId("export-png").addEventListener("click", () => downloadPNG(page.mainFigure(), page.exportName(), { title: exportTitle() })
      .catch((err) => setStatus(`PNG export failed: ${err.message}`, { error: true })));
    byId("copy-link").addEventListener("click", async () => {
      byId("share-url").select();
      try { await navigator.clipboard.writeText(window.location.href); setStatus("link copied"); } catch { setStatus("select the link and copy it"); }
    });
  }

  if (page.selectHead) onArrowKeys((dl, dh) => {
    if (!response) return;
    const { layer, head } = page.selection();
    const { layers, heads } = page.shape();
    const clamp = (v, n) => Math.max(0, Math.min(n - 1, v));
    page.selectHead(clamp(layer + dl, layers), clamp(head + dh, heads));
  });

  // A new input makes token indices meaningless: drop masks and the chosen tokens (and switch a
  // token-targeted perturbation off rather than let it silently become "every token").
  function forgetTokens() {
    lab.masks.tokens.clear();
    if (lab.perturb.tokens.size) { lab.perturb.tokens.clear(); lab.perturb.on = false; }
    store.changed("tokens", { run: false });
  }

  function toggleMask(j) {
    if (lab.masks.tokens.has(j)) lab.masks.tokens.delete(j); else lab.masks.tokens.add(j);
    store.changed("masks");
  }

  syncControls();
  // What this page mounted, for the page's scripts and the browser tests (tests/browser/test_lab_on_every_page.py).
  const mounted = LAB_PANELS.filter(has);
  window.attnlab = { ...(window.attnlab ?? {}), lab: { all: [...LAB_PANELS], panels: mounted, lacks: { ...lacks } } };
  document.body.dataset.labPanels = mounted.join(" ");
  return {
    store, state: lab, // pages read the lab's state here (it was `lab.lab`: the store and the controller had one name)
    beta, shownBeta, betaCovers, betaScope, samples, interventions, viewBeta, render, fail, restore, syncControls, writeUrl, forgetTokens, toggleMask,
    renderActive,
    togglePick: (j) => perturb?.togglePick(j),
    betaIsNative: () => betaIsNative(lab),
    renderSoftmax,
    renderDiff,
    // The request ran with other interventions than the selection needs now (scoped ones follow the head).
    stale: (body) => JSON.stringify(interventions()) !== JSON.stringify(body?.interventions ?? []),
    installPngButtons: (prefix) => installPngButtons(document, prefix),
  };
}
