// The image page: upload a photo (drag-and-drop or picker, with progress), see one head's attention
// over it for a chosen query patch (CLS by default), every layer × head at once, the rollout, β,
// key masks by click or brush, predictions before/after, and the mean attention distance per head.
// The laboratory below the figures is the same module as on the text page (static/js/lab/lab.js).
// Long images (over full_map_tokens_image, e.g. dinov2-small at 896 px: 4,097 tokens, /guide#s10) ask for the shown
// head only: its overview opens in the token × token map and zooms into exact windows (static/js/views/atlas.js, the
// text page's view); the query row of every head for the overlay and the grid comes from POST /api/runs/{id}/row.
import { ApiError, isAbort, postBinary, postJSON, setStatus } from "./api.js";
import { addNotReady, byId as $, setOptions } from "./dom.js";
import { decodeTensor, fmt } from "./mathx.js";
import { mountLab } from "./lab/lab.js";
import { intParam } from "./lab/urlstate.js";
import { MODEBAR_REMOVE } from "./vendor.js";
import { drawAtlas, hideAtlas } from "./views/atlas.js";
import { mapName, onWeightingChange, weightingFields, weightingOf } from "./views/weighting.js";

const config = JSON.parse(document.getElementById("page-config").textContent);
const PLOT = { responsive: true, displaylogo: false };
// Patch clicks come in quick succession (masking several patches): a short double-click window keeps
// the second click a click instead of Plotly's "reset zoom" double-click.
// The overlay keeps box select: the brush that masks a region.
const OVERLAY_PLOT = { ...PLOT, doubleClickDelay: 120, modeBarButtonsToRemove: MODEBAR_REMOVE.filter((b) => b !== "select2d") };
const CELL_PX = 480; // about the overlay's plotted width: markers stay inside their patch
// Overlay colours: low attention transparent so the photo shows through, high attention bright.
const OVERLAY_SCALE = [
  [0, "rgba(10,10,40,0)"], [0.15, "rgba(60,20,120,0.25)"], [0.45, "rgba(180,40,120,0.55)"],
  [0.75, "rgba(250,120,30,0.75)"], [1, "rgba(255,240,80,0.9)"],
];

const state = {
  model: config.model,
  imageId: null,
  source: null, // {blob | url}: what to upload again if the server evicted the image (404)
  sizeFactor: 1, // 1 = native resolution, 2 = twice (position embeddings interpolated)
  nativeSize: {}, // model id → native image size, learnt from responses
  layer: 0,
  head: 0,
  query: 0, // token index; 0 = CLS
  masked: null, // masked key tokens (patch token indices): the lab store's own Set (state.masks.tokens)
  response: null,
  request: null,
};

// ---- helpers ---------------------------------------------------------------------------------------
const grid = () => state.response.grid; // [rows, cols]
const prefix = () => state.response.prefix_tokens;
const patchToken = (r, c) => prefix() + r * grid()[1] + c;
const tokenPatch = (t) => (t < prefix() ? null : [Math.floor((t - prefix()) / grid()[1]), (t - prefix()) % grid()[1]]);

function reshape(flat, rows, cols) {
  const out = [];
  for (let r = 0; r < rows; r++) out.push(flat.slice(r * cols, (r + 1) * cols));
  return out;
}

// Tokens of the current model at a size factor, from the last response's geometry (null before one).
function tokensAt(factor) {
  const r = state.response, native = state.nativeSize[state.model];
  if (!r || r.model !== state.model || !native) return null;
  return ((native * factor) / r.patch_size) ** 2 + r.prefix_tokens;
}

// Over full_map_tokens_image the server keeps no maps (/guide#s10): the page asks for one head's overview at a time.
const isLong = () => (tokensAt(state.sizeFactor) ?? 0) > (config.full_map_tokens_image ?? Infinity);

function requestBody() {
  const native = state.nativeSize[state.model];
  const ivs = imageLab.interventions(); // β, scoped key masks, causal, ablation, perturbations
  if (isLong()) {
    return {
      model: state.model, image_id: state.imageId, image_size: native * state.sizeFactor, queries: [state.query],
      layers: [state.layer], heads: [state.head], // the overview of the shown head; every head's row comes by /row
      interventions: ivs, compare: ivs.length > 0, include_base: false, include_scores: false, // maps: by window
      samples: ivs.length > 0 ? imageLab.samples() : 1, encoding: "f32", ...weightingFields(),
    };
  }
  return {
    model: state.model,
    image_id: state.imageId,
    image_size: state.sizeFactor === 1 || !native ? null : native * state.sizeFactor,
    queries: [state.query],
    interventions: ivs,
    compare: ivs.length > 0,
    include_base: ivs.length > 0, // P without interventions, for P̂ − P, in the same response
    include_scores: true, // the lab's softmax panel needs Ŝ of the query row
    samples: ivs.length > 0 ? imageLab.samples() : 1,
    ...weightingFields(), // P or the value-weighted maps (the softmax panel's Ŝ is P's either way)
  };
}

