// The Gaussian-heads page: centers over training (epoch slider + play), one head's attention over the
// grid (query and α), the attention ⇔ convolution theorem, and the building blocks (GELU, LayerNorm, cost).
import { getJSON, isAbort, postJSON, setStatus } from "./api.js";
import { byId as $, count, setOptions } from "./dom.js";

const config = JSON.parse(document.getElementById("page-config").textContent);
const PLOT_CONFIG = { displaylogo: false, responsive: true };
const HEAD_COLORS = ["#3b5bdb", "#e8590c", "#2b8a3e", "#c2255c", "#7048e8", "#0c8599", "#e67700", "#5c940d", "#862e9c"];

const state = {
  model: config.model,
  info: null,          // /api/gaussian/models entry
  history: [],         // centers responses, oldest first
  epochIndex: 0,
  layer: 0,
  head: 0,
  query: [7, 7],
  alphaOverride: null, // null = the head's learned α
  playing: null,       // interval id while the animation runs
};

const fmt = (x, digits = 4) => (x === null || x === undefined ? "–" : Number(x).toPrecision(digits));
const fmtInt = (n) => Number(n).toLocaleString("en-US");

function report(err) {
  if (isAbort(err)) return;
  setStatus(err.message || String(err), { error: true });
}

// Plotly.react is asynchronous; two overlapping redraws of one figure (a slider dragged while the
// previous answer is drawn) can trip over each other inside Plotly, so each figure's draws run in turn.
const drawing = new WeakMap();
// A figure narrower than NARROW px (a phone) gets no mode bar: at that width Plotly's toolbar covered titles and
// colour-bar labels (zoom and pan are little use on a touch screen; each figure still exports as PNG).
const NARROW = 520;
function react(el, traces, layout, config) {
  const sized = { ...config, displayModeBar: el.clientWidth >= NARROW ? "hover" : false };
  const next = (drawing.get(el) || Promise.resolve()).then(() => Plotly.react(el, traces, layout, sized)).catch(report);
  drawing.set(el, next);
  return next;
}

// ---------------------------------------------------------------------------------------------
// centers per layer

function centerExtent() {
  // one fixed range for every epoch, so the animation shows motion rather than rescaling
  let m = 2;
  for (const entry of state.history) {
    for (const layer of entry.layers) {
      for (const h of layer.heads) m = Math.max(m, Math.abs(h.center[0]), Math.abs(h.center[1]));
    }
  }
  return Math.ceil(m + 1);
}

