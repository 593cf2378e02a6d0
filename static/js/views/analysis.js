// Beyond attention weights on the text page (templates/partials/analysis.html): a patching scan between two prompts
// with its progress, drawn as layers × heads (or layers × positions) beside attribution patching; clicking a cell
// applies that patch (patch_heads, or patch_residual at that layer and position) to the corrupted prompt and shows
// the next token move; the logit lens (before/after the page's interventions); the faithfulness check of four
// attributions.
//
// mountAnalysis({info, text, interventions, store, onError}): info() the selected ModelInfo, text() the prompt box,
// interventions() the lab's list, store the lab's store (static/js/lab/store.js): the panels follow the model it
// announces (changed "model"; decoder LMs; faithfulness also encoders).
import { postJSON } from "../api.js";
import { jobClock, postJob, showJobFailure } from "./jobs.js";
import { byId, el, fillList, showToken } from "../dom.js";
import { fmt } from "../mathx.js";
import { loadPlotly } from "../vendor.js";
import { drawSet, followSource, setRequestFields } from "./patchset.js";

const CONFIG = { responsive: true, displaylogo: false };
const DIVERGING = [[0, "#b2182b"], [0.5, "#f7f7f7"], [1, "#2166ac"]];

export function mountAnalysis({ info, text, interventions, store, onError = () => {} }) {
  const panels = { patching: byId("patching-panel"), lens: byId("lens-panel"), faith: byId("faith-panel") };
  if (!panels.patching) return { follow() {} };
  const isLM = () => info()?.output === "next_token";
  const follow = () => {
    const output = info()?.output;
    panels.patching.hidden = !isLM();
    panels.lens.hidden = !isLM();
    panels.faith.hidden = !output || output === "seq2seq";
  };
  mountPatching(info, onError);
  mountLens(info, text, interventions);
  mountFaithfulness(info, text);
  // the token each answer box will be, refreshed when the box, its prompt or the model changes
  const hints = [
    answerHint(byId("patch-answer"), info, () => byId("patch-clean").value, [byId("patch-clean")]),
    answerHint(byId("patch-wrong"), info, () => byId("patch-corrupt").value, [byId("patch-corrupt")]),
    answerHint(byId("faith-answer"), info, text, [byId("text-input")], { optional: true }),
  ];
  const refresh = () => {
    follow();
    byId("faith-answer-box").hidden = !isLM(); // encoders' faithfulness has no answer token
    if (isLM()) hints.forEach((h) => h.check());
  };
  // the lens and the faithfulness chart of another prompt: dimmed once the prompt box no longer holds it
  byId("text-input")?.addEventListener("input", () => {
    for (const [panel, plot] of [["lens-panel", "lens-plot"], ["faith-panel", "faith-plot"]]) {
      const shown = byId(panel).dataset.text;
      byId(plot).classList.toggle("stale", shown !== undefined && shown !== text());
    }
  });
  // the page took up a model (the first one too): the panels and the answer boxes follow it
  store?.subscribe(({ what }) => { if (what === "model") refresh(); });
  if (info()) refresh();
  return { follow };
}

