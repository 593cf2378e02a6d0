// Softmax panel (§2): one row's probabilities p = softmax(β s) and the Jacobian
// ∂p/∂s = β (diag(p) − p pᵀ), for a query row of the selected head or an editable score vector.
// The default vector (−3, 1, 100, 5, −1) at β = 1 shows saturation: every Jacobian entry ≈ 0.
import { entropy, fmt, maxAbs, softmaxRow } from "../mathx.js";
import { guideLinks } from "../guide-links.js";
import { pngButton } from "./export.js";
import { el } from "../dom.js";

const CONFIG = { responsive: true, displaylogo: false };
export const DEFAULT_VECTOR = [-3, 1, 100, 5, -1];

export function jacobian(p, beta) {
  return p.map((pi, i) => p.map((pj, j) => beta * ((i === j ? pi : 0) - pi * pj)));
}

export function parseVector(text) {
  const parts = text.replace(/−/g, "-").split(/[\s,;]+/).filter(Boolean);
  if (!parts.length) throw new Error("the score vector is empty");
  if (parts.length > 64) throw new Error("the score vector has more than 64 entries");
  return parts.map((s) => {
    const v = Number(s);
    if (!Number.isFinite(v)) throw new Error(`score vector: '${s}' is not a finite number`);
    return v;
  });
}