// ---- upload ----------------------------------------------------------------------------------------
function uploadBlob(blob, name = "image") {
  // XMLHttpRequest rather than fetch: it reports upload progress.
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    const progress = $("upload-progress");
    progress.hidden = false;
    progress.value = 0;
    xhr.upload.onprogress = (e) => { if (e.lengthComputable) progress.value = e.loaded / e.total; };
    xhr.onload = () => {
      progress.hidden = true;
      let payload = {};
      try { payload = JSON.parse(xhr.responseText); } catch { payload = { detail: xhr.statusText }; }
      if (xhr.status >= 200 && xhr.status < 300) resolve(payload);
      else reject(new ApiError(xhr.status, payload.detail));
    };
    xhr.onerror = () => { progress.hidden = true; reject(new Error("network error during upload")); };
    const form = new FormData();
    form.append("file", blob, name);
    xhr.open("POST", "/api/images");
    xhr.send(form);
  });
}

const UPLOAD_TYPES = ["image/png", "image/jpeg", "image/webp"];
const megabytes = (n) => `${(n / 1048576).toFixed(1)} MB`;

// What the server would refuse, checked here before a byte is sent (size and type from the page config).
function uploadProblem(file) {
  if (file.type && !UPLOAD_TYPES.includes(file.type)) return `${file.name} is ${file.type}: choose a PNG, JPEG or WebP image`;
  if (!file.type && !/\.(png|jpe?g|webp)$/i.test(file.name)) return `${file.name} is not a PNG, JPEG or WebP image`;
  const max = config.max_upload_bytes;
  if (max && file.size > max) return `${file.name} is ${megabytes(file.size)}: the limit is ${megabytes(max)}`;
  return null;
}

// Upload feedback next to the drop zone (the header's status line is far from it).
function uploadError(message) {
  $("upload-error").textContent = message ?? "";
  $("upload-error").hidden = !message;
}

async function useFile(file) {
  const problem = uploadProblem(file);
  if (problem) { uploadError(problem); setStatus("upload not sent", { error: true }); return; }
  uploadError(null);
  setStatus(`uploading ${file.name}…`);
  try {
    const r = await uploadBlob(file, file.name);
    state.source = { blob: file, name: file.name };
    $("sample-buttons").querySelectorAll("button").forEach((x) => x.classList.remove("active")); // your photo, not an example
    await selectImage(r.image_id);
    setStatus(`${file.name}: ${r.width}×${r.height}`);
  } catch (err) {
    uploadError(`upload refused: ${err.message}`);
    setStatus(`upload refused: ${err.message}`, { error: true });
  }
}

async function reupload() {
  const src = state.source;
  if (!src) throw new Error("the server no longer holds this image; upload it again");
  const blob = src.blob ?? (await (await fetch(src.url)).blob());
  const r = await uploadBlob(blob, src.name);
  state.imageId = r.image_id;
}

async function selectImage(imageId) {
  state.imageId = imageId;
  state.query = 0;
  imageLab.forgetTokens(); // patch indices of another image mean nothing
  await load();
}

// ---- loading ---------------------------------------------------------------------------------------
let seq = 0;
async function load({ retried = false } = {}) {
  if (!state.imageId) return;
  const mySeq = ++seq;
  setStatus("running…");
  const started = performance.now();
  try {
    const body = requestBody();
    const r = await postJSON("/api/image/attention", body, { channel: "image" });
    if (mySeq !== seq) return;
    uploadError(null); // an earlier upload's refusal is no longer what the page shows
    if (r.overview) await withEveryHead(r); // a long image: the query row of every head, from the kept run
    else r.attention = decodeTensor(r.attention); // [L][H][1][T]
    if (mySeq !== seq) return;
    state.response = r;
    state.request = body;
    $("reupload").hidden = true;
    if (!state.sizeFactor || state.sizeFactor === 1) state.nativeSize[state.model] = r.image_size;
    state.layer = Math.min(state.layer, r.layers.length - 1);
    state.head = Math.min(state.head, r.heads.length - 1);
    render();
    const ms = performance.now() - started;
    setStatus(`${r.model} · ${r.image_size} px · ${r.tokens.length} tokens · ${ms.toFixed(0)} ms`);
  } catch (err) {
    if (isAbort(err)) return;
    if (err.status === 404 && !retried && state.source) {
      setStatus("the server evicted the image: uploading it again…");
      try { await reupload(); return load({ retried: true }); } catch (e) { err = e; }
    }
    setStatus(err.message, { error: true });
    imageLab.fail(err.message);
    if (err.status === 404) $("reupload").hidden = false; // a link to an image the server no longer holds
  }
}

