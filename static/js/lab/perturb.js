// Perturbation panel (§4): target keys or queries, tokens/patches chosen by clicking, noise σ,
// scale α, seed, samples n (n > 1 → mean ± spread of each effect over seeds seed, seed+1, …).
import { HELP, resetControl, scopeSelect } from "./interventions.js";
import { guideLinks, setHelpText } from "../guide-links.js";
import { el, visibleToken } from "../dom.js";

function numberInput(id, value, { min = null, max = null, step = "any" } = {}) {
  const input = el("input", { id, type: "number", value: String(value), step: String(step) });
  if (min !== null) input.min = String(min);
  if (max !== null) input.max = String(max);
  input.style.width = "80px";
  return input;
}

// mount(container, store, {showTokenStrip, unit, maxSamples}) → {update(), setTokens(labels), togglePick(j), maskedNote()}.
// Mounted on the lab's store (store.js): an edit says changed("perturb"), with run: false while the perturbation is
// off (nothing to re-run); the panel redraws on every change of the store.
// With showTokenStrip the panel draws clickable chips for the tokens; a page that picks patches on an
// image instead calls togglePick(j) from its own click handler.
// maxSamples: the server's limit (settings.max_samples, from the page config).
// Optional, for a page whose keys and queries are different things (speech: keys are 20 ms of audio chosen on the
// spectrogram, queries are decoder tokens): chosenText(ids, perturbation) → the "chosen" line, or null for the
// default; showStrip(perturbation) → whether the token strip applies to the current target. Both get the store's
// perturbation state, as they are asked while the panel is mounted (before the page holds the lab it mounts in).
export function mountPerturbPanel(container, store, {
  showTokenStrip = true, unit = "token", maxSamples = 64, chosenText = null, showStrip = null,
} = {}) {
  const lab = store.state;
  const units = unit.endsWith("ch") ? `${unit}es` : `${unit}s`;
  const p = lab.perturb;
  const changed = () => store.changed("perturb", { run: p.on }); // an edit while off changes no run
  const target = el("select", { id: "perturb-target" });
  target.append(new Option("keys  k̂_j = α k_j + ε", "keys"), new Option("queries  q̂_i = α q_i + ε", "queries"));
  const sigma = numberInput("perturb-sigma", p.sigma, { min: 0, max: 1e4, step: 0.1 });
  const alpha = numberInput("perturb-alpha", p.alpha, { min: -1e4, max: 1e4, step: 0.1 });
  const seed = numberInput("perturb-seed", p.seed, { min: 0, step: 1 });
  const samples = numberInput("perturb-samples", p.samples, { min: 1, max: maxSamples, step: 1 });
  const scope = scopeSelect(p.scope, (v) => { p.scope = v; changed(); });
  scope.id = "perturb-scope";
  // Apply and remove are two buttons (one toggle flipped its meaning after each click); the state is spelt out.
  const apply = el("button", { id: "perturb-apply", type: "button", className: "primary", textContent: "apply perturbation" });
  const remove = el("button", { id: "perturb-remove", type: "button", textContent: "remove perturbation" });
  const state = el("span", { id: "perturb-state", className: "badge", role: "status" });
  const reset = el("button", { id: "perturb-reset", type: "button", textContent: "reset" });
  const chosen = el("span", { id: "perturb-chosen", className: "mono" });
  const strip = el("div", { id: "perturb-tokens", className: "tokens" });

  const read = () => {
    const num = (input, fallback) => (Number.isFinite(Number(input.value)) && input.value !== "" ? Number(input.value) : fallback);
    p.target = target.value;
    p.sigma = Math.max(0, num(sigma, p.sigma));
    p.alpha = num(alpha, p.alpha);
    p.seed = Math.max(0, Math.round(num(seed, p.seed)));
    p.samples = Math.min(maxSamples, Math.max(1, Math.round(num(samples, p.samples))));
  };
  for (const input of [target, sigma, alpha, seed, samples]) {
    input.addEventListener("change", () => { read(); changed(); });
  }
  apply.addEventListener("click", () => { read(); if (p.on) return; p.on = true; store.changed("perturb"); });
  remove.addEventListener("click", () => { if (!p.on) return; p.on = false; store.changed("perturb"); });
  reset.addEventListener("click", () => { resetControl(lab, "perturb"); store.changed("perturb"); });

  container.replaceChildren(
    el("h2", {}, "Perturbation ", el("small", {}, ...guideLinks("applied to K or Q before the scores are formed (§4)"))),
    el("div", { className: "controls" },
      el("label", {}, "target ", target), el("label", {}, "σ ", sigma), el("label", {}, "α ", alpha),
      el("label", {}, "seed ", seed), el("label", {}, "samples n ", samples), el("label", {}, "scope ", scope), apply, remove, state, reset),
    el("p", { className: "help", id: "perturb-help" }),
    el("p", { className: "warnings", id: "perturb-note", hidden: true }),
    el("div", { className: "controls" }, el("span", { className: "help", id: "perturb-chosen-label" }, `chosen ${units}:`), chosen),
    strip,
    el("p", { className: "help" },
      `${showTokenStrip ? `Click ${units} to choose them` : `Choose ${units} by clicking them with "choose it for the perturbation" under "Click a ${unit} to"`} (none chosen = every ${unit}). σ: noise ε ~ N(0, σ²I_d) from a generator seeded by `
      + "seed (same seed, same ε). α > 1 elongates: sharpens the preference for or against the key according to the sign of S[i,j]. "
      + "n > 1 averages every effect over seeds seed … seed+n−1 and shows ± one standard deviation."),
  );

  let labels = [];
  function setTokens(tokenLabels) {
    // The same tokens again (every response): the chips stay. Rebuilding them lost a click whose press and release
    // fell on either side of a redraw (the release landed on a new chip: no click).
    const same = tokenLabels.length === labels.length && tokenLabels.every((t, j) => t === labels[j]) && strip.children.length === labels.length;
    labels = tokenLabels;
    if (!showTokenStrip) { strip.hidden = true; update(); return; }
    if (same) { update(); return; }
    strip.replaceChildren(...labels.map((tok, j) => {
      const shown = visibleToken(tok);
      const chip = el("span", { className: "tok" + (shown !== tok ? " ws" : ""), textContent: shown, title: `${unit} ${j}: click to choose for the perturbation` });
      chip.dataset.index = j;
      chip.tabIndex = 0; // keyboard: Tab to a chip, Enter or Space chooses it
      chip.setAttribute("role", "button");
      chip.addEventListener("click", () => togglePick(j));
      chip.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); togglePick(j); } });
      return chip;
    }));
    update();
  }

  function togglePick(j) {
    if (p.tokens.has(j)) p.tokens.delete(j); else p.tokens.add(j);
    changed();
  }

  function update() {
    target.value = p.target;
    sigma.value = String(p.sigma);
    alpha.value = String(p.alpha);
    seed.value = String(p.seed);
    samples.value = String(p.samples);
    scope.value = p.scope;
    apply.disabled = p.on; // while on, every edit of the fields above re-runs at once
    remove.disabled = !p.on;
    state.textContent = p.on ? "on: edits apply at once" : "off";
    state.classList.toggle("on", p.on);
    const note = maskedNote(), noteEl = container.querySelector("#perturb-note");
    noteEl.textContent = note;
    noteEl.hidden = !note;
    setHelpText(container.querySelector("#perturb-help"), (p.target === "queries" ? HELP.perturb_queries : HELP.perturb_keys) + ".");
    const ids = [...p.tokens].sort((a, b) => a - b);
    chosen.textContent = chosenText?.(ids, p) ?? (ids.length ? ids.map((j) => `${j}:${visibleToken(labels[j] ?? "?")}`).join("  ") : `none (every ${unit})`);
    if (showTokenStrip && showStrip) strip.style.display = showStrip(p) ? "" : "none"; // (.tokens sets display)
    for (const chip of strip.children) chip.classList.toggle("picked", p.tokens.has(Number(chip.dataset.index)));
  }
  // A masked key's column of P is 0 whatever its score: perturbing it changes nothing (an honest "± 0").
  // Only about a perturbation that is on, or keys chosen for one: a mask alone perturbs nothing.
  function maskedNote({ applied = false } = {}) {
    if (p.target !== "keys" || !lab.masks.tokens.size) return "";
    if (!p.on && (applied || !p.tokens.size)) return "";
    const chosen = p.tokens.size ? [...p.tokens] : null;
    const both = (chosen ?? [...lab.masks.tokens]).filter((j) => lab.masks.tokens.has(j)).sort((a, b) => a - b);
    if (!both.length) return "";
    const names = both.map((j) => `${j}:${visibleToken(labels[j] ?? "?")}`).join(" ");
    const all = chosen && both.length === chosen.length;
    return `${all ? "Every chosen key is" : `Key${both.length > 1 ? "s" : ""} ${names} ${both.length > 1 ? "are" : "is"}`} also masked`
      + `${all ? ` (${names})` : ""}: a masked key's column of P is 0 whatever its score, so perturbing it ${p.on ? "changes" : "would change"} nothing `
      + "where the mask applies (the effects read ± 0 there).";
  }

  store.subscribe(update);
  update();
  return { update, setTokens, togglePick, maskedNote };
}