function centersFigure() {
  const entry = state.history[state.epochIndex];
  const L = entry.layers.length;
  const extent = centerExtent();
  // Square panels over the real range [−extent, extent]: the figure's height follows the panels' width (a
  // fixed 400 px on a phone stretched each panel's y axis to −19…19). On a phone the layers stack, one panel
  // per row at the figure's width: side by side each panel was ~100 px and the head circles hid each other.
  const plotWidth = Math.max(200, ($("centers-plot")?.clientWidth || 900) - 50);
  const stacked = plotWidth + 50 < NARROW;
  const gap = 0.04;
  const width = stacked ? 1 : (1 - gap * (L - 1)) / L;
  const panel = plotWidth * width;
  const rowGap = 56; // px between stacked panels: the x-axis title of one, the "layer" label of the next
  const plotHeight = stacked ? L * panel + (L - 1) * rowGap : panel;
  const dtick = panel / (2 * extent) >= 14 ? 1 : panel / (2 * extent) >= 7 ? 2 : 4;
  const traces = [];
  const layout = {
    margin: { l: 40, r: 10, t: 36, b: 40 },
    height: Math.round(stacked ? plotHeight + 76 : Math.min(400, panel + 76)),
    showlegend: false,
    hovermode: "closest",
    annotations: [],
    shapes: [],
  };
  for (let l = 0; l < L; l++) {
    const suffix = l === 0 ? "" : String(l + 1);
    const x0 = stacked ? 0 : l * (width + gap);
    const y1 = stacked ? 1 - (l * (panel + rowGap)) / plotHeight : 1, y0 = stacked ? y1 - panel / plotHeight : 0;
    layout[`xaxis${suffix}`] = { domain: [x0, x0 + width], range: [-extent, extent], zeroline: false,
      title: { text: "Δcol", standoff: 2 }, anchor: `y${suffix}`, dtick, gridcolor: "#eef0f4", constrain: "domain" };
    layout[`yaxis${suffix}`] = { domain: [y0, y1], range: [extent, -extent], zeroline: false, scaleanchor: `x${suffix}`,
      title: { text: l === 0 || stacked ? "Δrow" : "", standoff: 2 }, anchor: `x${suffix}`, dtick, gridcolor: "#eef0f4", constrain: "domain" };
    layout.annotations.push({ text: `layer ${l}`, xref: "paper", yref: "paper", x: x0 + width / 2, showarrow: false,
      font: { size: 13 }, ...(stacked ? { y: y1, yanchor: "bottom", yshift: 4 } : { y: 1.07 }) });
    const xa = `x${suffix}`, ya = `y${suffix}`;
    // the 3×3 shift grid of a 3×3 convolution, for reference
    const gx = [], gy = [];
    for (let dr = -1; dr <= 1; dr++) for (let dc = -1; dc <= 1; dc++) { gx.push(dc); gy.push(dr); }
    traces.push({ type: "scatter", mode: "markers", x: gx, y: gy, xaxis: xa, yaxis: ya, hoverinfo: "skip",
      marker: { symbol: "square-open", size: 16, color: "#adb5bd", line: { width: 1.5 } }, name: "3×3 shifts" });
    traces.push({ type: "scatter", mode: "markers", x: [0], y: [0], xaxis: xa, yaxis: ya, hoverinfo: "skip",
      marker: { symbol: "star", size: 14, color: "#1d2230" }, name: "query" });
    // each center's path from epoch 0 to the shown epoch
    const heads = entry.layers[l].heads;
    heads.forEach((_, h) => {
      const path = state.history.slice(0, state.epochIndex + 1).map((e) => e.layers[l].heads[h].center);
      traces.push({ type: "scatter", mode: "lines", x: path.map((c) => c[1]), y: path.map((c) => c[0]),
        xaxis: xa, yaxis: ya, hoverinfo: "skip", line: { color: HEAD_COLORS[h % HEAD_COLORS.length], width: 1 },
        opacity: 0.35 });
    });
    // the heads: circles sized by 1/√α (the Gaussian's spread), clickable
    const sizes = heads.map((hd) => Math.max(8, Math.min(70, 22 / Math.sqrt(hd.alpha))));
    traces.push({
      type: "scatter", mode: "markers+text", xaxis: xa, yaxis: ya,
      x: heads.map((hd) => hd.center[1]), y: heads.map((hd) => hd.center[0]),
      text: heads.map((_, h) => String(h)), textfont: { color: "#fff", size: 10 },
      customdata: heads.map((hd, h) => [l, h, hd.alpha]),
      hovertemplate: `layer ${l} head %{customdata[1]}<br>μ = (%{y:.2f}, %{x:.2f})<br>α = %{customdata[2]:.3f}<extra></extra>`,
      marker: {
        size: sizes, color: heads.map((_, h) => HEAD_COLORS[h % HEAD_COLORS.length]), opacity: 0.8,
        line: { width: heads.map((_, h) => (l === state.layer && h === state.head ? 3 : 1)), color: "#1d2230" },
      },
      name: `layer ${l} heads`,
    });
  }
  return { traces, layout };
}

function drawCenters() {
  const { traces, layout } = centersFigure();
  const el = $("centers-plot");
  react(el, traces, layout, PLOT_CONFIG);
  const entry = state.history[state.epochIndex];
  $("epoch-readout").textContent =
    `epoch ${entry.epoch} / ${state.history[state.history.length - 1].epoch} · test accuracy ${(100 * entry.accuracy).toFixed(2)} %` +
    (entry.train_loss != null ? ` · train loss ${entry.train_loss.toFixed(4)}` : " · initialisation");
}