// A long response holds the shown head's overview and its query row; the overlay and the grid need that row of every
// head: one POST /api/runs/{run_id}/row (cached per run and query), laid out as a short response's [L][H][1][T].
let rowsCache = { key: null, value: null };
async function withEveryHead(r) {
  const key = `${r.run_id}:${state.query}:${weightingOf(r)}`;
  if (rowsCache.key !== key) {
    const out = await postBinary(`/api/runs/${r.run_id}/row`, { row: state.query, weighting: weightingOf(r), encoding: "f32" },
      { channel: "image-rows" });
    rowsCache = { key, value: { layers: out.layers, heads: out.heads, rows: decodeTensor(out.attention) } }; // (L, H, T)
  }
  const { layers, heads, rows } = rowsCache.value;
  r.atlasHead = { layer: r.layers[0], head: r.heads[0] }; // the head whose overview this response holds
  r.layers = layers;
  r.heads = heads;
  r.attention = rows.map((perHead) => perHead.map((row) => [row]));
}

// ---- rendering -------------------------------------------------------------------------------------
function render() {
  // Scoped interventions follow the selected head: a selection change the page only redrew needs a run.
  if (imageLab.stale(state.request)) { load(); return; }
  const r = state.response;
  // a long image's overview is of one head: another head's comes with a new request (the run itself is cached)
  if (r.atlasHead && (r.atlasHead.layer !== r.layers[state.layer] || r.atlasHead.head !== r.heads[state.head])) { load(); return; }
  renderSelectors();
  renderOverlay();
  renderModelGrid();
  renderOutput();
  renderDistance();
  renderReadouts();
  renderAtlas();
  // a long run keeps no maps, so no TV per head (the response says so in its warnings): an empty grid, not zeros
  const derived = r.atlasHead && r.effect ? { tv: r.layers.map(() => r.heads.map(() => null)), tvAt: [null, null] } : {};
  imageLab.render(r, state.request, derived);
}

// The token × token map of a long image: its overview first, exact windows on zoom, a clicked row over every key.
function renderAtlas() {
  const r = state.response;
  $("atlas-section").hidden = !r.atlasHead;
  if (!r.atlasHead) { hideAtlas(); return; }
  $("atlas-title").textContent = `${r.tokens.length.toLocaleString("en")} tokens (${grid()[0]}×${grid()[1]} patches + ${prefix()}), layer ${r.atlasHead.layer}, head ${r.atlasHead.head}`;
  drawAtlas($("atlas-map"), r, r.atlasHead);
}

// Right after a model switch, until its first response: only what is known of the new model's sizes
// (the previous model's list would offer sizes of another model).
function pendingSizes() {
  const native = state.nativeSize[state.model];
  setOptions($("size-select"), [[1, native ? `${native} px (native)` : "native size (loading…)"]], 1);
  $("size-select").disabled = true;
}

function renderSelectors() {
  const r = state.response;
  $("size-select").disabled = false;
  setOptions($("layer-select"), r.layers.map((l) => [l, `layer ${l}`]), state.layer);
  setOptions($("head-select"), r.heads.map((h) => [h, `head ${h}`]), state.head);
  const native = state.nativeSize[state.model] ?? r.image_size;
  // only sizes the server accepts: (size / patch)² + prefix tokens ≤ max_image_tokens
  const fits = (f) => ((native * f) / r.patch_size) ** 2 + r.prefix_tokens <= (config.max_image_tokens ?? Infinity);
  const long = (f) => ((native * f) / r.patch_size) ** 2 + r.prefix_tokens > (config.full_map_tokens_image ?? Infinity);
  const sizes = [[1, `${native} px (native)`], [2, `${native * 2} px (interpolated)`], [4, `${native * 4} px (interpolated)`]]
    .filter(([f]) => f === 1 || fits(f))
    .map(([f, label]) => [f, long(f) ? `${label}, long: overview + windows` : label]);
  setOptions($("size-select"), sizes, state.sizeFactor);
}

function currentMap() {
  const r = state.response;
  const [rows, cols] = grid();
  if ($("rollout-toggle").checked) return { z: r.rollout, title: "rollout: CLS row of Ã_L⋯Ã_1 over the patches" };
  const row = r.attention[state.layer][state.head][0]; // (T,) P[query, :] or its value-weighted row
  const q = r.tokens[state.query];
  const name = mapName(r);
  return {
    z: reshape(row.slice(prefix()), rows, cols),
    title: `${name === "P" ? "" : `${name} · `}layer ${state.layer}, head ${state.head}, query ${q}; ${name} to prefix tokens: ${fmt(row.slice(0, prefix()).reduce((a, b) => a + b, 0))}`,
  };
}

