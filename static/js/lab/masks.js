// Masks and ablation controls (§3): key masks, causal mask, head ablation, each with a visible
// scope and a one-click reset. The key-mask tokens are chosen by clicking tokens (or patches) elsewhere. Mounted on
// the lab's store (store.js): an edit changes the store's state and says changed(key); the panel redraws on every
// change of the store.
import { HELP, OP_FORMS, resetControl, scopeSelect } from "./interventions.js";
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

// A described op's control (interventions.js OP_FORMS, e.g. positions: docs/api.md "positions"): its on/off box, one
// select or number input per field and a reset, with ids `${op}-toggle`, `${op}-${field}`, `${op}-reset`; a scope
// select only when the op is scoped. Returns the control's element and its update().
function formControl(lab, op, form, onChange) {
  const state = lab[op];
  const box = el("input", { id: `${op}-toggle`, type: "checkbox" });
  box.addEventListener("change", () => { state.on = box.checked; onChange(op); });
  const inputs = Object.entries(form.fields).map(([name, field]) => {
    const input = field.options
      ? el("select", { id: `${op}-${name}` })
      : el("input", { id: `${op}-${name}`, type: "number", min: String(field.int?.min ?? ""), step: "1", value: String(field.value), style: "width:64px" });
    if (field.options) input.append(...field.options.map(([value, text]) => new Option(text, value)));
    input.addEventListener("change", () => {
      state[name] = field.options ? input.value : Math.max(field.int?.min ?? -Infinity, Math.round(Number(input.value) || 0));
      if (state.on) onChange(op);
    });
    return { name, field, input };
  });
  const scope = form.scoped === false ? null : scopeSelect(state.scope, (v) => { state.scope = v; if (state.on) onChange(op); });
  if (scope) scope.id = `${op}-scope`;
  const reset = el("button", { id: `${op}-reset`, type: "button", textContent: "reset" });
  reset.addEventListener("click", () => { resetControl(lab, op); onChange(op); });
  const element = el("div", { className: "lab-control" },
    el("div", { className: "controls" }, el("label", {}, box, el("b", {}, form.label)),
      ...inputs.map(({ field, input }) => el("label", {}, `${field.label} `, input)), ...(scope ? [el("label", {}, "scope ", scope)] : []), reset),
    el("p", { className: "help" }, ...guideLinks(HELP[op] + (form.helpTail ?? "."))));
  function update() {
    box.checked = state.on;
    for (const { name, field, input } of inputs) {
      input.value = String(state[name]);
      if (field.enabledWhen) input.disabled = !field.enabledWhen(state);
    }
    if (scope) scope.value = state.scope;
  }
  return { element, update };
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
  const forms = Object.entries(OP_FORMS).map(([op, form]) => formControl(lab, op, form, onChange));
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
    ...forms.map((form) => form.element),
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
    for (const form of forms) form.update();
  }
  store.subscribe(update);
  update();
  return { update };
}