// ---------------------------------------------------------------------------------------------
// one head's attention

function headOf() {
  return state.history[state.epochIndex].layers[state.layer].heads[state.head];
}

async function drawAttention() {
  const entry = state.history[state.epochIndex];
  const body = { model: state.model, epoch: entry.epoch, layer: state.layer, head: state.head,
    query: state.query, alpha: state.alphaOverride };
  let res;
  try {
    res = await postJSON("/api/gaussian/attention", body, { channel: "gaussian-attention" });
  } catch (err) { report(err); return; }
  const [rows, cols] = res.grid;
  const traces = [
    { type: "heatmap", z: res.probs, colorscale: "Viridis", zmin: 0, zmax: Math.max(1e-9, res.max_prob),
      hovertemplate: "key (%{y}, %{x})<br>P = %{z:.6f}<extra></extra>", colorbar: { thickness: 12 } },
    { type: "scatter", mode: "markers", x: [state.query[1]], y: [state.query[0]], hoverinfo: "skip",
      marker: { symbol: "square-open", size: 18, color: "#fff", line: { width: 2 } }, name: "query" },
    { type: "scatter", mode: "markers", x: [res.target[1]], y: [res.target[0]], hoverinfo: "skip",
      marker: { symbol: "x-thin-open", size: 14, color: "#ff6b6b", line: { width: 2 } }, name: "q + μ" },
  ];
  // A square grid, the figure as tall as the grid is wide: with a fixed height and only x constrained, a
  // phone's narrow figure stretched the y axis to rows −2.8 … 15.8 of a 14-row grid.
  const el = $("attention-plot");
  const margin = { l: 44, r: 10, t: 10, b: 48 };
  const side = Math.max(160, Math.min(360, (el.clientWidth || 400) - margin.l - margin.r - 70)); // 70: colour bar
  const dtick = side / cols >= 18 ? 1 : 2; // tick labels that fit
  const layout = {
    margin, height: side + margin.t + margin.b, showlegend: false,
    xaxis: { range: [-0.5, cols - 0.5], dtick, title: { text: "key col", standoff: 8 }, constrain: "domain" },
    yaxis: { range: [rows - 0.5, -0.5], dtick, scaleanchor: "x", title: { text: "key row", standoff: 4 }, constrain: "domain" },
  };
  react(el, traces, layout, PLOT_CONFIG);
  const learned = headOf().alpha;
  const where = res.nearest_pixel ? `(${res.nearest_pixel[0]}, ${res.nearest_pixel[1]})` : "outside the grid";
  $("alpha-readout").textContent =
    `α = ${fmt(res.alpha)}${state.alphaOverride === null ? " (learned)" : ` (learned ${fmt(learned)})`} · ` +
    `μ = (${res.center[0].toFixed(2)}, ${res.center[1].toFixed(2)}) · q + μ ≈ ${where} · ` +
    `P there = ${res.prob_at_nearest === null ? "–" : res.prob_at_nearest.toFixed(6)} · max P = ${res.max_prob.toFixed(6)}`;
  $("head-title").textContent = `layer ${state.layer}, head ${state.head}, query (${state.query[0]}, ${state.query[1]}), epoch ${entry.epoch}`;
}

function syncSelects() {
  $("layer-select").value = String(state.layer);
  $("head-select").value = String(state.head);
}

// ---------------------------------------------------------------------------------------------
// attention ⇔ convolution