function renderOverlay() {
  const r = state.response;
  const [rows, cols] = grid();
  const { z, title } = currentMap();
  $("overlay-title").textContent = title;
  const viewSize = Math.min(1036, Math.max(448, r.image_size));
  const heat = {
    type: "heatmap", z, colorscale: OVERLAY_SCALE, zmin: 0, showscale: true,
    colorbar: { thickness: 12 }, hovertemplate: "patch (%{y}, %{x})<br>%{z:.4f}<extra></extra>",
  };
  const masks = masksTrace(), query = queryTrace();
  // The figure's height follows its width, so the square grid fills it (on a phone a fixed 560 px left the
  // y axis to stretch over rows that do not exist).
  const plotW = Math.max(120, ($("overlay").clientWidth || 480) - 30 - 10 - 70); // margins and colour bar
  const layout = {
    height: Math.round(Math.min(560, plotW * rows / cols + 40)),
    margin: { l: 30, r: 10, t: 10, b: 30 },
    xaxis: { range: [-0.5, cols - 0.5], showgrid: false, zeroline: false, constrain: "domain", dtick: cols <= 16 ? 1 : 4 },
    // constrain: the square keeps the real rows (scaling the range instead showed rows −11…26 on a phone)
    yaxis: { range: [rows - 0.5, -0.5], showgrid: false, zeroline: false, scaleanchor: "x", constrain: "domain", dtick: rows <= 16 ? 1 : 4 },
    images: [{
      source: `/api/images/${state.imageId}/view?size=${viewSize}`, xref: "x", yref: "y",
      x: -0.5, y: -0.5, sizex: cols, sizey: rows, xanchor: "left", yanchor: "top", sizing: "stretch", layer: "below",
    }],
    dragmode: $("click-mode").value === "mask" ? "select" : "zoom",
  };
  // One drawing with every layer (a second redraw for the rings would widen the window in which a click is lost).
  Plotly.react($("overlay"), [heat, masks, query, picksTrace(), cursorTrace()], layout, OVERLAY_PLOT);
}

// The masked keys' crosses and the query's square: named traces, moved at once by a click (restyleMarkers).
function masksTrace() {
  const cells = [...state.masked].map(tokenPatch).filter(Boolean);
  return {
    type: "scatter", mode: "markers", name: "masked keys", x: cells.map((p) => p[1]), y: cells.map((p) => p[0]),
    marker: { symbol: "x-thin", size: Math.max(6, 0.55 * CELL_PX / grid()[1]), line: { width: 2, color: "#2ee6ff" } },
    hoverinfo: "skip", showlegend: false,
  };
}

function queryTrace() {
  const qp = tokenPatch(state.query);
  return {
    type: "scatter", mode: "markers", name: "query", x: qp ? [qp[1]] : [], y: qp ? [qp[0]] : [],
    marker: { symbol: "square-open", size: Math.max(8, 0.8 * CELL_PX / grid()[1]), line: { width: 3, color: "#00e676" } },
    hoverinfo: "skip", showlegend: false,
  };
}

function renderModelGrid() {
  const r = state.response;
  const [rows, cols] = grid();
  const L = r.layers.length, H = r.heads.length;
  // one composite heatmap: layer-major blocks of rows × cols with one-cell gaps (null)
  const height = L * (rows + 1) - 1, width = H * (cols + 1) - 1;
  const z = Array.from({ length: height }, () => new Array(width).fill(null));
  for (let l = 0; l < L; l++) {
    for (let h = 0; h < H; h++) {
      const row = r.attention[l][h][0].slice(prefix());
      const max = Math.max(...row) || 1;
      for (let i = 0; i < rows; i++) for (let j = 0; j < cols; j++) z[l * (rows + 1) + i][h * (cols + 1) + j] = row[i * cols + j] / max;
    }
  }
  const heat = { type: "heatmap", z, colorscale: "Viridis", showscale: false, hoverinfo: "none" };
  const box = {
    type: "scatter", mode: "lines", hoverinfo: "skip", showlegend: false, line: { color: "#00e676", width: 2 },
    x: [-0.5, cols - 0.5, cols - 0.5, -0.5, -0.5].map((v) => v + state.head * (cols + 1)),
    y: [-0.5, -0.5, rows - 0.5, rows - 0.5, -0.5].map((v) => v + state.layer * (rows + 1)),
  };
  const layout = {
    margin: { l: 40, r: 10, t: 24, b: 10 },
    xaxis: { tickvals: r.heads.map((h, i) => i * (cols + 1) + cols / 2 - 0.5), ticktext: r.heads.map((h) => `h${h}`), side: "top", range: [-0.5, width - 0.5], constrain: "domain", showgrid: false, zeroline: false },
    // square maps: one y unit = one x unit, within the figure (constrain), the real extent only
    yaxis: { tickvals: r.layers.map((l, i) => i * (rows + 1) + rows / 2 - 0.5), ticktext: r.layers.map((l) => `L${l}`), range: [height - 0.5, -0.5], scaleanchor: "x", constrain: "domain", showgrid: false, zeroline: false },
  };
  Plotly.react($("model-grid"), [heat, box], layout, PLOT);
}