// mount(container, {onError, jacobianKeys, jacobianHeight}) → {update({tokens, scores (T×T Ŝ), masked, beta, query, queryLabels, onQuery})}
// update({empty: why}) (no scores): the row source says it has no row, and why.
// jacobianKeys: at most this many keys in the Jacobian figure, those with the most probability (a speech row has 1,500
// keys of 20 ms: drawn whole, the figure is a few pixels a key and mostly zeros); jacobianHeight: its height in px.
// masked: bool[] (the same keys for every row) or a function of the query row → bool[] (a causal map masks
// j > i, so each row has its own mask). onQuery(i): the page's own query selection follows the dropdown.
export function mountSoftmaxPanel(container, { onError = () => {}, jacobianKeys = Infinity, jacobianHeight = 300 } = {}) {
  const source = el("select", { id: "softmax-source" });
  source.append(new Option("selected query row of this head", "row"), new Option("my score vector", "vector"));
  const query = el("select", { id: "softmax-query" });
  const vector = el("input", { id: "softmax-vector", type: "text", value: DEFAULT_VECTOR.join(", ") });
  vector.style.width = "200px";
  const betaInput = el("input", { id: "softmax-beta", type: "number", value: "1", step: "any", min: "0" });
  betaInput.style.width = "80px";
  const readout = el("div", { id: "softmax-readout", className: "help mono" });
  const bars = el("div", { id: "softmax-bars", className: "plot" });
  const jac = el("div", { id: "softmax-jacobian", className: "plot" });
  bars.style.height = "240px"; jac.style.height = `${jacobianHeight}px`;
  const rowControls = el("label", {}, "query ", query);
  const vectorControls = el("span", { className: "controls" }, el("label", {}, "s = ", vector), el("label", {}, "β ", betaInput));

  const figures = el("div", { className: "row" },
    el("div", { className: "grow" }, el("div", { className: "fig-tools" }, pngButton(bars, "attnlab-softmax-probabilities")), bars),
    el("div", { className: "grow" }, el("div", { className: "fig-tools" }, pngButton(jac, "attnlab-softmax-jacobian")), jac));
  container.replaceChildren(
    el("h2", {}, "Softmax and its Jacobian ", el("small", {}, ...guideLinks("p = softmax(β s),  ∂p/∂s = β (diag(p) − p pᵀ)  (§2)"))),
    el("div", { className: "controls" }, el("label", {}, "row ", source), rowControls, vectorControls),
    el("p", { className: "help" }, "The row uses the selected head's scores Ŝ and the current β and masks (click a heatmap cell to pick its query). "
      + "With a score far above the others (e.g. 100) the row is one-hot and every Jacobian entry is ≈ 0: the softmax is saturated and passes no gradient."),
    readout, figures,
  );

  let last = null;
  const redraw = () => last && update(last);
  source.addEventListener("change", redraw);
  query.addEventListener("change", () => {
    if (!last) return;
    last.query = Number(query.value);
    if (last.onQuery) last.onQuery(last.query); else redraw(); // the page redraws the panel with its new query
  });
  vector.addEventListener("change", redraw);
  betaInput.addEventListener("change", redraw);

  // No row to show (a long input holds no full scores, a run without scores): the row's figures are cleared and the
  // panel says why, rather than keep the previous input's row. The score vector needs no input and still works.
  function showEmpty(ctx) {
    rowControls.style.display = "none";
    vectorControls.style.display = "none";
    query.replaceChildren();
    delete query.dataset.sig;
    delete query.dataset.row;
    readout.textContent = `no query row: ${ctx?.empty ?? "nothing has run yet"}. Choose “my score vector” to try a vector of your own.`;
    readout.dataset.empty = "1";
    delete readout.dataset.maxJacobian;
    for (const plot of [bars, jac]) if (window.Plotly) Plotly.purge(plot);
    figures.style.display = "none";
  }

  function update(ctx) {
    last = ctx;
    if (source.value === "row" && !ctx?.scores) { showEmpty(ctx); return; }
    delete readout.dataset.empty;
    figures.style.display = "";
    const useRow = source.value === "row" && ctx && ctx.scores;
    rowControls.style.display = useRow ? "" : "none";
    vectorControls.style.display = useRow ? "none" : "";
    let s, beta, labels, masked = null;
    if (useRow) {
      // Query rows offered (default: every token) and key labels (default: the same tokens).
      const queries = ctx.queryLabels ?? ctx.tokens.map((t, i) => `${i}: ${t}`);
      if (query.dataset.sig !== queries.join("\u0001")) {
        query.replaceChildren(...queries.map((t, i) => new Option(t, i)));
        query.dataset.sig = queries.join("\u0001");
      }
      const q = Math.min(ctx.query ?? 0, queries.length - 1);
      query.value = q;
      s = ctx.scores[q];
      beta = ctx.beta;
      masked = typeof ctx.masked === "function" ? ctx.masked(q) : ctx.masked;
      query.dataset.row = String(q);
      labels = ctx.keyLabels ?? ctx.tokens.map((t, i) => `${i}:${t}`);
    } else {
      try {
        s = parseVector(vector.value);
        vector.classList.remove("invalid");
      } catch (err) {
        vector.classList.add("invalid");
        onError(err.message);
        return;
      }
      beta = Number(betaInput.value);
      if (!(beta > 0) || !Number.isFinite(beta)) { onError("softmax β must be a positive finite number"); return; }
      labels = s.map((v, i) => `s${i}=${v}`);
    }
    const p = softmaxRow(s, beta, masked);
    const J = jacobian(p, beta);
    const maxJ = maxAbs(J);
    readout.textContent = `β = ${fmt(beta)} · max p = ${fmt(maxAbs(p))} · entropy = ${fmt(entropy(p))} nats (log n = ${fmt(Math.log(p.length))}) · max |∂p/∂s| = ${fmt(maxJ)}`;
    readout.dataset.maxJacobian = String(maxJ);
    Plotly.react(bars, [{ type: "bar", x: labels, y: p, marker: { color: "#3b5bdb" }, hovertemplate: "%{x}<br>p = %{y:.6f}<extra></extra>" }], {
      title: { text: "probabilities p", font: { size: 13 } }, margin: { l: 45, r: 10, t: 30, b: 70 },
      xaxis: { type: "category", tickangle: -50, showticklabels: labels.length <= 40 }, yaxis: { range: [0, 1.02] },
    }, CONFIG);
    const zmax = Math.max(maxJ, 1e-12);
    // Too many keys to read: the keys with the most probability, in key order. Every entry in a row or column of a
    // key left out is at most β·max p of those keys (|β p_i (δ_ij − p_j)| ≤ β p_i and |β p_i p_j| ≤ β min(p_i, p_j)).
    const shown = p.length <= jacobianKeys ? p.map((_, j) => j)
      : p.map((v, j) => [v, j]).sort((a, b) => b[0] - a[0]).slice(0, jacobianKeys).map(([, j]) => j).sort((a, b) => a - b);
    const left = p.length - shown.length;
    const inShown = new Set(shown);
    const leftMax = left ? Math.max(...p.filter((_, j) => !inShown.has(j))) : 0;
    const mass = shown.reduce((sum, j) => sum + p[j], 0);
    const keyNames = shown.map((j) => labels[j]);
    jac.dataset.keys = String(shown.length);
    Plotly.react(jac, [{
      type: "heatmap", z: shown.map((i) => shown.map((j) => J[i][j])), x: keyNames, y: keyNames,
      colorscale: "RdBu", zmid: 0, zmin: -zmax, zmax, reversescale: true,
      hovertemplate: "∂p[%{y}] / ∂s[%{x}] = %{z:.3g}<extra></extra>", colorbar: { thickness: 10 },
    }], {
      title: { text: `Jacobian β(diag(p) − ppᵀ), max |entry| = ${fmt(maxJ, 3)}`
        + (left ? `<br><sub>the ${shown.length} keys with the most p (Σp = ${fmt(mass, 3)}); entries of the other ${left}: |·| ≤ ${fmt(beta * leftMax, 2)}</sub>` : ""),
        font: { size: 13 } },
      margin: { l: 90, r: 10, t: left ? 48 : 30, b: 130 },
      xaxis: { type: "category", tickangle: -50, showticklabels: shown.length <= 40, tickfont: { size: 10 }, title: { text: "score s_j of key j", font: { size: 11 }, standoff: 4 } },
      yaxis: { type: "category", autorange: "reversed", showticklabels: shown.length <= 40, tickfont: { size: 10 }, title: { text: "p_i of key i", font: { size: 11 }, standoff: 4 } },
    }, CONFIG);
  }
  return { update, setSource: (v) => { source.value = v; redraw(); } };
}
