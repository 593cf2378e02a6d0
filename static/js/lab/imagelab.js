// The laboratory on the image page: masks/ablation, perturbations of patches, the effect panel with
// the P̂ − P map, head summaries, the softmax panel, export and a shareable URL, mounted into one
// container. image.js keeps its own upload, overlay, β slider and model grid, and calls:
//   interventions() / samples()  while building a request,
//   update(response, body)       after each response (fetches P without interventions when needed),
//   render()                     after each redraw (selection changes),
//   loadFailed(err)              when a load fails (404 → a re-upload prompt),
//   togglePick(token)            when a patch is clicked in "perturb" mode,
//   restoreInto(state)           at start: fills the page state from the URL (true if it did).
// The page's masked-patch Set is shared with the lab (lab.masks.tokens), so both stay in step.
import { postJSON, setStatus } from "../api.js";
import { decodeTensor, fmt } from "../mathx.js";
import { drawEffect } from "../views/effects.js";
import { downloadJSON, downloadPNG, installPngButtons, pngButton } from "./export.js";
import { buildInterventions, createLab, renderActiveList, wire } from "./interventions.js";
import { mountMaskPanel } from "./masks.js";
import { mountPerturbPanel } from "./perturb.js";
import { mountSoftmaxPanel } from "./softmax.js";
import { drawSummaries } from "./summaries.js";
import { intParam, labToParams, paramsToLab, readHash, writeHash } from "./urlstate.js";

const PLOT = { responsive: true, displaylogo: false };

const SKELETON = `
<div class="row">
  <section class="panel grow" id="masks-panel"></section>
  <section class="panel grow" id="perturb-panel"></section>
</div>
<div id="effect-panel-slot"></div>
<div class="row">
  <section class="panel grow" id="summaries-panel">
    <h2>Head summaries <small>SPEC §6; after the interventions; click a cell or row to select that head</small></h2>
    <div class="row">
      <div class="grow"><div class="fig-tools" data-png-for="summary-entropy"></div><div id="summary-entropy" class="plot" style="height:260px"></div></div>
      <div class="grow"><div class="fig-tools" data-png-for="summary-distance"></div><div id="summary-distance" class="plot" style="height:260px"></div></div>
    </div>
    <p class="help">Entropy: −Σ_j P[i,j] log P[i,j], averaged over query rows. Mean attention distance: Σ_j P[i,j]·‖pos_i − pos_j‖ over patch keys, averaged over patch queries, in input pixels. Click a column heading to sort.</p>
    <div class="table-scroll"><table id="summary-table" class="summary-table"></table></div>
  </section>
  <section class="panel grow" id="softmax-panel"></section>
</div>
<section class="panel" id="export-panel">
  <h2>Export and share</h2>
  <div id="reupload" class="reupload" hidden>
    <b>The server no longer holds the image of this link.</b> Choose the same file again to restore the view:
    <input type="file" id="reupload-input" accept="image/png,image/jpeg,image/webp">
  </div>
  <div class="controls">
    <button id="export-json" type="button">Download response (JSON)</button>
    <button id="export-png" type="button">Download overlay (PNG)</button>
    <button id="copy-link" type="button">Copy link to this view</button>
    <input id="share-url" type="text" readonly style="flex:1 1 400px" aria-label="link to this view">
  </div>
  <p class="help">The link encodes model, image id (example photos restore at once; an uploaded photo must still be on the server, or be chosen again), layer, head, query, β, masks and perturbations. Every figure has its own PNG button.</p>
</section>`;