function renderOutput() {
  const r = state.response;
  const out = r.effect?.output;
  const dl = $("output-effect");
  dl.replaceChildren();
  const add = (k, v) => { const dt = document.createElement("dt"); dt.textContent = k; const dd = document.createElement("dd"); dd.textContent = v; dl.append(dt, dd); };
  $("predictions").hidden = !r.predictions;
  if (r.predictions) {
    $("output-title").textContent = "class probabilities, before and after the interventions";
    const rows = out?.classes ?? r.predictions.map((p) => ({ label: p.label, before: p.prob, after: p.prob }));
    const traces = [
      { type: "bar", orientation: "h", name: "before", y: rows.map((c) => c.label), x: rows.map((c) => c.before), marker: { color: "#98a2b3" } },
      { type: "bar", orientation: "h", name: out ? "after" : "now", y: rows.map((c) => c.label), x: rows.map((c) => c.after), marker: { color: "#3b5bdb" } },
    ];
    Plotly.react($("predictions"), traces, {
      barmode: "group", margin: { l: 110, r: 10, t: 10, b: 30 }, xaxis: { range: [0, 1], title: { text: "probability" } },
      yaxis: { autorange: "reversed" }, legend: { orientation: "h" },
    }, PLOT);
    if (out) { add("KL(before ‖ after)", fmt(out.kl)); add("top-1 changed", out.top1_changed ? "yes" : "no"); }
  } else {
    $("output-title").textContent = "backbone: CLS embedding";
    Plotly.purge($("predictions"));
    add("CLS cosine (after vs before)", out ? fmt(out.cls_cosine) : "1 (no intervention)");
  }
  if (r.effect) {
    const tv = r.effect.attention_tv?.flat(); // null for a long image: its runs keep no maps
    add("mean attention TV", tv ? fmt(tv.reduce((a, b) => a + b, 0) / tv.length) : "not computed (long input)");
    add("hidden cosine, last layer", fmt(r.effect.hidden_cosine[r.effect.hidden_cosine.length - 1]));
  }
  $("warnings").textContent = (r.warnings || []).join(" ");
}

function renderDistance() {
  const r = state.response;
  const traces = r.heads.map((h, hi) => ({
    type: "scatter", mode: "markers", name: `head ${h}`,
    x: r.layers.map((l) => l + (hi - (r.heads.length - 1) / 2) * 0.06), y: r.mean_distance.map((perHead) => perHead[hi]),
    hovertemplate: `layer %{x:.0f}, head ${h}: %{y:.1f} px<extra></extra>`,
  }));
  Plotly.react($("distance-plot"), traces, {
    margin: { l: 50, r: 10, t: 10, b: 40 }, xaxis: { title: { text: "layer" }, dtick: 1 },
    yaxis: { title: { text: "mean attention distance (px)" }, rangemode: "tozero" }, showlegend: false,
  }, PLOT);
}

function renderReadouts() {
  const r = state.response;
  $("query-readout").textContent = `query: ${r.tokens[state.query] ?? "CLS"} · masked keys: ${state.masked.size}`;
}

// ---- events ----------------------------------------------------------------------------------------
function onOverlayClick(ev) {
  const point = ev.points?.[0];
  if (ev.event) return; // a real click: bindPatchClicks has it (a plotly_click emitted by a script has no event)
  if (!point || !state.response) return;
  const [rows, cols] = grid();
  const c = Math.round(point.x), r = Math.round(point.y);
  if (r < 0 || r >= rows || c < 0 || c >= cols) return;
  choosePatch(r, c);
}

// Patch clicks from the pointer itself, not from Plotly's plotly_click: Plotly emits that only with hover data of its
// own, and dropped most clicks held ~60 ms like a finger's (four mask clicks 150 ms apart masked 2 patches). A press
// and release within 5 px, begun on the plot area, is a click on the patch under the press; a longer move is the
// brush's (plotly_selected). The release is caught on window: Plotly covers the page while a button is down.
function bindPatchClicks() {
  const overlay = $("overlay");
  let press = null;
  overlay.addEventListener("pointerdown", (e) => {
    press = e.button === 0 && e.target.closest?.(".nsewdrag") ? { x: e.clientX, y: e.clientY } : null;
  }, true);
  window.addEventListener("pointerup", (e) => {
    const at = press;
    press = null;
    if (!at || Math.hypot(e.clientX - at.x, e.clientY - at.y) > 5) return;
    const point = overlayPoint(at.x, at.y);
    if (point) onOverlayClick({ points: [point] });
  }, true);
  window.addEventListener("pointercancel", () => { press = null; }, true);
}

// Data coordinates (column x, row y) under a page point of the overlay's plot area, from its axes' ranges (the top
// edge is the y axis's range[1], reversed or not).
function overlayPoint(clientX, clientY) {
  const layout = $("overlay")._fullLayout, area = $("overlay").querySelector(".nsewdrag")?.getBoundingClientRect();
  const xr = layout?.xaxis?.range, yr = layout?.yaxis?.range;
  if (!xr || !yr || !area?.width || !area?.height) return null;
  const fx = (clientX - area.left) / area.width, fy = (clientY - area.top) / area.height;
  return { x: xr[0] + fx * (xr[1] - xr[0]), y: yr[1] + fy * (yr[0] - yr[1]) };
}

