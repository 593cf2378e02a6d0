// Colouring the model view by a head score (docs/science.md "Head kinds"): none; sink mass or mean distance of the
// shown input (every attention response carries both); or a score of POST /api/text/head_scores (decoder LMs: fetched
// once per model, on the built-in probes). Each head's label (the kind it scores highest at over the stated
// threshold) is drawn on its cell.
import { postJSON } from "../api.js";

export const HEAD_SCORES = [
  ["none", "thumbnails"],
  ["sink_mass", "sink mass"],
  ["previous_token", "previous-token"],
  ["induction", "induction"],
  ["duplicate_token", "duplicate-token"],
  ["retrieval", "retrieval (copying a needle)"],
  ["mean_distance", "mean distance"],
];
// the short text drawn on a labelled head's cell
export const LABEL_MARKS = { previous_token: "prev", induction: "ind", duplicate_token: "dup", sink: "sink" };
// scores every attention response carries, of the input shown; the others come from the built-in probes
const OF_THE_RUN = ["none", "sink_mass", "mean_distance"];

// select: the <select> to fill; status: where the fetch's state is said; model(): the model shown; isLM(): whether
// it takes head_scores; redraw(): draw the model view again.
export function mountHeadKinds(select, status, { model, isLM, redraw }) {
  select.replaceChildren(...HEAD_SCORES.map(([value, text]) => new Option(text, value)));
  const taxonomies = new Map(); // model → the head_scores answer (or a pending promise)
  let failure = null;

  function fetchFor(id) {
    if (taxonomies.has(id)) return;
    status.textContent = "scoring heads on the built-in probes…";
    const pending = postJSON("/api/text/head_scores", { model: id, text: null }, { channel: `head_scores:${id}` })
      .then((answer) => { taxonomies.set(id, answer); failure = null; })
      .catch((err) => { taxonomies.delete(id); failure = err.message ?? String(err); })
      .finally(() => redraw());
    taxonomies.set(id, pending);
  }

  select.addEventListener("change", () => {
    if (!OF_THE_RUN.includes(select.value) && isLM()) fetchFor(model());
    redraw();
  });

  // { name, values [L][H], labels [L][H]|null, unit } for the model view, or null (thumbnails)
  function colour(response) {
    const name = select.value;
    const answer = isLM() ? taxonomies.get(model()) : undefined;
    const ready = answer && !(answer instanceof Promise) ? answer : null;
    if (isLM() && name !== "none" && !ready && failure === null) fetchFor(model());
    for (const option of select.options) { // head_scores is for decoder LMs only
      option.disabled = !isLM() && !OF_THE_RUN.includes(option.value);
    }
    status.textContent = failure ? `head scores: ${failure}` : answer instanceof Promise ? "scoring heads on the built-in probes…"
      : ready ? `labels from the built-in probes (seed ${ready.probe.seed}); thresholds ${thresholdText(ready.probe.thresholds)}` : "";
    if (name === "none") return null;
    const labels = ready?.labels ?? null;
    const unit = name === "mean_distance" ? " tokens" : "";
    if (OF_THE_RUN.includes(name)) {
      const values = ofModel(response?.[name]);
      return values ? { name, values, labels, unit, source: "this input" } : null;
    }
    if (!ready) return null;
    return { name, values: ready.scores[name], labels, unit, source: "built-in probe" };
  }

  return { colour };
}

// an encoder–decoder's per-kind fields are objects; the model view shows the encoder's
const ofModel = (field) => (Array.isArray(field) ? field : field?.encoder ?? null);

const thresholdText = (thresholds) => Object.entries(thresholds)
  .map(([kind, t]) => `${LABEL_MARKS[kind] ?? kind} > ${t}`).join(", ");
