// Masks and ablation controls (SPEC §3): key masks, causal mask, head ablation, each with a visible
// scope and a one-click reset. The key-mask tokens are chosen by clicking tokens (or patches) elsewhere.
import { HELP, resetControl, scopeSelect } from "./interventions.js";

const el = (tag, props = {}, ...children) => {
  const node = document.createElement(tag);
  Object.assign(node, props);
  node.append(...children);
  return node;
};

// mount(container, lab, {onChange(key), tokenName(j)}) → {update()}: update() refreshes the shown state.
export function mountMaskPanel(container, lab, { onChange, tokenName = (j) => String(j), pickHint = "click a token to mask it as a key" }) {
  const masked = el("span", { id: "mask-list", className: "mono" });
  const maskScope = scopeSelect(lab.masks.scope, (v) => { lab.masks.scope = v; if (lab.masks.tokens.size) onChange("masks"); });
  maskScope.id = "mask-scope";
  const maskReset = el("button", { id: "mask-reset", type: "button", textContent: "reset" });
  maskReset.addEventListener("click", () => { resetControl(lab, "masks"); onChange("masks"); });

  const causal = el("input", { id: "causal-toggle", type: "checkbox" });
  causal.addEventListener("change", () => { lab.causal.on = causal.checked; onChange("causal"); });
  const causalScope = scopeSelect(lab.causal.scope, (v) => { lab.causal.scope = v; if (lab.causal.on) onChange("causal"); });
  causalScope.id = "causal-scope";
  const causalReset = el("button", { id: "causal-reset", type: "button", textContent: "reset" });
  causalReset.addEventListener("click", () => { resetControl(lab, "causal"); onChange("causal"); });

  const ablate = el("input", { id: "ablate-toggle", type: "checkbox" });
  ablate.addEventListener("change", () => { lab.ablate.on = ablate.checked; onChange("ablate"); });
  const ablateScope = scopeSelect(lab.ablate.scope, (v) => { lab.ablate.scope = v; if (lab.ablate.on) onChange("ablate"); });
  ablateScope.id = "ablate-scope";
  const ablateReset = el("button", { id: "ablate-reset", type: "button", textContent: "reset" });
  ablateReset.addEventListener("click", () => { resetControl(lab, "ablate"); onChange("ablate"); });

  container.replaceChildren(
    el("h2", {}, "Masks and ablation ", el("small", {}, "M is added to β·S before the softmax; scopes follow the selected layer/head")),
    el("div", { className: "lab-control" },
      el("div", { className: "controls" }, el("b", {}, "Key mask"), masked, el("label", {}, "scope ", maskScope), maskReset),
      el("p", { className: "help" }, `${HELP.mask_keys}. ${pickHint[0].toUpperCase() + pickHint.slice(1)}.`)),
    el("div", { className: "lab-control" },
      el("div", { className: "controls" }, el("label", {}, causal, el("b", {}, "Causal mask")), el("label", {}, "scope ", causalScope), causalReset),
      el("p", { className: "help" }, HELP.causal + ".")),
    el("div", { className: "lab-control" },
      el("div", { className: "controls" }, el("label", {}, ablate, el("b", {}, "Ablate head")), el("label", {}, "scope ", ablateScope), ablateReset),
      el("p", { className: "help" }, HELP.ablate_heads + "; the attention pattern itself is unchanged, later layers and the output change.")),
  );

  function update() {
    const ids = [...lab.masks.tokens].sort((a, b) => a - b);
    masked.textContent = ids.length ? ids.map((j) => `${j}:${tokenName(j)}`).join("  ") : "none";
    maskScope.value = lab.masks.scope;
    causal.checked = lab.causal.on;
    causalScope.value = lab.causal.scope;
    ablate.checked = lab.ablate.on;
    ablateScope.value = lab.ablate.scope;
  }
  update();
  return { update };
}