// Keyboard: the overlay takes the focus; Shift + arrow keys move a patch cursor (plain arrows keep moving
// the head), Enter or Space does to the cursor's patch what a click does in the current click mode.
function bindPatchKeys() {
  const overlay = $("overlay");
  overlay.tabIndex = 0;
  overlay.setAttribute("aria-label", "attention over the photo: Shift + arrow keys move the patch cursor, Enter chooses that patch");
  overlay.addEventListener("keydown", (e) => {
    if (!state.response || e.target !== overlay) return;
    const moves = { ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0] };
    const [rows, cols] = grid();
    if (e.shiftKey && moves[e.key]) {
      e.preventDefault();
      const [r, c] = state.cursor ?? tokenPatch(state.query) ?? [0, 0];
      const [dr, dc] = moves[e.key];
      state.cursor = [Math.min(rows - 1, Math.max(0, r + dr)), Math.min(cols - 1, Math.max(0, c + dc))];
      drawCursor();
    } else if ((e.key === "Enter" || e.key === " ") && state.cursor) {
      e.preventDefault();
      choosePatch(...state.cursor);
    }
  });
}

function cursorTrace() {
  const at = state.cursor && state.cursor[0] < grid()[0] && state.cursor[1] < grid()[1] ? [state.cursor] : [];
  return {
    type: "scatter", mode: "markers", name: "keyboard cursor", x: at.map((p) => p[1]), y: at.map((p) => p[0]),
    hoverinfo: "skip", showlegend: false,
    marker: { symbol: "square-open", size: Math.max(10, 320 / grid()[1]), line: { width: 3, color: "#2ec4b6" } },
  };
}

function drawCursor() {
  restyleMarkers(cursorTrace());
  const [r, c] = state.cursor;
  $("query-readout").textContent = `cursor: p(${r},${c}) — Enter to ${$("click-mode").selectedOptions[0]?.textContent ?? "choose"}`;
}

function choosePatch(r, c) {
  const token = patchToken(r, c);
  if ($("click-mode").value === "perturb") { imageLab.togglePick(token); drawPicks(); return; }
  if ($("click-mode").value === "mask") {
    if (state.masked.has(token)) state.masked.delete(token); else state.masked.add(token);
  } else {
    state.query = token;
  }
  renderReadouts(); // at once: the re-run may take a moment
  restyleMarkers(masksTrace());
  restyleMarkers(queryTrace());
  load();
}

function onOverlaySelect(ev) { // the brush: box/lasso selection masks every patch inside it
  if (!ev || !ev.range && !ev.lassoPoints || $("click-mode").value !== "mask") return;
  const [rows, cols] = grid();
  const xs = ev.range?.x, ys = ev.range?.y;
  if (!xs || !ys) return;
  for (let r = 0; r < rows; r++) for (let c = 0; c < cols; c++) {
    if (c >= Math.min(...xs) && c <= Math.max(...xs) && r >= Math.min(...ys) && r <= Math.max(...ys)) state.masked.add(patchToken(r, c));
  }
  renderReadouts();
  restyleMarkers(masksTrace());
  load();
}

function onGridClick(ev) {
  const point = ev.points?.[0];
  if (!point || !state.response) return;
  const [rows, cols] = grid();
  const h = Math.floor((point.x + 0.5) / (cols + 1)), l = Math.floor((point.y + 0.5) / (rows + 1));
  if (h < state.response.heads.length && l < state.response.layers.length) {
    state.head = h;
    state.layer = l;
    render(); // runs again when scoped interventions follow the selection
  }
}

