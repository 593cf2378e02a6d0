// The laboratory's intervention state (one small store shared by the text, image and speech pages) and the
// editable list of active interventions. Meaning of every op: §2–4; wire format: docs/api.md.
//
// Scopes follow the selection: "head" = the selected layer and head, "layer" = every head of the
// selected layer, "all" = every layer and head. β alone also takes "layers": every head of layers
// from … to … (e.g. layers 10–12 of a 30-layer LM).

import { button } from "../dom.js";

export const SCOPE_LABELS = { all: "all layers & heads", layer: "this layer", head: "this head" };
export const RANGE_LABEL = "layers from … to …";

export const HELP = {
  temperature: "P = softmax(β·S + M); T = 1/β. β → ∞: one-hot rows; β → 0: uniform over unmasked keys (§2)",
  mask_keys: "M[:, j] = −∞: column j of P becomes 0, each row renormalises (§3)",
  causal: "M[i, j] = −∞ for j > i: a decoder's self-attention (§3)",
  ablate_heads: "the head's output H = PV is replaced by zeros before W_O (§3)",
  perturb_keys: "k̂_j = α k_j + ε, ε ~ N(0, σ²I): only column j of S changes, Ŝ[i,j] = α S[i,j] + q_i·ε (§4)",
  perturb_queries: "q̂_i = α q_i + ε: at that layer and head only row i of S and P changes (§4)",
};

// The ops whose page form is made from a description (one entry per op: a new op's page form is one entry here).
// The entry's key is the op's name and its key in the lab's state. An entry gives:
//   label, help (HELP[op]), helpTail (after the help on the page), where (the active list's scope when `scoped` is
//   false: the op has no layers/heads), describe(iv) (the active list's label),
//   fields: {name: {label, value (default), options: [[value, text]…] | int: {min}, enabledWhen(state)}}: the
//   controls (ids `${op}-toggle`, `${op}-${name}`, `${op}-reset`) and the request item's fields, in order;
//   url: the URL hash key: `${url}=<first field>` when on, `${url}${name}=<value>` for the others.
export const OP_FORMS = {
  positions: {
    label: "Positions", url: "pos", scoped: false, where: "the input embeddings",
    help: "the model's positions off (absolute embeddings zeroed, RoPE at position 0) or shuffled by a seed: without them self-attention is permutation-equivariant, P(πx) = Π P(x) Πᵀ",
    helpTail: "; the effect panel shows what it does to the output.",
    fields: {
      mode: { label: "mode", value: "off", options: [["off", "off (no positions)"], ["shuffle", "shuffle (seeded permutation)"]] },
      seed: { label: "seed", value: 0, int: { min: 0 }, enabledWhen: (state) => state.mode === "shuffle" },
    },
    describe: (iv) => (iv.mode === "off" ? "positions off" : `positions shuffled, seed ${iv.seed}`),
  },
};
for (const [op, form] of Object.entries(OP_FORMS)) HELP[op] = form.help;

// A described op's state: on/off, each field at its default, and a scope (used when the op is scoped).
const formState = (form) => ({ on: false, ...Object.fromEntries(Object.entries(form.fields).map(([k, f]) => [k, f.value])), scope: "all" });

export function createLab() {
  return {
    beta: { logRatio: 0, scope: "head", mode: "run", from: 0, to: 0 }, // logRatio = log10(β / β₀); from/to: scope "layers"
    masks: { tokens: new Set(), scope: "head" },
    causal: { on: false, scope: "all" },
    ablate: { on: false, scope: "head" },
    perturb: { on: false, target: "keys", tokens: new Set(), sigma: 1, alpha: 1, seed: 0, samples: 1, scope: "head" },
    ...Object.fromEntries(Object.entries(OP_FORMS).map(([op, form]) => [op, formState(form)])),
  };
}

// ctx.kind (encoder–decoder models): which attention the selection is in ("encoder" | "decoder" | "cross");
// every intervention then names it. Other models leave it undefined and send no kind.
export function scopeFields(scope, { layer, head, kind }) {
  const named = kind ? { kind } : {};
  if (scope === "all") return { layers: null, heads: null, ...named };
  if (scope === "layer") return { layers: [layer], heads: null, ...named };
  return { layers: [layer], heads: [head], ...named };
}

export const betaOf = (lab, nativeBeta) => nativeBeta * 10 ** lab.beta.logRatio;
export const betaIsNative = (lab) => Math.abs(lab.beta.logRatio) < 1e-9;
const sorted = (set) => [...set].sort((a, b) => a - b);