// ---- answer tokens -------------------------------------------------------------------------------------------
// "Anna" and " Anna" are two tokens (smollm2-135m: ids 46484 and 16435); after a prompt that ends without a space
// the model's next word is the spaced one, so "Anna" scans the wrong token and no refusal says so. Under the box:
// the token that will be used, its white space visible, with its id ("␣Paris · id 7042"); several tokens are
// refused by the server, so say so here first; and when the prompt ends without a space and the answer has none,
// offer the spaced variant in one click (POST /api/text/tokenize).
function answerHint(input, info, prompt, prompts, { optional = false } = {}) {
  const hint = byId(`${input.id}-token`);
  let controller = null, timer = null;
  async function check() {
    controller?.abort();
    const value = input.value, model = info()?.id;
    hint.classList.remove("bad");
    delete hint.dataset.id;
    delete hint.dataset.suggest;
    if (!model || info()?.output !== "next_token") { hint.replaceChildren(); return; }
    if (!value) {
      hint.textContent = optional ? "empty: the model's top prediction" : "empty: type one token, e.g. ␣Paris";
      hint.classList.toggle("bad", !optional);
      return;
    }
    const mine = new AbortController();
    controller = mine;
    let r;
    try {
      r = await postJob("/api/text/tokenize", { model, text: value }, { signal: mine.signal });
    } catch (err) {
      if (err.name !== "AbortError") { hint.textContent = `cannot tokenize: ${err.message}`; hint.classList.add("bad"); }
      return;
    }
    if (controller !== mine || input.value !== value) return;
    const code = (t, id) => [el("span", { className: "tok-id", textContent: showToken(t) }), ` · id ${id}`];
    if (r.ids.length !== 1) {
      hint.classList.add("bad");
      hint.replaceChildren(`${r.ids.length} tokens (${r.tokens.map(showToken).join(" | ")}): it must be one token`);
    } else {
      hint.replaceChildren(...code(r.tokens[0], r.ids[0]));
      hint.dataset.id = String(r.ids[0]);
    }
    const spaced = r.with_space;
    if (spaced && spaced.ids.length === 1 && !/\s$/.test(prompt())) {
      const use = el("button", { type: "button", textContent: `use ${showToken(spaced.tokens[0])}`,
        title: `replace the answer with “${spaced.text}” (id ${spaced.ids[0]})` });
      use.addEventListener("click", () => { input.value = spaced.text; check(); });
      hint.append(el("br"), `the prompt ends without a space: the next word would be ${showToken(spaced.tokens[0])} (id ${spaced.ids[0]})`, use);
      hint.dataset.suggest = String(spaced.ids[0]);
    }
  }
  const later = () => { clearTimeout(timer); timer = setTimeout(check, 250); };
  input.addEventListener("input", later);
  for (const box of prompts) box?.addEventListener("input", later);
  return { check };
}