function bindEvents() {
  bindPatchKeys();
  const drop = $("drop-zone");
  ["dragenter", "dragover"].forEach((t) => drop.addEventListener(t, (e) => { e.preventDefault(); drop.classList.add("dragover"); }));
  ["dragleave", "drop"].forEach((t) => drop.addEventListener(t, (e) => { e.preventDefault(); drop.classList.remove("dragover"); }));
  drop.addEventListener("drop", (e) => { const f = e.dataTransfer?.files?.[0]; if (f) useFile(f); });
  $("file-input").addEventListener("change", (e) => { const f = e.target.files?.[0]; e.target.value = ""; if (f) useFile(f); });
  // Keyboard and mouse: Enter or Space on the drop zone (or its link), or a click anywhere in it, opens the chooser.
  const choose = () => $("file-input").click();
  drop.addEventListener("click", (e) => { if (!e.target.closest("label, input, progress")) choose(); });
  for (const target of [drop, $("file-label")]) {
    target.addEventListener("keydown", (e) => {
      if (e.target !== target || (e.key !== "Enter" && e.key !== " ")) return;
      e.preventDefault();
      choose();
    });
  }

  setOptions($("model-select"), config.models.map((m) => [m.id, m.id]), state.model);
  addNotReady($("model-select"), config.not_ready); // being prepared while the server serves (`make run`)
  $("model-select").addEventListener("change", (e) => {
    state.model = e.target.value; state.layer = 0; state.head = 0; state.query = 0; state.sizeFactor = 1;
    imageLab.forgetTokens();
    pendingSizes();
    load();
  });
  $("size-select").addEventListener("change", (e) => { state.sizeFactor = Number(e.target.value); state.query = 0; imageLab.forgetTokens(); load(); });
  $("layer-select").addEventListener("change", (e) => { state.layer = state.response.layers.indexOf(Number(e.target.value)); render(); });
  $("head-select").addEventListener("change", (e) => { state.head = state.response.heads.indexOf(Number(e.target.value)); render(); });
  $("rollout-toggle").addEventListener("change", () => renderOverlay());
  onWeightingChange(() => load()); // a new request: the server forms the value-weighted maps (the run itself is cached)
  $("click-mode").addEventListener("change", () => renderOverlay());
  $("query-cls").addEventListener("click", () => { state.query = 0; load(); });
  $("clear-masks").addEventListener("click", () => { state.masked.clear(); load(); });
  $("reupload-input").addEventListener("change", (ev) => { const f = ev.target.files?.[0]; if (f) reuploadForLink(f); });

  $("overlay").on?.("plotly_click", onOverlayClick);
  bindPatchClicks();
  $("overlay").on?.("plotly_selected", onOverlaySelect);
  $("model-grid").on?.("plotly_click", onGridClick);

  const buttons = $("sample-buttons");
  for (const sample of config.samples) {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = sample.name;
    b.dataset.sample = sample.file;
    b.addEventListener("click", () => {
      state.source = { url: sample.url, name: sample.file };
      if (sample.model && config.models.some((m) => m.id === sample.model)) {
        state.model = sample.model; $("model-select").value = sample.model; state.sizeFactor = 1;
      }
      buttons.querySelectorAll("button").forEach((x) => x.classList.toggle("active", x === b));
      selectImage(sample.image_id);
    });
    buttons.append(b);
  }
}

async function start() {
  // Plotly attaches .on() to a div once it holds a plot: draw empty figures first, then wire.
  for (const id of ["overlay", "model-grid"]) await Plotly.newPlot($(id), [], { margin: { t: 10 } }, id === "overlay" ? OVERLAY_PLOT : PLOT);
  bindEvents();
  if (restoreFromUrl()) return load(); // a shared link
  const first = config.samples.find((s) => s.model === state.model) ?? config.samples[0];
  if (first) {
    document.querySelector(`#sample-buttons button[data-sample="${first.file}"]`)?.click();
  } else {
    setStatus("drop a photo to start");
  }
}

// ---- the laboratory (static/js/lab/lab.js), below the page's own figures --------------------------
// Indices into the response's layer/head arrays (li, hi) and the model's own numbers (layer, head).
function selection() {
  const r = state.response;
  return { layer: r?.layers[state.layer] ?? state.layer, head: r?.heads[state.head] ?? state.head, query: state.query, li: state.layer, hi: state.head };
}

// P̂ − P of the query row, laid out on the patch grid (prefix tokens listed in the subtitle).
function diffOnGrid() {
  const r = state.response;
  if (!r?.effect || !r.base_attention) return null;
  const [rows, cols] = grid();
  const after = r.attention[state.layer][state.head][0];
  const before = decodeTensor(r.base_attention)[state.layer][state.head][0];
  const shifts = after.slice(0, prefix()).map((p, j) => {
    const d = p - before[j];
    return `${r.tokens[j]} ${d >= 0 ? "+" : ""}${fmt(d, 3)}`;
  });
  const { layer, head } = selection();
  return {
    after: reshape(after.slice(prefix()), rows, cols), before: reshape(before.slice(prefix()), rows, cols),
    where: `layer ${layer}, head ${head}`, subtitle: `prefix tokens: ${shifts.join(", ")}`, square: true,
    masked: (i, j) => imageLab.state.masks.tokens.has(prefix() + i * cols + j), // the grid's cell (i, j): key prefix + i·cols + j
  };
}

function softmaxRowContext() {
  const r = state.response;
  if (!r?.scores) return null;
  const row = decodeTensor(r.scores)[state.layer][state.head][0];
  const masks = imageLab.state.masks.tokens, causal = imageLab.state.causal.on;
  return {
    tokens: r.tokens, scores: [row], query: 0, queryLabels: [`${state.query}: ${r.tokens[state.query]} (the query patch)`],
    keyLabels: r.tokens.map((t, j) => `${j}:${t}`), beta: imageLab.shownBeta(), // β₀ outside a β layer range
    masked: r.tokens.map((_, j) => masks.has(j) || (causal && j > state.query)),
  };
}