// The list sent to the server, in a fixed order. Each item carries `_key` (which control made it),
// stripped by `forServer()` before sending. View-mode β is done in the browser and is not sent.
export function buildInterventions(lab, ctx) {
  const list = [];
  if (!betaIsNative(lab) && lab.beta.mode === "run") {
    const b = lab.beta;
    const where = b.scope === "layers"
      ? { ...scopeFields("all", ctx), layers: Array.from({ length: Math.abs(b.to - b.from) + 1 }, (_, i) => Math.min(b.from, b.to) + i) }
      : scopeFields(b.scope, ctx);
    list.push({ _key: "beta", op: "temperature", beta: betaOf(lab, ctx.nativeBeta), ...where });
  }
  if (lab.masks.tokens.size) list.push({ _key: "masks", op: "mask_keys", tokens: sorted(lab.masks.tokens), ...scopeFields(lab.masks.scope, ctx) });
  if (lab.causal.on) list.push({ _key: "causal", op: "causal", ...scopeFields(lab.causal.scope, ctx) });
  if (lab.ablate.on) list.push({ _key: "ablate", op: "ablate_heads", ...scopeFields(lab.ablate.scope, ctx) });
  const p = lab.perturb;
  if (p.on) {
    list.push({
      _key: "perturb", op: p.target === "queries" ? "perturb_queries" : "perturb_keys",
      tokens: p.tokens.size ? sorted(p.tokens) : null, noise_std: p.sigma, scale: p.alpha, seed: p.seed,
      ...scopeFields(p.scope, ctx),
    });
  }
  for (const [op, form] of Object.entries(OP_FORMS)) {
    const state = lab[op];
    if (!state?.on) continue;
    const values = Object.fromEntries(Object.keys(form.fields).map((k) => [k, state[k]]));
    list.push(form.scoped === false ? { _key: op, _scope: false, op, ...values } : { _key: op, op, ...values, ...scopeFields(state.scope, ctx) });
  }
  return list;
}

// The speech page's list (Whisper, docs/api.md): its masks are spans of encoder positions (20 ms each) and its
// ablations single cross heads, both the page's own lists; β scales cross-attention; the perturbation's keys are in
// the attention `perturbKind` ("cross" | "encoder"), its queries are decoder tokens (cross). A scope of every layer
// leaves layers/heads out, and the order is spans, perturbation, β, ablations: what the page has always sent.
// spans: [{kind, tokens, text, remove()}]; ablated: [{layer, head, remove()}]. Each item carries _key, _text, _remove and
// _scope for the active list (renderActiveList); forServer() drops them.
export function buildSpeechInterventions(lab, { spans, ablated, layer, head, perturbKind, nativeBeta }) {
  const scoped = (iv, scope) => {
    if (scope !== "all") iv.layers = [layer];
    if (scope === "head") iv.heads = [head];
    return iv;
  };
  const list = spans.filter((s) => s.tokens.length).map((s) => ({
    op: "mask_keys", kind: s.kind, tokens: s.tokens, _key: "span", _text: s.text, _scope: false, _remove: s.remove,
  }));
  const p = lab.perturb;
  if (p.on) {
    const queries = p.target === "queries";
    const iv = scoped({
      op: queries ? "perturb_queries" : "perturb_keys", kind: queries ? "cross" : perturbKind,
      tokens: p.tokens.size ? sorted(p.tokens) : null, noise_std: p.sigma, scale: p.alpha, seed: p.seed,
    }, p.scope);
    list.push({ ...iv, _key: "perturb", _text: `perturb ${queries ? "queries" : "keys"} σ=${iv.noise_std} (${iv.kind})` });
  }
  if (!betaIsNative(lab)) {
    const iv = scoped({ op: "temperature", kind: "cross", beta: betaOf(lab, nativeBeta) }, lab.beta.scope);
    list.push({ ...iv, _key: "beta", _text: `β = ${(10 ** lab.beta.logRatio).toPrecision(3)}·β₀ on cross-attention` });
  }
  for (const a of ablated) {
    list.push({ op: "ablate_heads", kind: "cross", layers: [a.layer], heads: [a.head],
      _key: "ablate", _text: `ablate cross L${a.layer} H${a.head}`, _scope: false, _remove: a.remove });
  }
  return list;
}

export const forServer = (list) => list.map((item) => Object.fromEntries(Object.entries(item).filter(([k]) => !k.startsWith("_"))));