// ---- patching ------------------------------------------------------------------------------------------------
function mountPatching(info, onError) {
  const run = byId("patch-run"), stop = byId("patch-stop"), bar = byId("patch-progress"), status = byId("patch-status");
  const error = byId("patch-error"), panel = byId("patching-panel"), eta = byId("patch-eta");
  let controller = null, scan = null;

  async function start() {
    controller?.abort();
    const mine = new AbortController();
    controller = mine;
    let set;
    try {
      set = setRequestFields(); // null: one pair
    } catch (err) {
      error.textContent = err.message;
      error.hidden = false;
      return;
    }
    const request = set
      ? { model: info().id, ...set, answer: byId("patch-answer").value, wrong: byId("patch-wrong").value, scan: "heads" }
      : { model: info().id, clean: byId("patch-clean").value, corrupt: byId("patch-corrupt").value,
          answer: byId("patch-answer").value, wrong: byId("patch-wrong").value, scan: byId("patch-scan").value };
    error.hidden = true;
    run.disabled = true;
    stop.disabled = false;
    bar.hidden = false;
    bar.value = 0;
    panel.dataset.state = "running";
    status.textContent = "starting…";
    // a job (static/js/views/jobs.js): its ETA and queue place beside the bar, then the scan's batches
    const clock = jobClock((text) => { if (controller === mine) eta.textContent = text; });
    try {
      const done = await postJob("/api/text/patching", request, { signal: mine.signal, onEvent: (event) => {
        clock.event(event);
        if (event.accepted) { // its count-down beside the bar; the count of copies comes with the first batch
          status.textContent = Number(event.queue_position) > 0 ? "waiting for the model…" : "running the first batch…";
        }
        if (event.progress !== undefined) {
          const total = clock.total(event); // fixed when the job was accepted
          bar.max = total;
          bar.value = event.progress;
          status.textContent = `${event.progress} / ${total} ${request.scan === "heads" ? "heads" : "cells"}`;
          panel.dataset.progress = String(event.progress);
        }
      } });
      clock.stop();
      eta.textContent = "";
      scan = { ...done, request };
      if (done.set) status.textContent = await drawSet(await loadPlotly(), done);
      else await drawScan(scan);
      panel.dataset.state = "done";
    } catch (err) {
      showJobFailure(err, { mine: controller === mine, panel, status, error, onError, what: "patching" });
    } finally {
      clock.stop();
      if (controller === mine) { controller = null; run.disabled = false; stop.disabled = true; bar.hidden = true; eta.textContent = ""; }
    }
  }

  async function drawScan(result) {
    const Plotly = await loadPlotly();
    byId("patch-results").hidden = false;
    byId("patch-set-results").hidden = true;
    const heads = result.scan === "heads";
    const layers = result.effect.length, columns = result.effect[0].length;
    const x = heads ? Array.from({ length: columns }, (_, h) => `h${h}`) : result.corrupt_tokens.map((t, i) => `${i}:${showToken(t)}`);
    const y = Array.from({ length: layers }, (_, l) => `L${l}`);
    const limit = Math.max(1e-6, ...result.effect.flat().filter((v) => v !== null).map(Math.abs));
    const figure = (z, title) => ({
      data: [{
        type: "heatmap", z, x, y, colorscale: DIVERGING, zmin: -limit, zmax: limit, zmid: 0, hoverongaps: false,
        hovertemplate: `%{y} %{x}<br>effect %{z:.3f}<extra></extra>`, colorbar: { thickness: 12, title: { text: "effect" } },
      }],
      layout: {
        title: { text: title, font: { size: 13 } }, margin: { l: 48, r: 10, t: 36, b: heads ? 36 : 90 },
        yaxis: { autorange: "reversed", type: "category" }, xaxis: { type: "category", tickangle: heads ? 0 : -50 },
      },
    });
    const ld = `LD clean ${fmt(result.ld_clean, 3)}, corrupt ${fmt(result.ld_corrupt, 3)}`;
    const main = figure(result.effect, `${heads ? "exact patch of each head" : "residual stream after each layer"} · ${ld}`);
    const plot = byId("patch-heatmap");
    byId("patch-attribution-box").hidden = !result.attribution; // before drawing: it sets the left plot's width
    await Plotly.react(plot, main.data, main.layout, CONFIG);
    if (result.attribution) {
      const side = figure(result.attribution, `attribution patching · Spearman ρ = ${fmt(result.rank_correlation, 3)}`);
      await Plotly.react(byId("patch-attribution"), side.data, side.layout, CONFIG);
    }
    status.textContent = heads
      ? `best head: ${bestCell(result.effect)}; exact vs attribution ρ = ${fmt(result.rank_correlation, 3)}`
      : `best cell: ${bestCell(result.effect)}`;
    plot.removeAllListeners?.("plotly_click");
    plot.on("plotly_click", (event) => {
      const point = event.points?.[0];
      if (!point) return;
      const layer = Number(String(point.y).slice(1));
      // heads are labelled "h3", positions "3:token"
      const column = heads ? Number(String(point.x).slice(1)) : Number(String(point.x).split(":")[0]);
      applyPatch(layer, column, heads ? "heads" : "residual");
    });
  }

  function bestCell(effect) {
    let best = null;
    effect.forEach((row, l) => row.forEach((v, c) => { if (v !== null && (best === null || v > best.v)) best = { v, l, c }; }));
    return best ? `L${best.l} ${scan?.scan === "residual" ? "position " : "h"}${best.c} (${fmt(best.v, 3)})` : "–";
  }

  // The clicked cell's patch as an intervention on the corrupted prompt: a head's output, or the residual stream
  // after that layer at that position, from the clean run; the next token before and after.
  async function applyPatch(layer, column, kind) {
    if (!scan?.clean_run_id) return;
    const shift = byId("patch-shift");
    const patch = kind === "heads"
      ? { op: "patch_heads", source: scan.clean_run_id, layers: [layer], heads: [column] }
      : { op: "patch_residual", source: scan.clean_run_id, layers: [layer], tokens: [column] };
    const where = kind === "heads" ? `L${layer} h${column}` : `the residual stream after L${layer} at ${column}:${showToken(scan.corrupt_tokens[column])}`;
    byId("patch-shift-title").textContent = `${where} patched from the clean prompt`;
    shift.dataset.state = "running";
    try {
      const r = await postJSON("/api/text/attention", {
        model: scan.request.model, text: scan.request.corrupt, interventions: [patch], compare: true,
        layers: [layer], heads: [0],
      }, { channel: "patch-shift" });
      const cmp = r.effect.output;
      const before = cmp.top_before.slice(0, 5), after = cmp.top_after.slice(0, 5);
      const prob = (list, id) => list.find((t) => t.id === id)?.prob;
      const answer = (list) => prob(list, scan.answer_id);
      fillList(byId("patch-shift-summary"), [
        ["cell effect (scan)", fmt(scan.effect[layer][column], 3)],
        ["KL(corrupt ‖ patched)", `${fmt(cmp.kl)} nats`],
        [`p(${showToken(scan.request.answer)})`, `${answer(before) === undefined ? "< top 10" : fmt(answer(before), 3)} → ${answer(after) === undefined ? "< top 10" : fmt(answer(after), 3)}`],
        ["top token", `${showToken(before[0].token)} → ${showToken(after[0].token)}`],
      ]);
      const head_ = el("tr", {}, ...["#", "corrupted", "p", "patched", "p"].map((t) => el("th", { textContent: t })));
      const rows = before.map((b, i) => el("tr", {}, ...[String(i + 1), showToken(b.token), fmt(b.prob, 3),
        after[i] ? showToken(after[i].token) : "", after[i] ? fmt(after[i].prob, 3) : ""].map((t) => el("td", { textContent: t }))));
      byId("patch-shift-table").replaceChildren(el("thead", {}, head_), el("tbody", {}, ...rows));
      shift.hidden = false;
      shift.dataset.state = "done";
      shift.dataset.cell = `${layer},${column}`;
      shift.dataset.kind = kind;
      shift.dataset.topBefore = before[0].token;
      shift.dataset.topAfter = after[0].token;
      shift.dataset.kl = String(cmp.kl);
    } catch (err) {
      if (err.name === "AbortError") return;
      shift.dataset.state = "error";
      byId("patch-error").textContent = err.message;
      byId("patch-error").hidden = false;
    }
  }

  run.addEventListener("click", start);
  stop.addEventListener("click", () => controller?.abort());
  // a scan whose prompts or answers were edited since: dimmed until it is run again
  const fields = { clean: "patch-clean", corrupt: "patch-corrupt", answer: "patch-answer", wrong: "patch-wrong", scan: "patch-scan" };
  const setBoxes = ["patch-source", "patch-set-lines", "patch-template", "patch-fillers"];
  const followEdits = () => {
    let old = false;
    if (scan?.set) { // a set: stale when its request would differ now
      try { old = JSON.stringify(setRequestFields()) !== JSON.stringify({ pairs: scan.request.pairs, template: scan.request.template }, (k, v) => v ?? undefined); } catch { old = true; }
      old ||= ["answer", "wrong"].some((k) => byId(fields[k]).value !== scan.request[k]);
    } else {
      old = scan && Object.entries(fields).some(([k, id]) => byId(id).value !== scan.request[k]);
    }
    for (const id of ["patch-results", "patch-shift", "patch-set-results"]) byId(id).classList.toggle("stale", Boolean(old));
  };
  for (const id of [...Object.values(fields), ...setBoxes]) {
    byId(id).addEventListener(["patch-scan", "patch-source"].includes(id) ? "change" : "input", followEdits);
  }
  byId("patch-source").addEventListener("change", followSource);
  followSource();
  byId("patch-set-estimate-name").addEventListener("change", async () => {
    if (scan?.set) status.textContent = await drawSet(await loadPlotly(), scan);
  });
  run.addEventListener("click", () => setTimeout(followEdits));
}