// The shown query row's own TV, ½ Σ_j |P̂[q, j] − P[q, j]| (the response's attention_tv is the mean over every row).
function shownRowTV() {
  const r = state.response;
  if (!r?.effect || !r.base_attention) return [];
  const after = r.attention[state.layer][state.head][0];
  const before = decodeTensor(r.base_attention)[state.layer][state.head][0];
  const tv = 0.5 * after.reduce((s, p, j) => s + Math.abs(p - before[j]), 0);
  const { layer, head } = selection();
  return [`TV of the shown query row (${r.tokens[state.query] ?? "CLS"}) at L${layer} h${head}: ${fmt(tv)}`];
}

// The patches chosen for the perturbation, as orange rings over the overlay.
function picksTrace() {
  const picked = [...imageLab.state.perturb.tokens].map(tokenPatch).filter(Boolean);
  return {
    type: "scatter", mode: "markers", name: "perturbed patches", x: picked.map((p) => p[1]), y: picked.map((p) => p[0]),
    hoverinfo: "skip", showlegend: false,
    marker: { symbol: "circle-open", size: Math.max(8, 300 / grid()[1]), line: { width: 3, color: "#ff9f1c" } },
  };
}

// A patch chosen or dropped: only the rings move.
function drawPicks() {
  if (state.response) restyleMarkers(picksTrace());
}

// Move the markers of the overlay's trace named like `trace` (rings, cursor) without redrawing the figure.
function restyleMarkers(trace) {
  const el = $("overlay");
  const index = el?.data?.findIndex((t) => t.name === trace.name) ?? -1;
  if (index >= 0) Plotly.restyle(el, { x: [trace.x], y: [trace.y] }, [index]);
}

// Fill the page state from the URL; true when the URL holds a view.
function restoreFromUrl() {
  const params = imageLab.restore();
  if (!params?.get("img")) return false;
  const example = config.samples.find((x) => x.image_id === params.get("img"));
  if (example) state.source = { url: example.url, name: example.file }; // an example photo restores at once
  state.sizeFactor = [2, 4].includes(Number(params.get("z"))) ? Number(params.get("z")) : 1;
  const model = params.get("m");
  if (model && config.models.some((m) => m.id === model)) state.model = model;
  state.imageId = params.get("img");
  state.layer = intParam(params, "l", 0);
  state.head = intParam(params, "h", 0);
  state.query = intParam(params, "q", 0);
  $("model-select").value = state.model;
  return true;
}

// The link's image is gone from the server: the user chose the file again.
async function reuploadForLink(file) {
  try {
    const r = await uploadBlob(file, file.name);
    if (r.image_id !== state.imageId) setStatus("this is not the image of the link: showing it with the link's settings");
    state.imageId = r.image_id;
    state.source = { blob: file, name: file.name };
    $("reupload").hidden = true;
    load();
  } catch (err) {
    setStatus(`upload refused: ${err.message}`, { error: true });
  }
}

const imageLab = mountLab({
  run: () => load(),
  redraw: () => render(),
  labels: () => state.response?.tokens ?? [],
  selection,
  shape: () => ({ layers: state.response?.layers.length ?? 1, heads: state.response?.heads.length ?? 1 }),
  nativeBeta: () => state.response?.native_beta ?? config.models.find((m) => m.id === state.model)?.native_beta ?? 1,
  selectHead: (layer, head) => {
    const r = state.response;
    const l = r.layers.indexOf(layer), h = r.heads.indexOf(head);
    if (l >= 0 && h >= 0) { state.layer = l; state.head = h; render(); }
  },
  pageParams: () => new URLSearchParams({
    m: state.model, z: String(state.sizeFactor), img: state.imageId ?? "", l: String(state.layer), h: String(state.head), q: String(state.query),
  }),
  mainFigure: () => $("overlay"),
  exportName: () => `attnlab-${state.model}-L${selection().layer}-H${selection().head}`,
  modelName: () => state.model,
  titleExtra: () => `query ${state.response?.tokens[state.query] ?? "CLS"}`,
  diff: diffOnGrid,
  softmax: softmaxRowContext,
  summaryExtra: shownRowTV,
}, {
  unit: "patch", showTokenStrip: false, maskScope: "all", distanceUnit: "px", maxSamples: config.limits?.samples ?? 64,
  pickHint: "choose \"mask / unmask it as a key\" under \"Click a patch to\" and click patches (or brush a region)",
  outputId: "lab-output", warningsId: "lab-warnings", diffId: "diff-map",
  // "Download standalone HTML" beside the PNG export: the maps over the patches (labels as here), opening offline
  htmlExport: { body: () => state.request ?? null, url: "/api/image/export.html",
    what: "this image's maps over its patches (every layer and head)",
    filename: () => `attnlab-${state.model}-L${selection().layer}-H${selection().head}.html`,
    shownLayer: () => selection().layer, shownHead: () => selection().head },
});
state.masked = imageLab.state.masks.tokens; // the overlay's clicks and brush mask into the lab's own Set
imageLab.installPngButtons(() => `attnlab-${state.model}`); // the model shown when the button is pressed

start();
