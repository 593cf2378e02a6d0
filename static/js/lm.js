// The output side of language models on the text page (§9): the next-token distribution before and
// after the interventions, the two greedy continuations streamed side by side, and an encoder–decoder's
// decoded target with its per-token probabilities.
import { jobClock, postJob } from "./views/jobs.js";
import { byId, count, el, fillList, showToken } from "./dom.js";
import { fmt } from "./mathx.js";
import { mountGenMap } from "./views/genmap.js";

const CONFIG = { responsive: true, displaylogo: false };
const BEFORE = "#98a2b3", AFTER = "#3b5bdb";


// Query heads that share a key/value head (grouped-query attention): "heads 0–2 share K/V head 0, …".
export function kvGroups(heads, kvHeads) {
  if (!kvHeads || kvHeads >= heads) return null;
  const size = heads / kvHeads;
  return Array.from({ length: kvHeads }, (_, g) => {
    const first = g * size, last = first + size - 1;
    return `heads ${first}–${last} share K/V head ${g}`;
  }).join(", ");
}

// ---- next token ------------------------------------------------------------------------------------
// response.output: {kind: "next_token", position, top}; response.effect?.output: the before/after comparison.
export function drawNextToken(response, tokens) {
  const out = response.output;
  const cmp = response.effect?.output?.kind === "next_token" ? response.effect.output : null;
  const panel = byId("lm-output");
  const where = `after position ${out.position} (${showToken(tokens[out.position] ?? "?")})`;
  byId("lm-output-title").textContent = where;
  const before = cmp ? cmp.top_before : out.top;
  const after = cmp ? cmp.top_after : null;
  panel.dataset.top = before[0]?.token ?? "";
  panel.dataset.topAfter = (after ?? before)[0]?.token ?? "";
  panel.dataset.kl = cmp ? String(cmp.kl) : "0";
  const label = (t, i) => `${i + 1}. ${showToken(t.token)}`;
  const traces = [{
    type: "bar", orientation: "h", name: cmp ? "before" : "now", y: before.map(label), x: before.map((t) => t.prob),
    marker: { color: cmp ? BEFORE : AFTER }, hovertemplate: "%{y}: p = %{x:.4f}<extra></extra>", xaxis: "x", yaxis: "y",
  }];
  if (after) {
    traces.push({
      type: "bar", orientation: "h", name: "after", y: after.map(label), x: after.map((t) => t.prob),
      marker: { color: AFTER }, hovertemplate: "%{y}: p = %{x:.4f}<extra></extra>", xaxis: "x2", yaxis: "y2",
    });
  }
  const axis = (domain, title) => ({ domain, range: [0, 1], title: { text: title } });
  const cat = (anchor) => ({ autorange: "reversed", type: "category", anchor, automargin: true });
  Plotly.react(byId("topk-plot"), traces, {
    margin: { l: 10, r: 10, t: 24, b: 40 }, showlegend: false,
    xaxis: axis(after ? [0, 0.44] : [0, 1], after ? "p before" : "p"), yaxis: cat("x"),
    ...(after ? { xaxis2: axis([0.56, 1], "p after"), yaxis2: cat("x2") } : {}),
    annotations: after ? [] : [{ text: "no interventions: before = after", xref: "paper", yref: "paper", x: 1, y: 1.08, showarrow: false, font: { color: "#667085", size: 11 } }],
  }, CONFIG);

  const rows = [["position", where]];
  if (cmp) {
    const std = (k) => (cmp[`${k}_std`] !== undefined ? ` ± ${fmt(cmp[`${k}_std`], 2)}` : "");
    rows.push(["KL(before ‖ after)", `${fmt(cmp.kl)} nats${std("kl")}`]);
    rows.push([`Δp of ${showToken(before[0].token)}`, `${cmp.prob_change >= 0 ? "+" : ""}${fmt(cmp.prob_change)}${std("prob_change")}`]);
    rows.push(["top token", before[0].token === after[0].token ? `unchanged: ${showToken(before[0].token)}`
      : `${showToken(before[0].token)} → ${showToken(after[0].token)}`]);
  } else {
    rows.push(["top token", `${showToken(before[0].token)} (p = ${fmt(before[0].prob, 3)})`]);
  }
  fillList(byId("lm-effect"), rows);
  drawRankTable(byId("topk-table"), before, after);
}

