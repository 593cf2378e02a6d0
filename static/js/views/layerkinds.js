// Local and global layers (/guide#s9-10, GET /api/models `layer_types`, `sliding_window`). Gemma 3 interleaves five
// local layers, where a query i sees only the window's most recent keys i − w + 1 … i, with one global layer that
// sees every earlier key. The layer picker, the model view's rows and the long overview's title name each layer's
// kind; the long overview, its windows and row plots of a local layer draw the band's edge: key i − w, the most
// recent key a query can no longer see (everything left of the line is exactly 0).

// {type: "sliding" | "full" | "chunked", window: w | null} of a layer, or null for a model that does not list its
// layers' kinds (encoders, encoder–decoders, every-layer-global decoders).
export function layerKind(info, layer) {
  const types = info?.layer_types;
  if (!Array.isArray(types) || !types.includes("sliding") && !types.includes("chunked")) return null;
  const type = types[layer];
  return type ? { type, window: type === "sliding" ? info.sliding_window ?? null : null } : null;
}

// The band's width w of a local layer (the layer's window), null for a global one or a model without local layers.
export const bandOf = (info, layer) => layerKind(info, layer)?.window ?? null;

const WORDS = { sliding: "local", full: "global", chunked: "chunked" };

// "layer 2 · local 512", "layer 5 · global"; "layer 3" where the model does not say.
export function layerLabel(info, layer) {
  const kind = layerKind(info, layer);
  if (!kind) return `layer ${layer}`;
  return `layer ${layer} · ${WORDS[kind.type] ?? kind.type}${kind.window ? ` ${kind.window}` : ""}`;
}

// The model view's row label and its tooltip: "L5 g" / "L2 ℓ" (global / local), or "L3".
export function rowLabel(info, layer) {
  const kind = layerKind(info, layer);
  if (!kind) return { text: `L${layer}`, title: `layer ${layer}` };
  const word = WORDS[kind.type] ?? kind.type;
  return {
    text: `L${layer} ${kind.type === "full" ? "g" : kind.type === "sliding" ? "ℓ" : "c"}`,
    title: `layer ${layer}: ${word}${kind.window ? `, window ${kind.window} tokens (a query sees its last ${kind.window} keys)` : kind.type === "full" ? " (every earlier key)" : ""}`,
  };
}

const EDGE = { color: "#e8590c", width: 1.5, dash: "dash" };

// Plotly shapes of the band's edge on a map whose x are keys and y queries, in token coordinates: the line
// key = query − w (+½: between the last key out of reach and the first one seen), over the drawn ranges
// [y0, y1) × [x0, x1) (the overview: the whole map; a window: its rows and columns, cells centred on integers).
export function bandShapes(w, { x0, x1, y0, y1, cells = false }) {
  if (!w) return [];
  const shift = cells ? 0.5 : 0; // a window's cells are centred on their index; the overview's axis is continuous
  const x = (y) => y - w + shift;
  // the drawn area is [x0 − shift, x1 − shift] × [y0 − shift, y1 − shift]; the line within it
  const lo = Math.max(y0 - shift, x0 - 2 * shift + w), hi = Math.min(y1 - shift, x1 - 2 * shift + w);
  if (!(hi > lo)) return []; // the band's edge is not in this part of the map
  return [{ type: "line", xref: "x", yref: "y", x0: x(lo), y0: lo, x1: x(hi), y1: hi, line: EDGE, name: "band" }];
}

// A row plot of query i over every key: a vertical line at key i − w (+½), where the local layer's band begins.
export function rowBandShapes(w, i) {
  if (!w || i - w < 0) return [];
  return [{ type: "line", xref: "x", yref: "paper", x0: i - w + 0.5, x1: i - w + 0.5, y0: 0, y1: 1, line: EDGE, name: "band" }];
}

// The row plot's note: where the window begins for this row.
export const rowBandNote = (w, i) => (w && i - w >= 0 ? ` · local layer: keys before ${i - w + 1} are outside the ${w}-token window (dashed line)` : "");