// ---- logit lens ----------------------------------------------------------------------------------------------
function mountLens(info, text, interventions) {
  const status = byId("lens-status"), panel = byId("lens-panel");
  let controller = null;
  async function show() {
    const ivs = interventions();
    controller?.abort();
    const mine = new AbortController();
    controller = mine;
    status.textContent = "running…";
    panel.dataset.state = "running";
    const clock = jobClock((eta) => { if (controller === mine) status.textContent = `running… ${eta}`; });
    try {
      const request = { model: info().id, text: text(), top: 5, interventions: ivs, compare: ivs.length > 0 };
      const r = await postJob("/api/text/lens", request, { signal: mine.signal, onEvent: (e) => clock.event(e) });
      clock.stop();
      const Plotly = await loadPlotly();
      byId("lens-plot").hidden = false;
      await drawLens(Plotly, byId("lens-plot"), r.top, r.tokens, ivs.length ? "with the interventions" : "");
      byId("lens-before-box").hidden = !r.top_before || !ivs.length;
      if (r.top_before && ivs.length) await drawLens(Plotly, byId("lens-before-plot"), r.top_before, r.tokens, "without them");
      const last = r.top[r.top.length - 1];
      const top = last[last.length - 1][0];
      status.textContent = `${r.top.length} layers × ${r.tokens.length} positions; the model's prediction: ${showToken(top.token)} · id ${top.id}`;
      panel.dataset.state = "done";
      panel.dataset.lastTop = last[last.length - 1][0].token;
      panel.dataset.text = request.text;
      byId("lens-plot").classList.remove("stale");
    } catch (err) {
      if (err.name === "AbortError") return;
      status.textContent = err.message;
      panel.dataset.state = "error";
    } finally {
      clock.stop();
    }
  }
  byId("lens-run").addEventListener("click", show);
}

