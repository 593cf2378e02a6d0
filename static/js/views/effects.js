// The effect panel: output change, hidden-state cosine per layer, attention TV per layer × head.
import { fmt } from "../mathx.js";

const CONFIG = { responsive: true, displaylogo: false };

// tv: the TV grid to draw ([L][H]); by default the response's own (an encoder–decoder page picks a kind).
export function drawEffect({ outputEl, hiddenEl, tvEl, warningsEl }, response, { tv = null } = {}) {
  const effect = response.effect;
  warningsEl.textContent = (response.warnings || []).join(" · ");
  if (!effect) {
    outputEl.innerHTML = "<dt>no interventions</dt><dd>change β, mask a key, ablate or perturb</dd>";
    Plotly.react(hiddenEl, [], emptyLayout("hidden-state cosine per layer"), CONFIG);
    Plotly.react(tvEl, [], emptyLayout("attention change (TV) per layer × head"), CONFIG);
    return;
  }
  outputEl.replaceChildren(...outputRows(effect.output));
  const hc = effect.hidden_cosine;
  const trace = {
    type: "scatter", mode: "lines+markers", x: hc.map((_, i) => (i === 0 ? "emb" : `L${i - 1}`)), y: hc,
    name: "cosine", line: { color: "#3b5bdb" },
  };
  if (effect.hidden_cosine_std) trace.error_y = { type: "data", array: effect.hidden_cosine_std, visible: true };
  Plotly.react(hiddenEl, [trace], {
    title: { text: "hidden-state cosine (after vs before)", font: { size: 13 } },
    margin: { l: 70, r: 10, t: 30, b: 35 }, yaxis: { range: cosineRange(hc, effect.hidden_cosine_std) },
  }, CONFIG);
  tv ??= effect.attention_tv_all || effect.attention_tv;
  if (!tv) { // a long input's runs keep no maps: no TV (docs/science.md §10)
    Plotly.react(tvEl, [], { ...emptyLayout("attention change (TV) per layer × head"),
      annotations: [{ text: "not computed for inputs over full_map_tokens", showarrow: false, font: { color: "#667085" } }] }, CONFIG);
    return;
  }
  Plotly.react(tvEl, [{
    type: "heatmap", z: tv, colorscale: "Reds", zmin: 0, zmax: Math.max(1e-6, ...tv.flat()),
    hovertemplate: "layer %{y}, head %{x}<br>TV = %{z:.4f}<extra></extra>", colorbar: { thickness: 10 },
  }], {
    title: { text: "attention change: mean TV ½Σ|P̂−P|", font: { size: 13 } },
    margin: { l: 40, r: 10, t: 30, b: 35 }, xaxis: { title: { text: "head" } },
    yaxis: { title: { text: "layer" }, autorange: "reversed" },
  }, CONFIG);
}

// Zoom in when every cosine is close to 1 (small changes stay visible), error bars included.
function cosineRange(hc, std) {
  const low = Math.min(...hc.map((v, i) => v - (std ? std[i] : 0)));
  if (low < 0.5) return [Math.min(0, low), 1.02];
  const pad = Math.max(1e-6, (1 - low) * 0.15);
  return [low - pad, 1 + pad];
}

function emptyLayout(text) {
  return { title: { text, font: { size: 13 } }, margin: { l: 40, r: 10, t: 30, b: 30 },
    xaxis: { visible: false }, yaxis: { visible: false },
    annotations: [{ text: "no interventions active", showarrow: false, font: { color: "#667085" } }] };
}

function outputRows(output) {
  const rows = [];
  const add = (k, v) => {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = v;
    rows.push(dt, dd);
  };
  const std = (k) => (output[`${k}_std`] !== undefined ? ` ± ${fmt(output[`${k}_std`], 2)}` : "");
  if (output.kind === "similarity") {
    add("sentence-embedding cosine (after vs before)", fmt(output.embedding_cosine) + std("embedding_cosine"));
    if (output.similarity_before !== undefined) {
      add("similarity to the second sentence, before", fmt(output.similarity_before));
      add("… after", fmt(output.similarity_after) + std("similarity_after"));
    }
  } else if (output.kind === "embedding") {
    add("[CLS] cosine (after vs before)", fmt(output.cls_cosine) + std("cls_cosine"));
  } else if (output.kind === "mlm") {
    output.before.forEach((m, i) => {
      const top = (x) => x.top.map((t) => `${t.token} ${fmt(t.prob, 2)}`).join(", ");
      add(`[MASK] @${m.position} before`, top(m));
      add("… after", top(output.after[i]));
      add("… KL(before ‖ after)", fmt(output.kl[i]));
    });
  } else if (output.kind === "classes") {
    const top = (ps) => ps.map((p) => `${p.label} ${fmt(p.prob, 2)}`).join(", ");
    add("predictions before", top(output.before));
    add("predictions after", top(output.after));
    add("KL(before ‖ after)", fmt(output.kl) + std("kl"));
  } else if (output.kind === "next_token") {
    const top = (list) => list.slice(0, 5).map((t) => `${JSON.stringify(t.token)} ${fmt(t.prob, 2)}`).join(", ");
    add(`next token after position ${output.position}: KL(before ‖ after)`, fmt(output.kl) + std("kl"));
    add("p(before's top) after − before", fmt(output.prob_change) + std("prob_change"));
    add("top before", top(output.top_before));
    add("top after", top(output.top_after));
  } else if (output.kind === "seq2seq") {
    const kl = output.kl ?? [];
    add("target tokens", String(output.probs_before?.length ?? kl.length));
    add("mean KL(before ‖ after) per target token", fmt(kl.reduce((a, b) => a + b, 0) / Math.max(1, kl.length)));
  }
  return rows;
}
