// The laboratory's controller: one module mounted by the text and image pages (the speech page mounts the same β,
// perturbation and softmax panels on its own store). The state lives in the store (store.js: β, masks, causal mask,
// ablation, perturbation, the shown model), with one change event; the panels are small modules mounted on it (β:
// beta.js, masks: masks.js, perturbation: perturb.js, softmax: softmax.js); this controller subscribes and re-runs
// or redraws, and draws the effect panel, head summaries, export and the shareable URL. The markup is
// server-rendered (templates/partials/lab.html, effect_panel.html).
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
//   builtInCausal()    null, or why the shown attention is causal by itself (a decoder), optional
// Pages read the state from the store: `lab.state.masks.tokens`, `lab.store.subscribe(…)`.
import { setStatus } from "../api.js";
import { byId, onArrowKeys } from "../dom.js";
import { decodedFields, fmt } from "../mathx.js";
import { drawDiff } from "../views/diff.js";
import { drawEffect } from "../views/effects.js";
import { downloadJSON, downloadPNG, installPngButtons } from "./export.js";
import { SETTLE_MS, mountBetaPanel } from "./beta.js";
import { betaIsNative, betaOf, buildInterventions, forServer, renderActiveList } from "./interventions.js";
import { mountMaskPanel } from "./masks.js";
import { mountPerturbPanel } from "./perturb.js";
import { mountSoftmaxPanel } from "./softmax.js";
import { drawSummaries } from "./summaries.js";
import { createLabStore } from "./store.js";
import { labToParams, paramsToLab, readHash, writeHash } from "./urlstate.js";

export { SETTLE_MS };

// options: {unit ("token" | "patch"), showTokenStrip, maskScope, pickHint, distanceUnit, maxSamples,
//           outputId, warningsId, diffId}
export function mountLab(page, options = {}) {
  const {
    unit = "token", showTokenStrip = true, maskScope = "head", pickHint = "click a token to mask it as a key",
    distanceUnit = "tokens", maxSamples = 64, outputId = "output-effect", warningsId = "warnings", diffId = "diff-heatmap",
  } = options;
  const store = createLabStore();
  const lab = store.state;
  lab.masks.scope = maskScope;
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
  const interventions = () => forServer(buildInterventions(lab, ctx()));
  const viewBeta = () => lab.beta.mode === "view" && !betaIsNative(lab) && betaCovers();
  // The shown head lies outside a β layer range: what to say, and the first layer β changes (or null).
  function betaScope() {
    if (betaIsNative(lab) || betaCovers()) return null;
    const [from, to] = betaRange();
    return { text: `β applies to layers ${from === to ? from : `${from}–${to}`}; this head runs at its native β₀ = ${fmt(page.nativeBeta())}`, layer: from };
  }

  const changed = (key) => store.changed(key);
  const masks = mountMaskPanel(byId("masks-panel"), store, {
    tokenName: (j) => page.labels()[j] ?? "?", pickHint, builtInCausal: () => page.builtInCausal?.() ?? null,
  });
  const perturb = mountPerturbPanel(byId("perturb-panel"), store, { showTokenStrip, unit, maxSamples });
  const softmax = mountSoftmaxPanel(byId("softmax-panel"), { onError: (msg) => setStatus(msg, { error: true }) });
  const betaPanel = mountBetaPanel(store, { nativeBeta: () => page.nativeBeta(), selection: () => page.selection(), shape: () => page.shape() });

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
    betaPanel.update();
    store.changed("all", { run: false });
  }

  // ---- after each response ---------------------------------------------------------------------------
  // derived: what differs between kinds of models: {tv [L][H], entropy [L][H], distance [L][H] | null}.
  function render(r, body, derived = {}) {
    response = r;
    request = body;
    const { li = 0, hi = 0, layer, head } = page.selection();
    betaPanel.update(); // β₀ may be known only now
    masks.update(); // a decoder's built-in causal mask follows the model shown
    perturb.setTokens(page.labels());
    renderActiveList(byId("interventions-list"), lab, ctx(), {
      tokens: page.labels(), extra: page.activeExtra?.() ?? [], samples: samples(), onChange: changed,
    });
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
    drawSummaries({ entropyEl: byId("summary-entropy"), distanceEl: byId("summary-distance"), tableEl: byId("summary-table") }, {
      entropy: derived.entropy ?? r.entropy, distance: derived.distance ?? r.mean_distance ?? null, distanceUnit,
      layer, head, onSelect: (l, h) => page.selectHead(l, h),
    });
    renderSoftmax();
    writeUrl();
    // figures drawn while folded took a default size: fit them to the panel now that it shows
    if (used && wasUnused) for (const plot of panel.querySelectorAll(".js-plotly-plot")) Plotly.Plots.resize(plot);
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
    const note = perturb.maskedNote({ applied: true }); // the summary speaks of what ran
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
  function renderSoftmax({ row = false } = {}) {
    const c = page.softmax();
    if (!c) { softmax.update({ empty: page.softmaxEmpty?.() ?? "this input's response holds no scores" }); return; }
    if (row) softmax.setSource("row");
    softmax.update(c);
  }

  // A request failed: the panels say what the lab holds now, and that the effects shown are older.
  function fail(message) {
    renderActiveList(byId("interventions-list"), lab, ctx(), {
      tokens: page.labels(), extra: page.activeExtra?.() ?? [], samples: samples(), onChange: changed,
    });
    syncControls();
    const el = byId("effect-summary");
    el.textContent = `the last run failed (${message}): the effects below are from the run before it`;
    el.classList.add("stale");
  }

  // ---- URL ------------------------------------------------------------------------------------------
  function writeUrl() {
    const params = new URLSearchParams();
    for (const [k, v] of page.pageParams()) params.set(k, v);
    labToParams(lab, params);
    writeHash(params);
    byId("share-url").value = window.location.href;
  }

  // The link's parameters, with the lab's part applied (null when the URL holds no view).
  function restore() {
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

  onArrowKeys((dl, dh) => {
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
  return {
    store, state: lab, // pages read the lab's state here (it was `lab.lab`: the store and the controller had one name)
    beta, shownBeta, betaCovers, betaScope, samples, interventions, viewBeta, render, fail, restore, syncControls, writeUrl, forgetTokens, toggleMask,
    togglePick: (j) => perturb.togglePick(j),
    betaIsNative: () => betaIsNative(lab),
    renderSoftmax,
    renderDiff,
    // The request ran with other interventions than the selection needs now (scoped ones follow the head).
    stale: (body) => JSON.stringify(interventions()) !== JSON.stringify(body?.interventions ?? []),
    installPngButtons: (prefix) => installPngButtons(document, prefix),
  };
}
