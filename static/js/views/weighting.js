// The map-mode choice (issue 22 §3), one for the text, image and speech pages: P, or the value-weighted map
// ‖P[i,j]·v_j W_O^h‖ renormalised per row — what each key's value adds to the head's output, not only its weight
// (Kobayashi et al. 2020; guide §12.4). The select is templates/partials/weighting.html; the server forms the maps
// (the response and its kept run's windows/rows name their `weighting`), so a page only asks and labels.

const select = () => document.getElementById("weighting-select");

/** "attention" (P) or "value_norm", as chosen on the page. */
export const chosenWeighting = () => (select()?.value === "value_norm" ? "value_norm" : "attention");

/** The request field of the chosen mode ({} for P: requests stay as they were). */
export const weightingFields = () => (chosenWeighting() === "value_norm" ? { weighting: "value_norm" } : {});

/** The weighting a response (or a kept run's window) was made with. */
export const weightingOf = (r) => r?.weighting ?? "attention";

/** What a response's maps are, for titles, hovers and axis labels: "P" or "value-weighted". */
export const mapName = (r) => (weightingOf(r) === "value_norm" ? "value-weighted" : "P");

/** Calls fn when the mode changes. */
export const onWeightingChange = (fn) => select()?.addEventListener("change", fn);