export function resetControl(lab, key) {
  const fresh = createLab()[key];
  if (key === "beta") { lab.beta.logRatio = 0; return; } // keep mode and scope
  if (key === "perturb") { lab.perturb.on = false; lab.perturb.tokens.clear(); return; }
  if (key === "masks") { lab.masks.tokens.clear(); return; } // in place: a page may share this Set
  Object.assign(lab[key], fresh, { scope: lab[key].scope });
}

export function resetAll(lab) {
  for (const key of ["beta", "masks", "causal", "ablate", "perturb", ...Object.keys(OP_FORMS)]) if (lab[key]) resetControl(lab, key);
}

function describe(iv, tokens) {
  const names = (ids) => (ids === null ? "all tokens" : ids.map((j) => `${j}:${tokens?.[j] ?? "?"}`).join(" "));
  if (OP_FORMS[iv.op]) return OP_FORMS[iv.op].describe(iv);
  switch (iv.op) {
    case "temperature": return `β = ${Number(iv.beta).toPrecision(4)}`;
    case "mask_keys": return `mask keys ${names(iv.tokens)}`;
    case "causal": return "causal mask";
    case "ablate_heads": return "ablate head output";
    default: return `${iv.op === "perturb_keys" ? "perturb keys" : "perturb queries"} ${names(iv.tokens)} · σ=${iv.noise_std} α=${iv.scale} seed=${iv.seed}`;
  }
}

// layers/heads null or left out: every one (the speech page leaves them out)
const where = (iv) => (iv.kind ? `${iv.kind} attention, ` : "") + (OP_FORMS[iv.op]?.scoped === false ? OP_FORMS[iv.op].where : iv.layers == null ? "all layers & heads"
  : `layer ${iv.layers.join(",")}${iv.heads == null ? ", all heads" : `, head ${iv.heads.join(",")}`}`);

// The editable list: one row per active intervention with its scope (changeable) and a remove button.
// `extra` rows (e.g. view-only β) are shown but not editable. onChange(key) is called after any edit.
// list: the page's own list where it builds its interventions itself (the speech page); an item may carry _text
// (its label), _remove() (what × does, instead of resetting the control _key) and _scope: false (no scope select).
// betaRange: the β row's scope offers "layers from … to …". clearAll(): what "reset all" does, if more than the lab's.
export function renderActiveList(el, lab, ctx, { tokens = null, extra = [], samples = 1, onChange, list = null, betaRange = true, clearAll = null }) {
  list ??= buildInterventions(lab, ctx);
  el.replaceChildren();
  const head = document.createElement("div");
  head.className = "iv-head";
  head.textContent = list.length || extra.length ? `Active interventions (applied in this order${samples > 1 ? `, ${samples} samples` : ""}):` : "Active interventions: none";
  el.append(head);
  if (list.length) {
    const all = button("reset all", () => { if (clearAll) clearAll(); else resetAll(lab); onChange("all"); });
    all.id = "reset-all";
    head.append(" ", all);
  }
  for (const text of extra) {
    const row = document.createElement("div");
    row.className = "iv-row";
    row.textContent = text;
    el.append(row);
  }
  list.forEach((iv) => {
    const row = document.createElement("div");
    row.className = "iv-row";
    row.dataset.key = iv._key;
    const label = document.createElement("span");
    label.className = "mono";
    label.textContent = iv._text ?? `${iv.op}: ${describe(iv, tokens)} @ ${where(iv)}`;
    label.title = HELP[iv.op] || "";
    const remove = button("×", () => { if (iv._remove) iv._remove(); else resetControl(lab, iv._key); onChange(iv._key); });
    remove.title = "remove this intervention";
    remove.className = "iv-remove";
    remove.setAttribute("aria-label", `remove ${label.textContent}`);
    if (iv._scope === false) { row.append(label, " ", remove); el.append(row); return; }
    const scope = scopeSelect(lab[iv._key].scope, (value) => { lab[iv._key].scope = value; onChange(iv._key); },
      { range: iv._key === "beta" && betaRange });
    row.append(label, " scope ", scope, " ", remove);
    el.append(row);
  });
}

// range: offer "layers from … to …" (β only).
export function scopeSelect(value, onChange, { range = false } = {}) {
  const select = document.createElement("select");
  for (const [v, text] of Object.entries(SCOPE_LABELS)) select.append(new Option(text, v));
  if (range) select.append(new Option(RANGE_LABEL, "layers"));
  select.value = value;
  select.addEventListener("change", () => onChange(select.value));
  return select;
}