async function drawConv() {
  const logAlpha = Number($("conv-alpha-slider").value);
  const body = {
    kernel_size: Number($("conv-kernel").value), dilation: Number($("conv-dilation").value),
    padding: $("conv-padding").value, alpha: 10 ** logAlpha, image_size: 16, channels_in: 3, channels_out: 4, seed: 0,
  };
  let res;
  try {
    res = await postJSON("/api/gaussian/conv-equivalence", body, { channel: "gaussian-conv" });
  } catch (err) { report(err); return; }
  const ch = Number($("conv-channel").value);
  const conv = res.conv[ch], mhsa = res.mhsa[ch];
  const diff = conv.map((row, i) => row.map((v, j) => Math.abs(mhsa[i][j] - v)));
  let lo = Infinity, hi = -Infinity;
  for (const z of [conv, mhsa]) for (const row of z) for (const v of row) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  const heat = (z, xa, ya, title, extra = {}) => ({ type: "heatmap", z, xaxis: xa, yaxis: ya, name: title,
    hovertemplate: `${title} (%{y}, %{x}): %{z:.6g}<extra></extra>`, ...extra });
  const traces = [
    heat(conv, "x", "y", "conv", { colorscale: "RdBu", zmin: lo, zmax: hi, showscale: false }),
    heat(mhsa, "x2", "y2", "attention", { colorscale: "RdBu", zmin: lo, zmax: hi, showscale: false }),
    heat(diff, "x3", "y3", "|difference|", { colorscale: "Greys", reversescale: true, zmin: 0,
      zmax: Math.max(1e-12, res.max_abs_error), colorbar: { thickness: 10, x: 1.0 } }),
  ];
  const axis = (d) => ({ domain: d, showticklabels: false, ticks: "" });
  const yaxis = (anchor) => ({ autorange: "reversed", showticklabels: false, scaleanchor: anchor, ticks: "" });
  const layout = {
    height: 250, margin: { l: 10, r: 30, t: 28, b: 10 },
    xaxis: axis([0, 0.3]), xaxis2: axis([0.34, 0.64]), xaxis3: axis([0.68, 0.96]),
    yaxis: yaxis("x"), yaxis2: { ...yaxis("x2"), anchor: "x2" }, yaxis3: { ...yaxis("x3"), anchor: "x3" },
    // short titles where three panels share a phone's width (the long ones overlapped)
    annotations: (($("conv-plot")?.clientWidth || 900) < 520
      ? [{ text: "conv", x: 0.15 }, { text: "attention", x: 0.49 }, { text: "|diff|", x: 0.82 }]
      : [{ text: "zero-padded conv", x: 0.15 }, { text: "attention layer", x: 0.49 }, { text: "|difference|", x: 0.82 }]
    ).map((a) => ({ ...a, xref: "paper", yref: "paper", y: 1.12, showarrow: false })),
  };
  layout.xaxis2.anchor = "y2";
  layout.xaxis3.anchor = "y3";
  react($("conv-plot"), traces, layout, PLOT_CONFIG);

  const errTraces = [
    { type: "scatter", mode: "lines+markers", x: res.error_by_alpha.map((p) => p[0]),
      y: res.error_by_alpha.map((p) => Math.max(p[1], 1e-17)), name: "max |error|", line: { color: "#3b5bdb" } },
    { type: "scatter", mode: "markers", x: [body.alpha], y: [Math.max(res.max_abs_error, 1e-17)], name: "this α",
      marker: { size: 12, color: "#e8590c", symbol: "diamond" } },
  ];
  const errLayout = {
    height: 240, margin: { l: 56, r: 10, t: 10, b: 40 }, showlegend: true, legend: { x: 0.6, y: 1 },
    xaxis: { type: "log", title: { text: "α", standoff: 2 } },
    yaxis: { type: "log", title: { text: "max |MHSA − conv|", standoff: 2 }, exponentformat: "power" },
  };
  react($("conv-error-plot"), errTraces, errLayout, PLOT_CONFIG);
  const interior = res.interior_max_abs_error === null ? "– (no interior pixel)" : res.interior_max_abs_error.toExponential(2);
  $("conv-readout").textContent =
    `${count(res.heads, "head")} · α = ${fmt(body.alpha, 3)} · max |error| = ${res.max_abs_error.toExponential(2)} · ` +
    `interior max |error| = ${interior} · zero-token border = ${res.padding_width}`;
  $("stride-note").textContent = res.stride_note;
}

