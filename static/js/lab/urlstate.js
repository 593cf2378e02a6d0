// Shareable state in the URL hash: model, input, layer, head, β, mode, scopes, masks, perturbations.
// Opening such a URL restores the view. Keys are short; lists are comma-separated.
//   b=log10(β/β₀)  bm=view|run  bs=scope (or "layers" with br=from-to)
//   mk=1,4 (masked keys)  ms=scope  c=1 cs=scope (causal)  ab=1 as=scope (ablation)  pos=off|shuffle posseed=3
//   pt=keys|queries pk=3,5 pσ… stored as ps (σ) pa (α) pseed pn (samples) pscope pon=1
import { OP_FORMS } from "./interventions.js";

const SCOPES = new Set(["all", "layer", "head"]);

const ints = (text) => (text ? text.split(",").map(Number).filter((v) => Number.isInteger(v) && v >= 0) : []);
const num = (text, fallback) => (text !== null && text !== "" && Number.isFinite(Number(text)) ? Number(text) : fallback);
const scope = (text, fallback) => (SCOPES.has(text) ? text : fallback);

export function labToParams(lab, params = new URLSearchParams()) {
  params.set("b", String(Math.round(lab.beta.logRatio * 1000) / 1000));
  params.set("bm", lab.beta.mode);
  params.set("bs", lab.beta.scope);
  if (lab.beta.scope === "layers") params.set("br", `${lab.beta.from}-${lab.beta.to}`);
  if (lab.masks.tokens.size) { params.set("mk", [...lab.masks.tokens].sort((a, b) => a - b).join(",")); params.set("ms", lab.masks.scope); }
  if (lab.causal.on) { params.set("c", "1"); params.set("cs", lab.causal.scope); }
  if (lab.ablate.on) { params.set("ab", "1"); params.set("as", lab.ablate.scope); }
  for (const [op, form] of Object.entries(OP_FORMS)) formToParams(lab[op], form, params);
  const p = lab.perturb;
  if (p.on || p.tokens.size) {
    params.set("pon", p.on ? "1" : "0");
    params.set("pt", p.target);
    if (p.tokens.size) params.set("pk", [...p.tokens].sort((a, b) => a - b).join(","));
    params.set("ps", String(p.sigma));
    params.set("pa", String(p.alpha));
    params.set("pseed", String(p.seed));
    params.set("pn", String(p.samples));
    params.set("pscope", p.scope);
  }
  return params;
}

// A described op (interventions.js OP_FORMS): `${url}=<first field>` when on, `${url}${name}=<value>` for the others
// (positions: pos=off|shuffle posseed=3).
function formToParams(state, form, params) {
  if (!state?.on) return;
  Object.keys(form.fields).forEach((name, i) => params.set(i ? `${form.url}${name}` : form.url, String(state[name])));
}

function paramsToForm(params, state, form) {
  Object.entries(form.fields).forEach(([name, field], i) => {
    const text = params.get(i ? `${form.url}${name}` : form.url);
    if (field.options) {
      const known = field.options.some(([value]) => value === text);
      if (i === 0) state.on = known;
      if (known) state[name] = text;
    } else {
      const value = Math.round(num(text, state[name]));
      state[name] = field.int?.min !== undefined ? Math.max(field.int.min, value) : value;
      if (i === 0) state.on = text !== null;
    }
  });
}

// Sets are refilled in place: a page may hold the same Set (e.g. its own masked patches).
function replaceSet(set, values) {
  set.clear();
  for (const v of values) set.add(v);
}

export function paramsToLab(params, lab) {
  lab.beta.logRatio = Math.max(-3, Math.min(3, num(params.get("b"), lab.beta.logRatio)));
  if (["view", "run"].includes(params.get("bm"))) lab.beta.mode = params.get("bm");
  lab.beta.scope = params.get("bs") === "layers" ? "layers" : scope(params.get("bs"), lab.beta.scope);
  const range = /^(\d+)-(\d+)$/.exec(params.get("br") ?? "");
  if (range) [lab.beta.from, lab.beta.to] = [Number(range[1]), Number(range[2])];
  replaceSet(lab.masks.tokens, ints(params.get("mk")));
  lab.masks.scope = scope(params.get("ms"), lab.masks.scope);
  lab.causal.on = params.get("c") === "1";
  lab.causal.scope = scope(params.get("cs"), lab.causal.scope);
  lab.ablate.on = params.get("ab") === "1";
  lab.ablate.scope = scope(params.get("as"), lab.ablate.scope);
  for (const [op, form] of Object.entries(OP_FORMS)) if (lab[op]) paramsToForm(params, lab[op], form);
  const p = lab.perturb;
  p.on = params.get("pon") === "1";
  if (["keys", "queries"].includes(params.get("pt"))) p.target = params.get("pt");
  replaceSet(p.tokens, ints(params.get("pk")));
  p.sigma = Math.max(0, num(params.get("ps"), p.sigma));
  p.alpha = num(params.get("pa"), p.alpha);
  p.seed = Math.max(0, Math.round(num(params.get("pseed"), p.seed)));
  p.samples = Math.min(64, Math.max(1, Math.round(num(params.get("pn"), p.samples))));
  p.scope = scope(params.get("pscope"), p.scope);
  return lab;
}

export function readHash() {
  const hash = window.location.hash.replace(/^#/, "");
  return new URLSearchParams(hash);
}

export const hasState = () => readHash().has("l") || readHash().has("b");

// Replace (not push) so the back button isn't flooded by slider moves.
export function writeHash(params) {
  const hash = "#" + params.toString();
  if (window.location.hash !== hash) history.replaceState(null, "", hash);
}

export const intParam = (params, key, fallback) => {
  const v = Number(params.get(key));
  return params.has(key) && Number.isInteger(v) && v >= 0 ? v : fallback;
};

// How the page's figures are drawn (not the lab's state, but part of what a link shows): the heatmap's
// colour scale zs (with zk = k for "the max over rows ≥ k") and the difference figure's kind dk.
//   zs=max|fixed|log|row|rowsk  zk=4  dk=diff|ratio
export const COLOUR_SCALES = ["max", "fixed", "log", "row", "rowsk"];
const DIFF_KINDS = ["diff", "ratio"];

export function figureToParams({ scale = null, rowsFrom = null, diff = null }, params = new URLSearchParams()) {
  if (COLOUR_SCALES.includes(scale)) params.set("zs", scale);
  if (scale === "rowsk" && Number.isInteger(rowsFrom)) params.set("zk", String(rowsFrom));
  if (DIFF_KINDS.includes(diff)) params.set("dk", diff);
  return params;
}

// {scale, rowsFrom, diff}: each null where the link does not say (or says something unknown).
export function paramsToFigure(params) {
  const scale = COLOUR_SCALES.includes(params.get("zs")) ? params.get("zs") : null;
  const diff = DIFF_KINDS.includes(params.get("dk")) ? params.get("dk") : null;
  return { scale, rowsFrom: intParam(params, "zk", null), diff };
}
