// One fetch client for every page: JSON in/out (or the binary form, postBinary), stale requests on a channel are
// aborted.
import { halfToFloat } from "./mathx.js";

const inflight = new Map();

export class ApiError extends Error {
  constructor(status, detail, retryAfter = null) {
    super(formatDetail(status, detail));
    this.status = status;
    this.detail = detail;
    this.retryAfter = retryAfter; // seconds, from the refusal's Retry-After (a 503's), else null
  }
}

function formatDetail(status, detail) {
  if (Array.isArray(detail)) {
    return detail.map((d) => `${(d.loc || []).filter((x) => x !== "body").join(".")}: ${d.msg}`).join("; ");
  }
  return `${status}: ${typeof detail === "string" ? detail : JSON.stringify(detail)}`;
}

// A POST of JSON on a channel: a newer call on the same channel aborts the older one (its promise rejects with
// AbortError); read(response) makes the answer.
async function postOn(channel, url, body, headers, read) {
  inflight.get(channel)?.abort();
  const controller = new AbortController();
  inflight.set(channel, controller);
  try {
    const response = await fetch(url, {
      method: "POST",
      headers: { "Content-Type": "application/json", ...headers },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    return await read(response);
  } finally {
    if (inflight.get(channel) === controller) inflight.delete(channel);
  }
}

// POST JSON, answered in JSON.
export function postJSON(url, body, { channel = url } = {}) {
  return postOn(channel, url, body, {}, readJSON);
}

// POST JSON, answered in the binary form (Accept: application/octet-stream, docs/api.md "The binary form"): a JSON
// header, then every f32/f16 field's little-endian bytes. Each such field comes back as { dtype, shape, values }:
// `values` a Float32Array viewing the body's one buffer (f32: no copy; f16 widened into one). decodeTensor
// (mathx.js) reads it as it reads the base64 form. Refusals are JSON as always; channels abort as postJSON's do.
export function postBinary(url, body, { channel = url } = {}) {
  return postOn(channel, url, body, { Accept: BINARY }, async (response) => {
    if (!response.ok || !(response.headers.get("content-type") || "").startsWith(BINARY)) return readJSON(response);
    return readBinary(await response.arrayBuffer());
  });
}

const BINARY = "application/octet-stream";

// The binary body → the answer, each f32/f16 field { dtype, shape, values: Float32Array }.
export function readBinary(buffer) {
  const n = new DataView(buffer).getUint32(0, true);
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 4, n)));
  const start = 4 + n;
  const visit = (field) => {
    if (Array.isArray(field)) return field.length && typeof field[0] === "object" ? field.map(visit) : field;
    if (!field || typeof field !== "object") return field;
    if ((field.dtype === "float32" || field.dtype === "float16") && "offset" in field && "nbytes" in field) {
      const values = field.dtype === "float32"
        ? new Float32Array(buffer, start + field.offset, field.nbytes / 4)
        : Float32Array.from(new Uint16Array(buffer, start + field.offset, field.nbytes / 2), halfToFloat);
      return { dtype: field.dtype, shape: field.shape, values, ...(field.warning ? { warning: field.warning } : {}) };
    }
    return Object.fromEntries(Object.entries(field).map(([key, value]) => [key, visit(value)]));
  };
  return visit(header);
}

export async function getJSON(url) {
  return readJSON(await fetch(url));
}

// A response's JSON body; a refusal (not ok) throws an ApiError with the server's detail, or the status text when
// the body is not JSON. Any other failure to read the body is thrown as it is: an ok body cut short by an abort (a
// newer request on the channel) once resolved to { detail: "OK" }, and the caller read fields it did not have.
export async function readJSON(response) {
  let payload;
  try {
    payload = await response.json();
  } catch (err) {
    if (response.ok || isAbort(err)) throw err;
    payload = { detail: response.statusText };
  }
  if (!response.ok) throw new ApiError(response.status, payload.detail, Number(response.headers.get("retry-after")) || null);
  return payload;
}

export const isAbort = (err) => err && err.name === "AbortError";

// Server-sent events from a fetch() body (EventSource cannot POST): events are separated by a blank line, payload
// lines start with "data:", an optional "event:" line names the event. Yields each event's parsed JSON data; with
// { named: true } it yields { event, data } instead (event "message" when unnamed, data null when it has none).
// onId(id) hears an event's "id:" line (a job's `<job_id>:<n>`, for re-attaching) before the event is yielded.
export async function* serverEvents(stream, { named = false, onId = null } = {}) {
  const reader = stream.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const lines = buffer.slice(0, cut).split("\n");
      buffer = buffer.slice(cut + 2);
      const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      const id = lines.find((l) => l.startsWith("id:"))?.slice(3).trim();
      if (id && onId) onId(id);
      if (!named) {
        if (data) yield JSON.parse(data);
        continue;
      }
      const event = lines.find((l) => l.startsWith("event:"))?.slice(6).trim() || "message";
      yield { event, data: data ? JSON.parse(data) : null };
    }
  }
}

// Status line in the top bar.
export function setStatus(message, { error = false } = {}) {
  const el = document.getElementById("status");
  if (!el) return;
  el.textContent = message;
  el.classList.toggle("error", error);
}