// page: {state, reload(), selectHead(layer, head), beta() → β of the shown head, pageParams() → URLSearchParams}
export function mountImageLab(container, page) {
  // The effect panel is rendered by the server (templates/partials/effect_panel.html, shared with the text
  // page) inside the container: keep it, lay out the other panels, and put it back in its place.
  const effectPanel = container.querySelector("#effect-panel");
  if (!effectPanel) throw new Error("the page has no #effect-panel (templates/partials/effect_panel.html)");
  container.innerHTML = SKELETON;
  container.querySelector("#effect-panel-slot").replaceWith(effectPanel);
  const $ = (id) => container.querySelector(`#${id}`);
  const lab = createLab();
  lab.masks.tokens = page.state.masked; // shared with the page's click/brush masking
  lab.masks.scope = "all";
  let response = null, request = null, base = null;

  const onChange = () => page.reload();
  const labels = () => response?.tokens ?? [];
  const masks = mountMaskPanel($("masks-panel"), lab, {
    onChange, tokenName: (j) => labels()[j] ?? "?",
    pickHint: "choose \"mask / unmask it as a key\" under \"Click a patch to\" and click patches (or brush a region)",
  });
  const perturb = mountPerturbPanel($("perturb-panel"), lab, { onChange, showTokenStrip: false, unit: "patch" });
  perturb.setTokens([]);
  const softmax = mountSoftmaxPanel($("softmax-panel"), { onError: (msg) => setStatus(msg, { error: true }) });
  installPngButtons(container, "attnlab-image");
  for (const id of ["overlay", "model-grid", "predictions", "distance-plot"]) { // the page's own figures
    const plot = document.getElementById(id);
    const heading = plot?.closest("section")?.querySelector("h2");
    if (heading && !heading.querySelector(".export-png")) heading.append(" ", pngButton(plot, `attnlab-image-${id}`));
  }

  const selection = () => {
    const s = page.state;
    const layer = response ? response.layers[s.layer] ?? s.layer : s.layer;
    const head = response ? response.heads[s.head] ?? s.head : s.head;
    return { layer, head, query: s.query };
  };
  const ctx = () => ({ ...selection(), nativeBeta: response?.native_beta ?? 1 });
  // A new image, model or resolution makes chosen patch indices meaningless: drop them.
  let lastKey = null;
  const inputKey = () => `${page.state.model}|${page.state.imageId}|${page.state.sizeFactor}`;
  const interventions = () => {
    if (lastKey !== null && inputKey() !== lastKey && (lab.perturb.tokens.size || lab.perturb.on)) {
      lab.perturb.tokens.clear();
      lab.perturb.on = false;
      perturb.update();
    }
    return wire(buildInterventions(lab, ctx()).filter((iv) => iv.op !== "temperature"));
  };
  const labOnly = (list) => JSON.stringify(list.filter((iv) => iv.op !== "temperature"));
  const samples = () => (lab.perturb.on ? lab.perturb.samples : 1);

  function update(r, body) {
    response = r;
    request = body;
    lastKey = inputKey();
    base = null;
    $("reupload").hidden = true;
    if (body.interventions.length) {
      // Not awaited: the page draws at once; the P̂ − P map follows when P (a cached run) arrives.
      postJSON("/api/image/attention", { ...body, interventions: [], compare: false, samples: 1, include_scores: false },
        { channel: "image-base" })
        .then((b) => {
          if (response !== r) return;
          base = decodeTensor(b.attention);
          const s = page.state;
          renderDiff(s.layer, s.head, selection().layer, selection().head);
        })
        .catch((err) => { if (err.name !== "AbortError") setStatus(`P before the interventions: ${err.message}`, { error: true }); });
    }
  }

  function render() {
    if (!response) return;
    const r = response;
    // Scoped interventions follow the selected head: a selection change the page only redrew needs a run.
    if (request && labOnly(interventions()) !== labOnly(request.interventions)) { page.reload(); return; }
    const { layer, head, query } = selection();
    const li = page.state.layer, hi = page.state.head;
    masks.update();
    perturb.setTokens(r.tokens);
    renderActiveList($("interventions-list"), lab, ctx(), {
      tokens: r.tokens, samples: samples(), onChange,
      extra: Math.abs(page.state.logBeta) > 1e-9 ? [`temperature β = ${fmt(page.beta())} (the slider above, scope: ${document.getElementById("beta-scope")?.value ?? "?"})`] : [],
    });
    drawEffect({ outputEl: $("lab-output"), hiddenEl: $("hidden-cosine-plot"), tvEl: $("tv-plot"), warningsEl: $("lab-warnings") }, r);
    const e = r.effect;
    const parts = [];
    if (e) {
      const pm = (x, s) => fmt(x) + (s !== undefined && s !== null ? ` ± ${fmt(s, 2)}` : "");
      parts.push(`TV at L${layer} h${head}: ${pm(e.attention_tv[li]?.[hi], e.attention_tv_std?.[li]?.[hi])}`);
      const last = e.hidden_cosine.length - 1;
      parts.push(`last-layer hidden cosine: ${pm(e.hidden_cosine[last], e.hidden_cosine_std?.[last])}`);
      if (e.output?.kl !== undefined) parts.push(`KL(before ‖ after): ${pm(e.output.kl, e.output.kl_std)}`);
      if (e.output?.cls_cosine !== undefined) parts.push(`CLS cosine: ${pm(e.output.cls_cosine, e.output.cls_cosine_std)}`);
      if (e.samples) parts.push(`n = ${e.samples} samples`);
    }
    $("effect-summary").textContent = parts.length ? parts.join("  ·  ") : "no interventions active: move β, mask patches, ablate, or perturb";
    renderDiff(li, hi, layer, head);
    drawPicks();
    drawSummaries({ entropyEl: $("summary-entropy"), distanceEl: $("summary-distance"), tableEl: $("summary-table") }, {
      entropy: r.entropy, distance: r.mean_distance ?? null, distanceUnit: "px", layer, head,
      onSelect: (l, h) => page.selectHead(r.layers.indexOf(l), r.heads.indexOf(h)),
    });
    if (r.scores) {
      const scores = decodeTensor(r.scores);
      const row = scores[li][hi][0];
      const masked = r.tokens.map((_, j) => lab.masks.tokens.has(j) || (lab.causal.on && j > query));
      softmax.update({
        tokens: r.tokens, scores: [row], query: 0, queryLabels: [`${query}: ${r.tokens[query]} (the query patch)`],
        keyLabels: r.tokens.map((t, j) => `${j}:${t}`), beta: page.beta(), masked,
      });
    }
    writeUrl();
  }

  // The patches chosen for the perturbation, as orange rings over the page's overlay figure.
  function drawPicks() {
    const el = document.getElementById("overlay");
    if (!el || !el.data || !response) return;
    const [, cols] = response.grid;
    const prefix = response.prefix_tokens;
    const picked = [...lab.perturb.tokens].filter((t) => t >= prefix).map((t) => [Math.floor((t - prefix) / cols), (t - prefix) % cols]);
    const x = picked.map((p) => p[1]), y = picked.map((p) => p[0]);
    const index = el.data.findIndex((t) => t.name === "perturbed patches");
    if (index >= 0) {
      Plotly.restyle(el, { x: [x], y: [y] }, [index]);
    } else {
      Plotly.addTraces(el, {
        type: "scatter", mode: "markers", name: "perturbed patches", x, y, hoverinfo: "skip", showlegend: false,
        marker: { symbol: "circle-open", size: Math.max(8, 300 / cols), line: { width: 3, color: "#ff9f1c" } },
      });
    }
  }

  function renderDiff(li, hi, layer, head) {
    const el = $("diff-map");
    const r = response;
    const [rows, cols] = r.grid;
    const prefix = r.prefix_tokens;
    if (!base || !r.effect) {
      el.dataset.maxAbs = "0";
      Plotly.react(el, [], {
        title: { text: `P̂ − P at layer ${layer}, head ${head}`, font: { size: 13 } }, margin: { l: 30, r: 10, t: 30, b: 30 },
        xaxis: { visible: false }, yaxis: { visible: false },
        annotations: [{ text: r.effect ? "fetching P without the interventions…" : "no interventions active: P̂ = P", showarrow: false, font: { color: "#667085" } }],
      }, PLOT);
      return;
    }
    const after = r.attention[li][hi][0];
    const before = base[li][hi][0];
    const diff = after.map((p, j) => p - before[j]);
    const patches = diff.slice(prefix);
    const z = Array.from({ length: rows }, (_, i) => patches.slice(i * cols, (i + 1) * cols));
    const maxAbs = Math.max(...diff.map(Math.abs));
    el.dataset.maxAbs = String(maxAbs);
    const prefixShift = diff.slice(0, prefix).map((d, j) => `${r.tokens[j]} ${d >= 0 ? "+" : ""}${fmt(d, 3)}`).join(", ");
    Plotly.react(el, [{
      type: "heatmap", z, colorscale: "RdBu", reversescale: true, zmid: 0, zmin: -Math.max(maxAbs, 1e-12), zmax: Math.max(maxAbs, 1e-12),
      hovertemplate: "patch (%{y}, %{x})<br>P̂ − P = %{z:.5f}<extra></extra>", colorbar: { thickness: 10 },
    }], {
      title: { text: `P̂ − P, layer ${layer}, head ${head} (max |Δ| = ${fmt(maxAbs, 3)})<br><sub>prefix tokens: ${prefixShift}</sub>`, font: { size: 12 } },
      margin: { l: 30, r: 10, t: 50, b: 20 }, xaxis: { constrain: "domain" }, yaxis: { autorange: "reversed", scaleanchor: "x" },
    }, PLOT);
  }

  function writeUrl() {
    const s = page.state;
    const params = new URLSearchParams();
    labToParams(lab, params);
    for (const [k, v] of page.pageParams()) params.set(k, v);
    params.set("img", s.imageId ?? "");
    params.set("l", String(s.layer));
    params.set("h", String(s.head));
    params.set("q", String(s.query));
    writeHash(params);
    $("share-url").value = window.location.href;
  }

  // Fill the page state from the URL; returns the params (or null when the URL holds no view).
  function restoreInto(state, { models = [], samples: examples = [] } = {}) {
    const params = readHash();
    if (!params.get("img")) return null;
    const example = examples.find((x) => x.image_id === params.get("img"));
    if (example) state.source = { url: example.url, name: example.file }; // an example photo restores at once
    const size = Number(params.get("z"));
    state.sizeFactor = size === 2 ? 2 : 1;
    const setControl = (id, value) => { const el = document.getElementById(id); if (el && value !== null && value !== undefined) el.value = String(value); };
    paramsToLab(params, lab);
    lab.beta.logRatio = 0; // the page's own slider holds β
    const model = params.get("m");
    if (model && models.some((m) => m.id === model)) state.model = model;
    state.imageId = params.get("img");
    state.layer = intParam(params, "l", 0);
    state.head = intParam(params, "h", 0);
    state.query = intParam(params, "q", 0);
    const b = Number(params.get("b"));
    state.logBeta = Number.isFinite(b) ? b : 0;
    setControl("model-select", state.model);
    setControl("beta-slider", state.logBeta);
    if (["all", "layer", "head"].includes(params.get("bs"))) setControl("beta-scope", params.get("bs"));
    masks.update();
    perturb.update();
    return params;
  }

  function loadFailed(err) {
    if (err && err.status === 404) $("reupload").hidden = false;
  }

  $("reupload-input").addEventListener("change", async (ev) => {
    const file = ev.target.files?.[0];
    if (!file) return;
    const form = new FormData();
    form.append("file", file, file.name);
    try {
      const res = await fetch("/api/images", { method: "POST", body: form });
      const payload = await res.json().catch(() => ({}));
      if (!res.ok) throw new Error(typeof payload.detail === "string" ? payload.detail : JSON.stringify(payload.detail));
      if (payload.image_id !== page.state.imageId) setStatus("this is not the image of the link: showing it with the link's settings");
      page.state.imageId = payload.image_id;
      page.state.source = { blob: file, name: file.name };
      $("reupload").hidden = true;
      page.reload();
    } catch (err) {
      setStatus(`upload refused: ${err.message}`, { error: true });
    }
  });
  $("export-json").addEventListener("click", () => {
    if (!response) return setStatus("nothing to export yet", { error: true });
    downloadJSON({ request, response, url: window.location.href }, `attnlab-${response.model}-L${selection().layer}-H${selection().head}.json`);
  });
  $("export-png").addEventListener("click", () => downloadPNG(document.getElementById("overlay"), "attnlab-image-overlay")
    .catch((err) => setStatus(`PNG export failed: ${err.message}`, { error: true })));
  $("copy-link").addEventListener("click", async () => {
    $("share-url").select();
    try { await navigator.clipboard.writeText(window.location.href); setStatus("link copied"); } catch { setStatus("select the link and copy it"); }
  });

  // Keyboard: ← → heads, ↑ ↓ layers (outside form fields), as on the text page.
  document.addEventListener("keydown", (e) => {
    if (!response || ["INPUT", "TEXTAREA", "SELECT"].includes(document.activeElement?.tagName)) return;
    const moves = { ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0] };
    if (!moves[e.key]) return;
    e.preventDefault();
    const clamp = (v, n) => Math.max(0, Math.min(n - 1, v));
    page.selectHead(clamp(page.state.layer + moves[e.key][0], response.layers.length), clamp(page.state.head + moves[e.key][1], response.heads.length));
  });

  return { lab, interventions, samples, update, render, loadFailed, togglePick: (j) => perturb.togglePick(j), restoreInto };
}