// Ranks: each before-top token's probability and where it went, beside the after-top tokens.
function drawRankTable(table, before, after) {
  const head = el("tr", {}, ...["#", "before", "p", ...(after ? ["rank after", "after", "p", "rank before"] : [])].map((t) => el("th", { textContent: t })));
  const rank = (r) => (r === null || r === undefined ? "–" : String(r + 1));
  const moved = (from, to) => (to === null || to === undefined ? "" : to < from ? " ▲" : to > from ? " ▼" : "");
  const body = before.map((b, i) => {
    const cells = [String(i + 1), showToken(b.token), fmt(b.prob, 3)];
    if (after) {
      const a = after[i];
      cells.push(rank(b.rank_after) + moved(i, b.rank_after), a ? showToken(a.token) : "", a ? fmt(a.prob, 3) : "", a ? rank(a.rank_before) : "");
    }
    return el("tr", {}, ...cells.map((t) => el("td", { textContent: t })));
  });
  table.replaceChildren(el("thead", {}, head), el("tbody", {}, ...body));
}

// ---- continuation ----------------------------------------------------------------------------------
// body(): the generate request ({model, text, chat, max_new_tokens, interventions}).
// Automatic re-runs: once a continuation was asked for, followChanges() generates again when the request
// differs from the one shown and "follow changes" is on.
// attention(): {layer, head, promptTokens} of the shown head (its map grows a row per new token, views/genmap.js), or
// null; why: the page's "why?" view.
export function mountContinuation({ body, onError, attention = () => null, why = null }) {
  const run = byId("generate-button"), stop = byId("stop-button"), status = byId("continuation-status");
  const eta = byId("continuation-eta");
  const genMap = byId("gen-attention") && why ? mountGenMap(byId("gen-attention"), { why }) : null;
  const cols = { base: byId("continuation-base"), intervened: byId("continuation-intervened") };
  let controller = null, shownKey = null, asked = false;

  async function generate() {
    controller?.abort();
    const mine = new AbortController();
    controller = mine;
    asked = true;
    const request = body();
    shownKey = JSON.stringify(request);
    const head = genMap ? attention() : null;
    if (head) request.attention = { layers: [head.layer], heads: [head.head], encoding: "f32" };
    if (head) genMap.start(request, head.promptTokens); else genMap?.reset();
    cols.base.replaceChildren();
    cols.intervened.replaceChildren();
    const panel = byId("continuation");
    panel.dataset.state = "running";
    panel.dataset.differs = "";
    run.disabled = true;
    stop.disabled = false;
    status.textContent = "generating…";
    let steps = 0, firstDiff = null;
    const ended = new Map(); // side prefix → the step at which it ended
    // a job: its accepted event's ETA and queue place count down beside the tokens (static/js/views/jobs.js)
    const clock = jobClock((text) => { if (controller === mine) eta.textContent = text; });
    const onStep = (event) => {
      if (event.accepted || event.step === undefined) { clock.event(event); return; } // not a token
      const differs = event.id !== event.base_id;
      if (differs && firstDiff === null) firstDiff = event.step;
      // Every step names both sides; a side that has ended says so (ended: true, its token fields null),
      // and is marked once where it ended.
      for (const [col, prefix] of [[cols.base, "base_"], [cols.intervened, ""]]) {
        if (event[`${prefix}ended`]) {
          if (!ended.has(prefix)) { ended.set(prefix, event.step); col.append(endMark(event.step)); }
        } else {
          col.append(tokenSpan(event[`${prefix}token`], event[`${prefix}prob`], differs, event.step));
        }
      }
      genMap?.step(event);
      steps += 1;
      clock.step(steps, request.max_new_tokens);
      status.textContent = `${steps} tokens…`;
    };
    try {
      const answer = await postJob("/api/text/generate", request, { signal: mine.signal, onEvent: onStep });
      genMap?.done(answer);
      // Sides that stopped short of the tokens asked for ended (both at once end the stream with no
      // step event saying so).
      for (const [col, prefix] of [[cols.base, "base_"], [cols.intervened, ""]]) {
        if (!ended.has(prefix) && steps < request.max_new_tokens) { ended.set(prefix, steps); col.append(endMark(steps)); }
      }
      const endings = [["base_", "without"], ["", "with"]].filter(([p]) => ended.has(p))
        .map(([p, side]) => `${side} the interventions it ended after ${count(ended.get(p), "token")}`);
      status.textContent = `${steps} tokens · ${firstDiff === null ? "identical" : `they differ from token ${firstDiff + 1}`}`
        + (endings.length ? ` · ${endings.join("; ")}` : "");
      panel.dataset.state = "done";
      panel.dataset.differs = firstDiff === null ? "no" : "yes";
    } catch (err) {
      if (err.name === "AbortError") {
        if (controller === mine) { status.textContent = `stopped after ${count(steps, "token")}`; panel.dataset.state = "stopped"; }
        return;
      }
      panel.dataset.state = "error";
      status.textContent = `error: ${err.message}`; // beside the Generate button, not only in the header
      onError(`continuation: ${err.message}`);
    } finally {
      clock.stop();
      if (controller === mine) { controller = null; run.disabled = false; stop.disabled = true; eta.textContent = ""; }
    }
  }

  run.addEventListener("click", generate);
  stop.addEventListener("click", () => controller?.abort());
  return {
    generate,
    followChanges() {
      if (asked && byId("auto-generate").checked && JSON.stringify(body()) !== shownKey) generate();
    },
    reset() { controller?.abort(); asked = false; shownKey = null; cols.base.replaceChildren(); cols.intervened.replaceChildren(); status.textContent = ""; genMap?.reset(); },
  };
}

