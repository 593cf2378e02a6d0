// Jobs (docs/api.md "Jobs"): a request sent with `Accept: text/event-stream` streams
// `{"accepted": true, "eta_s", "queue_position", "runs"}` first, then `{"progress", "total", "run", "runs"}` (or a
// continuation's own step events), then `{"done": true, …}` or `{"error", "retry_after"?}`. An older server sends no
// `accepted` event: everything here works from the progress events alone.
import { readJSON, serverEvents } from "../api.js";

// POST `body` as a job; onEvent(event) hears every event but the last. Resolves with the done event (or the JSON
// answer of a server that did not stream), rejects with the refusal or the error event (an AbortError on abort).
export async function postJob(url, body, { signal, onEvent = () => {} } = {}) {
  const res = await fetch(url, {
    method: "POST", headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
    body: JSON.stringify(body), signal,
  });
  if (!res.ok || !res.headers.get("content-type")?.startsWith("text/event-stream")) return readJSON(res);
  for await (const event of serverEvents(res.body)) {
    if (event.done) return event;
    if (event.error) throw jobError(event);
    onEvent(event);
  }
  throw new Error("the server ended the stream without a response");
}

// An error event as an Error: "retry in N s" when the server says when (a full queue, a job over its time).
export function jobError(event) {
  const retry = Number(event.retry_after);
  const err = new Error(`${event.error}${retry > 0 ? ` (retry in ${Math.ceil(retry)} s)` : ""}`);
  err.retryAfter = retry > 0 ? retry : null;
  return err;
}

// A count-down of a job's time left, shown by render(text) once a second while it runs:
// "waiting: 2 jobs ahead · about 12 s left". The server's eta_s first; once two progress events have arrived
// (layers, a scan's batches, a continuation's tokens) the rate they came at refines it.
export function jobClock(render) {
  let deadline = null, ahead = 0, first = null, timer = null, done = false;
  const now = () => performance.now();
  const text = () => {
    const parts = [];
    if (ahead > 0) parts.push(`waiting: ${ahead} job${ahead === 1 ? "" : "s"} ahead`);
    if (deadline !== null) {
      const left = Math.ceil((deadline - now()) / 1000);
      parts.push(left > 0 ? `about ${left} s left` : "finishing…");
    }
    return parts.join(" · ");
  };
  const tick = () => { if (!done) render(text()); };
  const start = () => { if (!timer) timer = setInterval(tick, 1000); };
  return {
    // every event of the stream: accepted (ETA, queue), progress (the rate), or a step of `total` steps
    event(e) {
      if (e.accepted) {
        ahead = Math.max(0, Number(e.queue_position) || 0);
        if (Number.isFinite(Number(e.eta_s))) deadline = now() + 1000 * Math.max(0, Number(e.eta_s));
      } else if (e.progress !== undefined) this.step(e.progress, e.total);
      start();
      tick();
    },
    // done of total steps (a continuation counts its tokens)
    step(doneSteps, total) {
      ahead = 0; // work arriving: the job runs now
      const t = now();
      if (first === null || doneSteps < first.done) { first = { t, done: doneSteps }; return; }
      const rate = (doneSteps - first.done) / Math.max(1, t - first.t); // steps per ms
      if (rate > 0 && total > doneSteps) deadline = t + (total - doneSteps) / rate;
      else if (total <= doneSteps) deadline = t;
    },
    text,
    stop() { done = true; clearInterval(timer); timer = null; },
  };
}