// ---------------------------------------------------------------------------------------------
// building blocks: GELU, parameter count and cost

async function drawBlocks() {
  let res;
  try { res = await getJSON(`/api/gaussian/blocks?model=${encodeURIComponent(state.model)}`); } catch (err) { report(err); return; }
  const g = res.gelu;
  const diff = g.exact.map((v, i) => v - g.tanh[i]);
  react($("gelu-plot"), [
    { type: "scatter", mode: "lines", x: g.x, y: g.exact, name: "exact x·Φ(x)", line: { color: "#3b5bdb", width: 3 } },
    { type: "scatter", mode: "lines", x: g.x, y: g.tanh, name: "tanh approx.", line: { color: "#e8590c", dash: "dash" } },
    { type: "scatter", mode: "lines", x: g.x, y: diff, name: "exact − tanh", yaxis: "y2", line: { color: "#868e96", width: 1 } },
  ], {
    height: 280, margin: { l: 40, r: 60, t: 10, b: 30 }, legend: { x: 0.02, y: 0.98 },
    yaxis: { title: { text: "GELU(x)", standoff: 2 } },
    yaxis2: { overlaying: "y", side: "right", title: { text: "difference", standoff: 2 }, exponentformat: "power", showgrid: false },
  }, PLOT_CONFIG);
  $("gelu-readout").textContent = `Largest |exact − tanh| on [−4, 4]: ${g.max_abs_difference.toExponential(2)}. This model uses “${res.config.gelu}”.`;

  const p = res.params, c = res.cost, cp = res.cordonnier_params, cc = res.cordonnier_cost;
  const rows = [
    ["", "this model", "Cordonnier et al."],
    ["tokens T, width d, heads × head dim", `${c.tokens}, ${c.hidden}, ${c.heads}×${c.head_dim}`, `${cc.tokens}, ${cc.hidden}, ${cc.heads}×${cc.head_dim}`],
    ["params: Gaussian attention (μ, α, W_v, W_out)", fmtInt(p.attention_gaussian), fmtInt(cp.attention_gaussian)],
    ["params: content attention (W_q, W_k, W_v, W_out)", fmtInt(p.attention_content), fmtInt(cp.attention_content)],
    ["params: FFN + 2 LayerNorms", fmtInt(p.ffn + p.layer_norms), fmtInt(cp.ffn + cp.layer_norms)],
    ["params: one layer (Gaussian)", fmtInt(p.layer_gaussian), fmtInt(cp.layer_gaussian)],
    ["mult-adds per image: scores, content (T² d)", fmtInt(c.content.scores), fmtInt(cc.content.scores)],
    ["mult-adds per image: scores, Gaussian (H T², once per batch)", fmtInt(c.gaussian.scores), fmtInt(cc.gaussian.scores)],
    ["mult-adds per image: one layer, content", fmtInt(c.content.total), fmtInt(cc.content.total)],
    ["mult-adds per image: one layer, Gaussian", fmtInt(c.gaussian.total), fmtInt(cc.gaussian.total)],
  ];
  $("cost-table").innerHTML = rows.map((r, i) =>
    `<tr>${r.map((v) => (i === 0 ? `<th>${v}</th>` : `<td>${v}</td>`)).join("")}</tr>`).join("");
}

// ---------------------------------------------------------------------------------------------
// wiring

function setEpochIndex(i) {
  state.epochIndex = Math.max(0, Math.min(state.history.length - 1, i));
  $("epoch-slider").value = String(state.epochIndex);
  drawCenters();
  drawAttention();
}

function togglePlay() {
  if (state.playing) {
    clearInterval(state.playing);
    state.playing = null;
    $("play-button").textContent = "▶ Play";
    return;
  }
  if (state.epochIndex >= state.history.length - 1) setEpochIndex(0);
  $("play-button").textContent = "❚❚ Pause";
  state.playing = setInterval(() => {
    if (state.epochIndex >= state.history.length - 1) { togglePlay(); return; }
    setEpochIndex(state.epochIndex + 1);
  }, 700);
}

