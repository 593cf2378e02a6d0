// The β panel (§2): the slider (log10 β/β₀), its readout, the β₀ reset, the scope (a head, a layer, every head, or
// layers from … to …) and, where the page re-normalises in the browser, the mode. The markup is server-rendered
// (templates/partials/lab.html, beta_controls); this module binds it to the store. A slider move says
// changed("beta", {settle}); the lab controller decides whether that is a redraw or a run.
import { byId } from "../dom.js";
import { fmt } from "../mathx.js";
import { betaIsNative, betaOf } from "./interventions.js";

// While a slider moves, only the heatmap's cells follow it; every other panel catches up once no move
// came for this long.
export const SETTLE_MS = 150;

// mountBetaPanel(store, {nativeBeta(), selection() → {layer}, shape() → {layers}, where}) → {update()}.
// where: what β acts on, for the readout (e.g. "cross-attention"), optional.
export function mountBetaPanel(store, { nativeBeta, selection, shape, where = "" }) {
  const b = store.state.beta;
  const slider = byId("beta-slider"), scope = byId("scope-select"), modeSelect = byId("mode-select");
  if (!modeSelect) b.mode = "run"; // the page has run mode only
  const range = () => [Math.min(b.from, b.to), Math.max(b.from, b.to)];

  function renderReadout() {
    const value = betaOf(store.state, nativeBeta());
    const layers = b.scope === "layers" ? (([f, t]) => ` on layers ${f === t ? f : `${f}–${t}`}`)(range()) : "";
    byId("beta-readout").textContent = `β = ${fmt(value)}  T = ${fmt(1 / value)}${layers}${where ? ` on ${where}` : ""}  (β₀ = ${fmt(nativeBeta())})`;
  }

  function onSlider() {
    b.logRatio = Number(slider.value);
    renderReadout();
    store.changed("beta", { settle: SETTLE_MS });
  }
  slider.addEventListener("input", onSlider);
  byId("beta-reset").addEventListener("click", () => { slider.value = "0"; onSlider(); });
  scope.addEventListener("change", () => {
    b.scope = scope.value;
    if (b.scope === "layers" && b.from === 0 && b.to === 0) b.from = b.to = selection().layer; // start from the shown layer
    store.changed("beta");
  });
  // Scope "layers": every head of layers from … to … (clamped to the model's layers).
  // Each box sets its own end only: reading both let a box that the store had not yet redrawn put a stale end back.
  for (const [id, end] of [["beta-from", "from"], ["beta-to", "to"]]) {
    const input = byId(id);
    input?.addEventListener("change", () => {
      const last = shape().layers - 1;
      b[end] = Math.max(0, Math.min(last, Math.round(Number(input.value) || 0)));
      store.changed("beta", { run: !betaIsNative(store.state) });
    });
    input?.addEventListener("blur", () => update()); // left without a change: show the store's end again
  }
  modeSelect?.addEventListener("change", () => { b.mode = modeSelect.value; store.changed("beta"); });

  // The controls mirror the store (after a restored link, an edit in the active list, a reset).
  function update() {
    slider.value = String(b.logRatio);
    if ([...scope.options].some((o) => o.value === b.scope)) scope.value = b.scope;
    const rangeBox = byId("beta-range");
    if (rangeBox) rangeBox.hidden = b.scope !== "layers";
    // a box being typed in keeps what was typed: written back here, a store change landing before its change event
    // (a response, a slider move) had that event commit the old end
    for (const [id, value] of [["beta-from", b.from], ["beta-to", b.to]]) {
      const box = byId(id);
      if (box && box !== document.activeElement) box.value = String(value);
    }
    if (modeSelect) modeSelect.value = b.mode;
    renderReadout();
  }
  store.subscribe(update);
  update();
  return { update };
}
