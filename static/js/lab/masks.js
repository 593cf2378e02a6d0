// Masks and ablation controls (§3): key masks, causal mask, head ablation, each with a visible
// scope and a one-click reset. The key-mask tokens are chosen by clicking tokens (or patches) elsewhere. Mounted on
// the lab's store (store.js): an edit changes the store's state and says changed(key); the panel redraws on every
// change of the store.
import { HELP, resetControl, scopeSelect } from "./interventions.js";
import { guideLinks } from "../guide-links.js";
import { el, visibleToken } from "../dom.js";

// An on/off intervention with a scope and a reset: its checkbox, scope select and reset button,
// with ids `${key}-toggle`, `${key}-scope`, `${key}-reset`.
function toggleControl(lab, key, onChange) { // onChange(key): the store's changed
  const box = el("input", { id: `${key}-toggle`, type: "checkbox" });
  box.addEventListener("change", () => { lab[key].on = box.checked; onChange(key); });
  const scope = scopeSelect(lab[key].scope, (v) => { lab[key].scope = v; if (lab[key].on) onChange(key); });
  scope.id = `${key}-scope`;
  const reset = el("button", { id: `${key}-reset`, type: "button", textContent: "reset" });
  reset.addEventListener("click", () => { resetControl(lab, key); onChange(key); });
  return [box, scope, reset];
}

// The positions switch (docs/api.md "positions"): on/off, mode off|shuffle and the shuffle's seed, with a reset;
// ids positions-toggle, positions-mode, positions-seed, positions-reset. No scope: it acts on the input embeddings.
function positionsControl(lab, onChange) {
  const box = el("input", { id: "positions-toggle", type: "checkbox" });
  box.addEventListener("change", () => { lab.positions.on = box.checked; onChange("positions"); });
  const mode = el("select", { id: "positions-mode" });
  mode.append(new Option("off (no positions)", "off"), new Option("shuffle (seeded permutation)", "shuffle"));
  mode.addEventListener("change", () => { lab.positions.mode = mode.value; if (lab.positions.on) onChange("positions"); });
  const seed = el("input", { id: "positions-seed", type: "number", min: "0", step: "1", value: "0", style: "width:64px" });
  seed.addEventListener("change", () => {
    lab.positions.seed = Math.max(0, Math.round(Number(seed.value) || 0));
    if (lab.positions.on) onChange("positions");
  });
  const reset = el("button", { id: "positions-reset", type: "button", textContent: "reset" });
  reset.addEventListener("click", () => { resetControl(lab, "positions"); onChange("positions"); });
  return [box, mode, seed, reset];
}

// mount(container, store, {tokenName(j), pickHint, builtInCausal()}) → {update()}: update() refreshes the shown state.
// builtInCausal(): null, or why the shown attention is causal anyway (a decoder): the causal control then shows
// that as built in (ticked, not a control), rather than as a box the user has not ticked.
export function mountMaskPanel(container, store, {
  tokenName = (j) => String(j), pickHint = "click a token to mask it as a key", builtInCausal = () => null,
} = {}) {
  const lab = store.state;
  const onChange = (key) => store.changed(key);
  const masked = el("span", { id: "mask-list", className: "mono" });
  const maskScope = scopeSelect(lab.masks.scope, (v) => { lab.masks.scope = v; if (lab.masks.tokens.size) onChange("masks"); });
  maskScope.id = "mask-scope";
  const maskReset = el("button", { id: "mask-reset", type: "button", textContent: "reset" });
  maskReset.addEventListener("click", () => { resetControl(lab, "masks"); onChange("masks"); });

  const [causal, causalScope, causalReset] = toggleControl(lab, "causal", onChange);
  const [ablate, ablateScope, ablateReset] = toggleControl(lab, "ablate", onChange);
  const causalScopeLabel = el("label", {}, "scope ", causalScope);
  const [positions, positionsMode, positionsSeed, positionsReset] = positionsControl(lab, onChange);
  const causalBuiltIn = el("span", { id: "causal-builtin", className: "pill", hidden: true });

  container.replaceChildren(
    el("h2", {}, "Masks and ablation ", el("small", {}, "M is added to β·S before the softmax; scopes follow the selected layer/head")),
    el("div", { className: "lab-control" },
      el("div", { className: "controls" }, el("b", {}, "Key mask"), masked, el("label", {}, "scope ", maskScope), maskReset),
      el("p", { className: "help" }, ...guideLinks(`${HELP.mask_keys}. ${pickHint[0].toUpperCase() + pickHint.slice(1)}.`))),
    el("div", { className: "lab-control" },
      el("div", { className: "controls" }, el("label", {}, causal, el("b", {}, "Causal mask")), causalBuiltIn, causalScopeLabel, causalReset),
      el("p", { className: "help" }, ...guideLinks(HELP.causal + "."))),
    el("div", { className: "lab-control" },
      el("div", { className: "controls" }, el("label", {}, ablate, el("b", {}, "Ablate head")), el("label", {}, "scope ", ablateScope), ablateReset),
      el("p", { className: "help" }, ...guideLinks(HELP.ablate_heads + "; the attention pattern itself is unchanged, later layers and the output change."))),
    el("div", { className: "lab-control" },
      el("div", { className: "controls" }, el("label", {}, positions, el("b", {}, "Positions")), el("label", {}, "mode ", positionsMode),
        el("label", {}, "seed ", positionsSeed), positionsReset),
      el("p", { className: "help" }, ...guideLinks(HELP.positions + "; the effect panel shows what it does to the output."))),
  );

  function update() {
    const ids = [...lab.masks.tokens].sort((a, b) => a - b);
    masked.textContent = ids.length ? ids.map((j) => `${j}:${visibleToken(tokenName(j))}`).join("  ") : "none";
    maskScope.value = lab.masks.scope;
    const builtIn = builtInCausal();
    causal.checked = lab.causal.on || Boolean(builtIn);
    causal.disabled = Boolean(builtIn);
    causalBuiltIn.hidden = !builtIn;
    causalBuiltIn.textContent = builtIn ? `built in: ${builtIn}` : "";
    causalScopeLabel.hidden = causalReset.hidden = Boolean(builtIn);
    causalScope.value = lab.causal.scope;
    ablate.checked = lab.ablate.on;
    ablateScope.value = lab.ablate.scope;
    positions.checked = lab.positions.on;
    positionsMode.value = lab.positions.mode;
    positionsSeed.value = String(lab.positions.seed);
    positionsSeed.disabled = lab.positions.mode !== "shuffle";
  }
  store.subscribe(update);
  update();
  return { update };
}