async function loadModel(modelId) {
  state.model = modelId;
  const [history] = await Promise.all([getJSON(`/api/gaussian/history?model=${encodeURIComponent(modelId)}`)]);
  state.history = history.epochs;
  const models = (await getJSON("/api/gaussian/models")).models;
  state.info = models.find((m) => m.id === modelId);
  const info = state.info;
  $("run-title").textContent =
    `${info.id}: ${info.dataset}, ${count(info.layers, "layer")} × ${count(info.heads, "head")}, grid ${info.grid[0]}×${info.grid[1]}, ` +
    `${fmtInt(info.parameters)} parameters${info.position_embedding ? " (with a learned position embedding)" : ""}, ` +
    `${info.train_images ? `${fmtInt(info.train_images)} training images per epoch, ` : ""}` +
    `final test accuracy ${(100 * info.accuracy).toFixed(2)} %` +
    (info.continued || []).map((c) => `; continued from epoch ${c.from_epoch} on ${c.train_images ? fmtInt(c.train_images) : "all"} training images`).join("") +
    (info.wall_time_s ? `, trained in ${(info.wall_time_s / 60).toFixed(1)} min` : "");
  const plain = (n) => Array.from({ length: n }, (_, i) => [i, String(i)]);
  setOptions($("layer-select"), plain(info.layers));
  setOptions($("head-select"), plain(info.heads));
  state.query = [Math.floor(info.grid[0] / 2), Math.floor(info.grid[1] / 2)];
  $("epoch-slider").max = String(state.history.length - 1);
  syncSelects();
  setEpochIndex(state.history.length - 1);
}

function bindEvents() {
  $("epoch-slider").addEventListener("input", (e) => setEpochIndex(Number(e.target.value)));
  $("play-button").addEventListener("click", togglePlay);
  $("layer-select").addEventListener("change", (e) => { state.layer = Number(e.target.value); drawCenters(); drawAttention(); });
  $("head-select").addEventListener("change", (e) => { state.head = Number(e.target.value); drawCenters(); drawAttention(); });
  $("alpha-slider").addEventListener("input", (e) => {
    const v = Number(e.target.value);
    state.alphaOverride = v <= Number(e.target.min) ? null : 10 ** v;
    drawAttention();
  });
  $("alpha-reset").addEventListener("click", () => {
    state.alphaOverride = null;
    $("alpha-slider").value = $("alpha-slider").min;
    drawAttention();
  });
  $("model-select").addEventListener("change", (e) => loadModel(e.target.value).catch(report));
  for (const id of ["conv-kernel", "conv-dilation", "conv-padding", "conv-channel"]) $(id).addEventListener("change", drawConv);
  $("conv-alpha-slider").addEventListener("input", drawConv);

  const centers = $("centers-plot");
  centers.on("plotly_click", (ev) => {
    const pt = ev.points.find((p) => Array.isArray(p.customdata));
    if (!pt) return;
    [state.layer, state.head] = pt.customdata;
    syncSelects();
    drawCenters();
    drawAttention();
  });
  const attention = $("attention-plot");
  attention.on("plotly_click", (ev) => {
    const pt = ev.points.find((p) => p.data.type === "heatmap");
    if (!pt) return;
    state.query = [Number(pt.y), Number(pt.x)];
    drawAttention();
  });
}

async function main() {
  const models = config.models.length ? config.models : [config.model];
  $("model-select").innerHTML = models.map((m) => `<option value="${m}">${m}</option>`).join("");
  // Draw empty figures first so the click handlers can be attached, then fill them.
  for (const id of ["centers-plot", "attention-plot"]) Plotly.newPlot($(id), [], {}, PLOT_CONFIG);
  bindEvents();
  setStatus("loading the trained run…");
  await Promise.all([loadModel(config.model), drawConv(), drawBlocks()]);
  setStatus("");
}

main().catch(report);
