// The laboratory's store: the intervention state (β, key masks, causal mask, ablation, perturbation; see
// interventions.js for its fields) and the model the page shows, with one change event. Panels change the state
// and say so with changed(what); the lab controller (lab.js), the page and views such as views/analysis.js
// subscribe and do their part (re-run, redraw, show or hide), so no panel needs a callback from the page.
//
//   what: "beta" | "masks" | "causal" | "ablate" | "perturb" | "all" (a reset or a restored link) |
//         "tokens" (a new input dropped its token choices) | "model" (the page took up another model)
//   settle: > 0 while a slider moves (the page may draw lightly and catch up once it stops)
//   run: false when the change needs no model run (a pick for a perturbation that is off, a restore, …)
import { createLab } from "./interventions.js";

export function createLabStore() {
  const listeners = new Set();
  const store = {
    state: createLab(),
    model: null, // the page's ModelInfo (GET /api/models), set with setModel
    subscribe(listener) {
      listeners.add(listener);
      return () => listeners.delete(listener);
    },
    changed(what, { settle = 0, run = true } = {}) {
      const event = { what, settle, run, state: store.state };
      for (const listener of [...listeners]) listener(event);
    },
    // The page took up a model (or the same one again): views that depend on its kind follow.
    setModel(info) {
      store.model = info;
      store.changed("model", { run: false });
    },
  };
  return store;
}