// A white-space token (a newline, spaces) is drawn as the next-token panel writes it ("\n", "␣"): as typed
// it would be invisible.
function tokenSpan(token, prob, differs, step) {
  const blank = !token.trim();
  return el("span", {
    className: "gen-tok" + (differs ? " differs" : "") + (blank ? " ws" : ""), textContent: blank ? showToken(token) + (token.includes("\n") ? "\n" : "") : token,
    title: `step ${step + 1}: ${showToken(token)}, p = ${fmt(prob, 3)}`,
  });
}

function endMark(step) {
  return el("span", { className: "gen-end", textContent: "[ended]", title: `this side ended after ${count(step, "token")} (end of sequence)` });
}

// ---- encoder–decoder target ------------------------------------------------------------------------
export function drawTarget(response) {
  const out = response.output;
  const cmp = response.effect?.output?.kind === "seq2seq" ? response.effect.output : null;
  const tokens = out.target_tokens ?? response.target_tokens;
  const before = cmp?.probs_before ?? out.probs;
  const after = cmp?.probs_after ?? null;
  byId("target-tokens").replaceChildren(...tokens.map((t, i) => el("span", {
    className: "tok", textContent: t,
    title: `target ${i}: p = ${fmt(before[i], 3)}` + (after ? ` → ${fmt(after[i], 3)}, KL ${fmt(cmp.kl?.[i], 3)}` : ""),
  })));
  const labels = tokens.map((t, i) => `${i}:${t}`);
  const traces = [{ type: "bar", name: after ? "before" : "p", x: labels, y: before, marker: { color: after ? BEFORE : AFTER } }];
  if (after) traces.push({ type: "bar", name: "after", x: labels, y: after, marker: { color: AFTER } });
  Plotly.react(byId("target-probs-plot"), traces, {
    // up to the largest probability shown: a random test model's probabilities are far below 1
    barmode: "group", margin: { l: 45, r: 10, t: 10, b: 70 }, yaxis: { range: [0, 1.05 * Math.max(1e-3, ...before, ...(after ?? []))], title: { text: "p(target token)" } },
    xaxis: { type: "category", tickangle: -50 }, legend: { orientation: "h", y: 1.1 },
  }, CONFIG);
}
