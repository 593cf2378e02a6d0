// "Why the scale is 1/√d" on the text page (docs/science.md): POST /api/text/score_stats's answer for the shown head —
// the histogram of the raw scores q·k over the pairs the model's mask allows, the Gaussian of the theory for
// independent entries fitted with the head's own μ and σ drawn over it, the rows' softmax entropy at scale 1 and
// 1/√d, and the attention's parameters counted by the textbook's formula beside the model's real tensors.
//
// Beside it, the permutation check (POST /api/text/permutation_check, encoders): with positions off the maps of the
// permuted tokens are the permuted maps, max |P(πx) − Π P(x) Πᵀ| shown with positions off and on.
//
// mountScaleStats(anchor, {request}): the panel goes before `anchor`; request() gives {model, text, layer, head}
// of the shown view. Returns {open(), check()}.
import { postJSON } from "../api.js";
import { button, el } from "../dom.js";
import { fmt } from "../mathx.js";
import { loadPlotly } from "../vendor.js";

const CONFIG = { responsive: true, displaylogo: false };
const int = (n) => Number(n).toLocaleString("en");

export function mountScaleStats(anchor, { request }) {
  const status = el("p", { className: "help", id: "scale-status", role: "status" },
    "the raw scores of the shown head: press the button (one run of the model)");
  const plot = el("div", { id: "scale-histogram", className: "plot grow", style: "height:320px" });
  const facts = el("dl", { id: "scale-facts", className: "kv grow" });
  const counting = el("div", { id: "scale-counting", className: "help" });
  const go = button("scores of this head", () => open(), { id: "scale-button", title: "POST /api/text/score_stats" });
  const permSeed = el("input", { id: "perm-seed", type: "number", min: "0", step: "1", value: "0", style: "width:64px",
    "aria-label": "seed of the permutation" });
  const permLine = el("p", { id: "perm-result", className: "mono", role: "status" });
  const permute = button("permute the tokens", () => check(), { id: "perm-button", title: "POST /api/text/permutation_check" });
  const permutation = el("div", { className: "lab-control" },
    el("h3", {}, "Positions off: a permuted input gives the permuted map"),
    el("div", { className: "controls" }, permute, el("label", {}, "seed ", permSeed)), permLine,
    el("p", { className: "help", textContent: "The tokens between [CLS] and [SEP] are permuted (π from the seed) and the "
      + "model runs on both orders, with positions off (the Positions intervention) and on. Without positions every "
      + "step but the attention acts on one token at a time and Π Q Kᵀ Πᵀ is the permuted score matrix, so "
      + "P(πx) = Π P(x) Πᵀ up to float rounding; with positions on it is another input. Encoders only: a decoder's "
      + "causal mask is not symmetric under permutations." }));
  const panel = el("section", { className: "panel", id: "scale-panel" },
    el("h2", {}, "Why the scale is 1/√d ", el("small", {}, "raw q·k of the shown head, its Gaussian theory, the softmax with and without the scale"), " ", go),
    status, el("div", { className: "row" }, plot, facts), counting,
    el("p", { className: "help", textContent:
      "For q, k ∈ Rᵈ with independent entries q_m ~ N(μ_q, σ_q²), k_m ~ N(μ_k, σ_k²): E[qᵀk] = d μ_q μ_k and "
      + "Var(qᵀk) = d(σ_q²σ_k² + μ_q²σ_k² + μ_k²σ_q²) (with one μ, σ: dμ² and d(σ⁴ + 2μ²σ²)). The spread grows like √d, "
      + "so without the 1/√d the softmax saturates: each row's entropy falls towards 0 (one-hot). The curve is that "
      + "Gaussian, fitted with this head's own μ and σ of the entries of q and of k; a real head's entries are not "
      + "independent, which is why the bars can differ from it (see the guide)." }), permutation);
  anchor.before(panel);
  let pending = null;

  async function open() {
    const body = request();
    if (!body) { status.textContent = "run the model first"; return; }
    status.textContent = `layer ${body.layer}, head ${body.head}: computing (one run of the model)…`;
    const mine = {};
    pending = mine;
    try {
      const answer = await postJSON("/api/text/score_stats", body, { channel: "scale" });
      if (pending !== mine) return;
      await draw(await loadPlotly(), answer);
    } catch (err) {
      if (err?.name === "AbortError" || pending !== mine) return;
      status.textContent = `score statistics: ${err.message ?? err}`;
    }
  }

  async function draw(P, a) {
    const edges = a.histogram.edges, counts = a.histogram.counts;
    const width = edges[1] - edges[0];
    const centres = counts.map((_, i) => (edges[i] + edges[i + 1]) / 2);
    const t = a.theory;
    const xs = Array.from({ length: 200 }, (_, i) => edges[0] + (i / 199) * (edges[edges.length - 1] - edges[0]));
    const gauss = xs.map((x) => a.pairs * width * Math.exp(-((x - t.mean) ** 2) / (2 * t.variance)) / Math.sqrt(2 * Math.PI * t.variance));
    P.react(plot, [
      { type: "bar", x: centres, y: counts, width, name: "measured q·k", marker: { color: "#4c78a8" },
        hovertemplate: "q·k ≈ %{x:.3g}: %{y} pairs<extra></extra>" },
      { type: "scatter", mode: "lines", x: xs, y: gauss, name: "theory N(dμ_qμ_k, Var)", line: { color: "#f58518", width: 2 } },
    ], { margin: { l: 50, r: 10, t: 30, b: 40 }, title: { text: `layer ${a.layer}, head ${a.head}: ${int(a.pairs)} pairs${a.causal ? " (j ≤ i)" : ""}`, font: { size: 13 } },
      xaxis: { title: { text: "raw score q·k (unscaled)" } }, yaxis: { title: { text: "pairs" } }, legend: { x: 0.01, y: 0.99, bgcolor: "rgba(255,255,255,0.7)" } }, CONFIG);
    const e = a.entropy;
    const rows = [
      ["d (head dim)", a.head_dim],
      ["mean q·k", `${fmt(a.mean)}   theory d μ_q μ_k = ${fmt(t.mean)}`],
      ["variance", `${fmt(a.variance)}   theory ${fmt(t.variance)} (pooled μ, σ: ${fmt(t.pooled.variance)})`],
      ["fitted", `μ_q = ${fmt(t.fit.mean_q)}, σ_q = ${fmt(t.fit.std_q)}, μ_k = ${fmt(t.fit.mean_k)}, σ_k = ${fmt(t.fit.std_k)}`],
      ["row entropy, scale 1", `${fmt(e.scale_1)} nats`],
      ["row entropy, scale 1/√d", `${fmt(e.scale_inv_sqrt_d)} nats`],
      ["row entropy, model's β₀", `${fmt(e.native)} nats (β₀ = ${fmt(a.native_beta)}); uniform: ${fmt(e.uniform)}`],
    ];
    facts.replaceChildren(...rows.flatMap(([k, v]) => [el("dt", {}, k), el("dd", { className: "mono" }, String(v))]));
    const c = a.counting, m = a.maps, l0 = c.layer0;
    const shapes = l0.tensors.map((x) => `${x.name} ${x.shape.join("×")}`).join(", ");
    counting.replaceChildren(
      el("p", { id: "scale-count-textbook" }, `Textbook count at D = d_model = ${int(c.d_model)}: 3D² = ${int(c.textbook.qkv_weights)} weights for W_Q, W_K, W_V `
        + `and D² = ${int(c.textbook.output_weights)} for W_O, ${int(c.textbook.weights)} weights and ${int(c.textbook.biases)} biases per layer.`),
      el("p", { id: "scale-count-real" }, `This model, per layer: ${int(l0.weights)} weights, ${int(l0.biases)} biases${l0.other ? `, ${int(l0.other)} other (q/k norms)` : ""} `
        + `— ${c.heads} query heads, ${c.kv_heads} K/V heads${c.kv_heads < c.heads ? " (grouped-query attention: K and V are smaller)" : ""}, head_dim ${c.head_dim}; `
        + `${c.layers} layers, ${int(c.total_parameters)} attention parameters in all. Tensors: ${shapes}.`),
      el("p", { id: "scale-count-maps" }, `This input: N = ${m.tokens} tokens → N² = ${int(m.per_head)} attention weights per head`
        + `${m.allowed_per_head !== m.per_head ? ` (${int(m.allowed_per_head)} allowed by the causal mask)` : ""}, ${int(m.per_layer)} per layer, ${int(m.total)} in all.`),
    );
    status.textContent = `measured variance ${fmt(a.variance)} against the theory's ${fmt(t.variance)}; `
      + `without the scale the rows' entropy falls from ${fmt(e.scale_inv_sqrt_d)} to ${fmt(e.scale_1)} nats`;
  }

  async function check() {
    const body = request();
    if (!body) { permLine.textContent = "run the model first"; return; }
    permLine.textContent = "permuting (four runs of the model)…";
    try {
      const a = await postJSON("/api/text/permutation_check", { model: body.model, text: body.text,
        seed: Math.max(0, Math.round(Number(permSeed.value) || 0)) }, { channel: "permutation" });
      permLine.textContent = `π = [${a.order.join(", ")}]: max |P(πx) − Π P(x) Πᵀ| over every layer and head = `
        + `${a.max_abs_positions_off.toExponential(2)} with positions off, ${a.max_abs_positions_on.toExponential(2)} with positions on`;
    } catch (err) {
      if (err?.name === "AbortError") return;
      permLine.textContent = `permutation check: ${err.message ?? err}`;
    }
  }

  return { open, check };
}
