// Small numeric helpers shared by the views (§2).

// Row softmax of β·s with masked entries at −∞; an all-masked row is all zeros (never NaN).
export function softmaxRow(scores, beta, masked = null) {
  let max = -Infinity;
  for (let j = 0; j < scores.length; j++) {
    if (masked && masked[j]) continue;
    const v = beta * scores[j];
    if (v > max) max = v;
  }
  const out = new Array(scores.length).fill(0);
  if (max === -Infinity) return out;
  let sum = 0;
  for (let j = 0; j < scores.length; j++) {
    if (masked && masked[j]) continue;
    out[j] = Math.exp(beta * scores[j] - max);
    sum += out[j];
  }
  for (let j = 0; j < out.length; j++) out[j] /= sum;
  return out;
}

export function softmaxMatrix(scores, beta, masked = null) {
  return scores.map((row) => softmaxRow(row, beta, masked));
}

export function entropy(row) {
  let h = 0;
  for (const p of row) if (p > 0) h -= p * Math.log(p);
  return h;
}

// Decode a tensor field: nested lists pass through; {"dtype": "float32" | "float16" | "uint8", "shape",
// "data": base64} is unpacked into nested arrays of numbers (uint8 thumbnails come back as 0..1,
// relative to each head's maximum).
export function decodeTensor(field) {
  if (!field || Array.isArray(field)) return field;
  if (field.values) return reshape(field.values, field.shape); // the binary form (api.js postBinary): a Float32Array
  const bytes = base64Bytes(field.data);
  if (field.dtype === "uint8") return reshape(Array.from(bytes, (b) => b / 255), field.shape);
  if (field.dtype === "float32") return reshape(new Float32Array(bytes.buffer, bytes.byteOffset, bytes.length / 4), field.shape);
  const halves = new Uint16Array(bytes.buffer, bytes.byteOffset, bytes.length / 2);
  return reshape(Array.from(halves, halfToFloat), field.shape);
}

// Tensor fields of a response as nested lists (for a JSON export that reads without a decoder); an
// encoder–decoder's fields hold one tensor per attention kind.
export function decodedFields(response, names = ["attention", "scores", "base_attention", "thumbnails"]) {
  const out = { ...response };
  const decode = (field) => (!field || Array.isArray(field) || field.dtype ? decodeTensor(field) : Object.fromEntries(Object.entries(field).map(([k, v]) => [k, decode(v)])));
  for (const name of names) if (out[name] && !Array.isArray(out[name])) out[name] = decode(out[name]);
  return out;
}

function base64Bytes(data) {
  if (Uint8Array.fromBase64) return Uint8Array.fromBase64(data);
  const text = atob(data);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  return bytes;
}

export function halfToFloat(h) {
  const s = h & 0x8000 ? -1 : 1;
  const e = (h >> 10) & 0x1f;
  const f = h & 0x3ff;
  if (e === 0) return s * 2 ** -14 * (f / 1024);
  if (e === 31) return f ? NaN : s * Infinity;
  return s * 2 ** (e - 15) * (1 + f / 1024);
}

// flat: an array or typed array; the innermost rows come back as plain arrays of numbers.
function reshape(flat, shape, offset = 0) {
  if (shape.length === 1) return Array.from(flat.subarray ? flat.subarray(offset, offset + shape[0]) : flat.slice(offset, offset + shape[0]));
  const step = shape.slice(1).reduce((a, b) => a * b, 1);
  const out = [];
  for (let i = 0; i < shape[0]; i++) out.push(reshape(flat, shape.slice(1), offset + i * step));
  return out;
}

export const fmt = (x, digits = 4) => (x === null || x === undefined ? "–" : Number(x).toPrecision(digits));

// max |x| over a (nested) array with a loop: Math.max(...xs) overflows the call stack past ~100k values.
export function maxAbs(values, floor = 0) {
  let max = floor;
  const visit = (v) => {
    if (Array.isArray(v)) { for (const x of v) visit(x); } else if (Math.abs(v) > max) max = Math.abs(v);
  };
  visit(values);
  return max;
}