async function drawLens(Plotly, node, top, tokens, title) {
  const z = top.map((row) => row.map((cell) => cell[0].prob));
  const label = top.map((row) => row.map((cell) => showToken(cell[0].token)));
  const hover = top.map((row) => row.map((cell) => cell.map((c, i) => `${i + 1}. ${showToken(c.token)} ${fmt(c.prob, 3)}`).join("<br>")));
  const x = tokens.map((t, i) => `${i}:${showToken(t)}`);
  const y = top.map((_, l) => `L${l}`);
  await Plotly.react(node, [{
    type: "heatmap", z, x, y, text: label, texttemplate: "%{text}", textfont: { size: 9 }, customdata: hover,
    colorscale: "Viridis", zmin: 0, zmax: 1, hovertemplate: "%{y} after %{x}<br>%{customdata}<extra></extra>",
    colorbar: { thickness: 12, title: { text: "p(top)" } },
  }], {
    title: { text: title, font: { size: 13 } }, margin: { l: 48, r: 10, t: title ? 30 : 10, b: 90 },
    yaxis: { autorange: "reversed", type: "category" }, xaxis: { type: "category", tickangle: -50 },
  }, CONFIG);
}

// ---- faithfulness --------------------------------------------------------------------------------------------
function mountFaithfulness(info, text) {
  const status = byId("faith-status"), panel = byId("faith-panel");
  let controller = null;
  async function check() {
    controller?.abort();
    const mine = new AbortController();
    controller = mine;
    status.textContent = "running…";
    panel.dataset.state = "running";
    const clock = jobClock((eta) => { if (controller === mine) status.textContent = `running… ${eta}`; });
    const body = { model: info().id, text: text() };
    const answer = byId("faith-answer")?.value;
    if (answer && info()?.output === "next_token") body.answer = answer;
    try {
      const r = await postJob("/api/text/faithfulness", body, { signal: mine.signal, onEvent: (e) => clock.event(e) });
      clock.stop();
      const Plotly = await loadPlotly();
      const names = Object.keys(r.methods);
      const field = names.some((n) => r.methods[n].p_drop) ? "p_drop" : "change";
      const dashes = ["solid", "dash", "dot", "dashdot"]; // methods that rank alike draw one over the other
      const traces = names.map((name, i) => ({
        type: "scatter", mode: "lines+markers", name, x: r.k, y: r.methods[name][field], line: { dash: dashes[i % 4], width: 3 - i * 0.5 },
        hovertemplate: `${name}, k = %{x}: %{y:.4f}<extra></extra>`,
      }));
      const what = field === "p_drop" ? `drop in p(${showToken(r.answer?.token ?? "")})` : "1 − cosine of the output";
      byId("faith-plot").hidden = false;
      await Plotly.react(byId("faith-plot"), traces, {
        margin: { l: 55, r: 10, t: 10, b: 40 }, xaxis: { type: "log", title: { text: "k keys masked" }, tickvals: r.k },
        yaxis: { title: { text: what } }, legend: { orientation: "h", y: 1.12 },
      }, CONFIG);
      // the mean change over the k that fit the row: the larger, the more faithful
      const score = (name) => { const v = r.methods[name][field].filter((x) => x !== null); return v.reduce((a, b) => a + b, 0) / Math.max(1, v.length); };
      const top = Math.max(...names.map(score));
      const best = names.filter((n) => Math.abs(score(n) - top) < 1e-9);
      status.textContent = `most faithful here (mean over k): ${best.join(", ")}${best.length > 1 ? " (tied: the same top keys)" : ""}`;
      panel.dataset.best = best.join(",");
      panel.dataset.state = "done";
      panel.dataset.text = body.text;
      byId("faith-plot").classList.remove("stale");
    } catch (err) {
      if (err.name === "AbortError") return;
      status.textContent = err.message;
      panel.dataset.state = "error";
    } finally {
      clock.stop();
    }
  }
  byId("faith-run").addEventListener("click", check);
}
