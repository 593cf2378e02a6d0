// Jobs (docs/api.md "Jobs"): a request sent with `Accept: text/event-stream` streams
// `{"accepted": true, "eta_s", "queue_position", "runs"}` first, then `{"progress", "total", "run", "runs"}` (or a
// continuation's own step events), then `{"done": true, …}` or `{"error", "retry_after"?}`. An older server sends no
// `accepted` event: everything here works from the progress events alone.
import { readJSON, serverEvents } from "../api.js";

// POST `body` as a job; onEvent(event) hears every event but the last. Resolves with the done event (or the JSON
// answer of a server that did not stream), rejects with the refusal or the error event (an AbortError on abort).
// On a fleet (docs/deploy.md "Fleet") a job whose replica died mid-stream, or that a stopping replica refused, is
// sent again (up to JOB_RETRIES times; the new stream's accepted event restarts the count-down): nothing for the
// user to do. Not once the stream has delivered events of its own (a continuation's tokens): those would repeat. A
// stream cut while its job lives re-attaches instead (postJobOnce).
export const JOB_RETRIES = 3;
export async function postJob(url, body, { signal, onEvent = () => {} } = {}) {
  for (let attempt = 0; ; attempt++) {
    try {
      return await postJobOnce(url, body, { signal, onEvent });
    } catch (err) {
      if (signal?.aborted || err.name === "AbortError" || !err.passing || attempt >= JOB_RETRIES) throw err;
      await new Promise((resolve) => setTimeout(resolve, 1000 * Math.min(5, err.retryAfter || 0.5)));
    }
  }
}

// One try: an error marked `passing` is worth sending again (no answer, a 502/503/504, a replica shutting down). A
// stream cut mid-way re-attaches first (GET /api/jobs/{job_id}/events with the last event's id: the work in progress
// goes on, nothing is repeated); only when that fails (the job or its replica is gone) is the job sent again. An
// abort (Cancel, a newer request) also cancels the job on the server (DELETE), which would otherwise run on for
// job_reattach_grace_s awaiting a re-attach.
async function postJobOnce(url, body, { signal, onEvent }) {
  const passing = (err, retryAfter = null) => Object.assign(err, { passing: true, retryAfter });
  // own: an event of the work's own (not accepted/progress) reached the caller: not sent again (it would repeat)
  const job = { lastId: null, own: false, remember: (id) => rememberJob(url, body, id) };
  // the same job still live from before a page reload (sessionStorage): its events from where the page left off
  const saved = savedJob(url);
  let res = saved && saved.key === JSON.stringify(body) ? await reattach(saved.lastId, signal) : null;
  if (res) job.lastId = saved.lastId;
  else if (saved) forgetJob(url); // unknown, expired or its replica gone (404): sent again below
  if (!res) {
    try {
      res = await fetch(url, {
        method: "POST", headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
        body: JSON.stringify(body), signal,
      });
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw passing(err); // the server was not reached
    }
  }
  if ([502, 503, 504].includes(res.status)) {
    const retry = Number(res.headers.get("retry-after"));
    try { return await readJSON(res); } catch (err) { throw passing(err, retry > 0 ? retry : null); }
  }
  if (!res.ok || !res.headers.get("content-type")?.startsWith("text/event-stream")) return readJSON(res);
  const again = (err, retryAfter = null) => (job.own ? err : passing(err, retryAfter));
  const cancel = () => {
    if (job.lastId) fetch(`/api/jobs/${jobIdOf(job.lastId)}`, { method: "DELETE", keepalive: true }).catch(() => {});
  };
  signal?.addEventListener("abort", cancel, { once: true });
  try {
    for (let attach = 0; ; attach++) {
      try {
        const done = await readJob(res, job, { signal, onEvent });
        forgetJob(url);
        return done;
      } catch (err) {
        if (!err.cut) forgetJob(url); // ended (refused, failed, cancelled, aborted): nothing to come back to
        if (err.shutdown || err.unheard) throw again(err, err.retryAfter);
        if (!err.cut) throw err;
        res = job.lastId && attach < JOB_RETRIES ? await reattach(job.lastId, signal) : null;
        if (!res) throw again(err);
      }
    }
  } finally {
    signal?.removeEventListener("abort", cancel);
  }
}

// A job's events from one stream until its done event; an error marked `cut` when the stream broke without it.
async function readJob(res, job, { signal, onEvent }) {
  const cut = (err) => Object.assign(err, { cut: true });
  try {
    for await (const event of serverEvents(res.body, { onId: (id) => { job.lastId = id; job.remember(id); } })) {
      if (event.done) return event;
      // sent again: a job its stopping replica ended (shutdown), or one cancelled because no stream listened within
      // job_reattach_grace_s (unheard: re-attached too late)
      if (event.error) {
        throw Object.assign(jobError(event), { shutdown: /shutting down/.test(event.error), unheard: event.cancelled === true });
      }
      // a gap: a re-attach after more than job_event_buffer events missed (their numbers in event.gap). Progress is
      // cumulative and the done event carries the whole answer: the next events are read as they come
      // a handover (a draining replica moved the job: its stream ends next, and the re-attach follows the new job)
      // is not the work's own either
      if (!event.accepted && event.progress === undefined && !event.gap && !event.handed_over) job.own = true;
      onEvent(event);
    }
  } catch (err) {
    if (err.name === "AbortError" || signal?.aborted || !(err instanceof TypeError)) throw err;
    throw cut(err); // the stream was cut (network error while reading)
  }
  throw cut(new Error("the server ended the stream without a response"));
}

const jobIdOf = (eventId) => eventId.slice(0, eventId.lastIndexOf(":"));

// A page reload re-attaches (docs/api.md "Re-attaching to a job"): the live job of each URL is kept in this tab's
// sessionStorage as its request body and last event id, from its first event to its end. postJob of the same URL
// and body finds it and re-attaches after that id instead of sending the job again; a page reads it on load
// (savedJob) to ask for the same work again (static/js/text.js). Storage refused (private modes, full): no re-attach.
const JOB_STORE = "attnlab:job:";
export function savedJob(url) {
  try {
    const saved = JSON.parse(sessionStorage.getItem(JOB_STORE + url) ?? "null");
    return saved?.lastId && saved.key ? { ...saved, body: JSON.parse(saved.key) } : null;
  } catch { return null; }
}
function rememberJob(url, body, lastId) {
  try { sessionStorage.setItem(JOB_STORE + url, JSON.stringify({ key: JSON.stringify(body), lastId })); } catch { /* no re-attach */ }
}
function forgetJob(url) {
  try { sessionStorage.removeItem(JOB_STORE + url); } catch { /* nothing kept */ }
}

// The rest of a job's events after `lastId`, or null when it cannot be re-attached (404: unknown, expired, its
// replica gone; or no answer).
async function reattach(lastId, signal) {
  try {
    const res = await fetch(`/api/jobs/${jobIdOf(lastId)}/events`, {
      headers: { Accept: "text/event-stream", "Last-Event-ID": lastId }, signal,
    });
    return res.ok && res.headers.get("content-type")?.startsWith("text/event-stream") ? res : null;
  } catch (err) {
    if (err.name === "AbortError") throw err;
    return null;
  }
}

// The time left to show (ms) when the count-down shows `shown` and the rate so far says `fresh`, `fraction` of the
// job done: the estimate is trusted more as the job goes on (a weight from 0.3 at the start to 1 at the end), and one
// event moves the count-down by at most a factor of 2 (from at least 1 s, so that "finishing…" can grow again).
export function smoothLeft(shown, fresh, fraction) {
  const weight = 0.3 + 0.7 * Math.min(1, Math.max(0, fraction));
  const blended = shown + weight * (fresh - shown);
  const base = Math.max(shown, 1000);
  return Math.min(2 * base, Math.max(shown / 2, blended));
}

// An error event as an Error: "retry in N s" when the server says when (a full queue, a job over its time).
export function jobError(event) {
  const retry = Number(event.retry_after);
  const err = new Error(`${event.error}${retry > 0 ? ` (retry in ${Math.ceil(retry)} s)` : ""}`);
  err.retryAfter = retry > 0 ? retry : null;
  return err;
}

// A job that ended without an answer, on a panel with a status line and an error box: stopped by its own Stop
// (mine: this panel's controller is still the one that ran it; a newer run has taken over otherwise), or failed,
// with the message shown and passed on to the page's error line as "what: message".
export function showJobFailure(err, { mine, panel, status, error, onError, what }) {
  if (err.name === "AbortError") {
    if (mine) { status.textContent = "stopped"; panel.dataset.state = "stopped"; }
    return;
  }
  panel.dataset.state = "error";
  status.textContent = "";
  error.textContent = err.message;
  error.hidden = false;
  onError(`${what}: ${err.message}`);
}

// A count-down of a job's time left, shown by render(text) once a second while it runs:
// "waiting: 2 jobs ahead · about 12 s left". The server's eta_s first; once two progress events have arrived
// (layers, a scan's batches, a continuation's tokens) the rate they came at refines it, smoothed (smoothLeft): early
// rates are noisy, and a count-down that jumped 115 → 1,217 → 26 s told the user nothing.
// The job's total is the accepted event's when it names one (total(event): what a page shows as "n of total").
// A handover (a draining replica moved the job to a peer, where it runs again from its start) is said first:
// "moved to another replica (rep1), restarting" until the new job's work arrives, then "restarted on another
// replica (rep1)" beside its count-down: the progress going back to the start is explained, not silent.
// now: the clock in ms (tests replay a job's events on their own clock).
export function jobClock(render, { now = () => performance.now() } = {}) {
  let deadline = null, ahead = 0, first = null, timer = null, done = false, fixedTotal = null, moved = null;
  const text = () => {
    const parts = [];
    if (moved) {
      const where = `another replica${moved.to ? ` (${moved.to})` : ""}`;
      parts.push(moved.restarted ? `restarted on ${where}` : `moved to ${where}, restarting`);
    }
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
    // every event of the stream: accepted (ETA, queue), progress (the rate), a handover, or a step of `total` steps
    event(e) {
      if (e.handed_over) { // the new job's accepted event comes next, with its own ETA and total
        moved = { to: e.handed_over.to, restarted: false };
        deadline = null; first = null; fixedTotal = null;
      } else if (e.accepted) {
        ahead = Math.max(0, Number(e.queue_position) || 0);
        if (Number(e.total) > 0) fixedTotal = Number(e.total);
        if (Number.isFinite(Number(e.eta_s))) deadline = now() + 1000 * Math.max(0, Number(e.eta_s));
      } else if (e.progress !== undefined) this.step(e.progress, e.total);
      start();
      tick();
    },
    // done of total steps (a continuation counts its tokens)
    step(doneSteps, total) {
      ahead = 0; // work arriving: the job runs now
      if (moved) moved.restarted = true;
      total = fixedTotal ?? total;
      const t = now();
      if (first === null || doneSteps < first.done) { first = { t, done: doneSteps }; return; }
      const rate = (doneSteps - first.done) / Math.max(1, t - first.t); // steps per ms
      if (total <= doneSteps) deadline = t;
      else if (rate > 0) {
        const fresh = (total - doneSteps) / rate;
        deadline = t + (deadline === null ? fresh : smoothLeft(Math.max(0, deadline - t), fresh, doneSteps / total));
      }
    },
    // the total a page shows for this event: the accepted event's, else the event's own
    total: (e) => fixedTotal ?? e?.total,
    text,
    stop() { done = true; clearInterval(timer); timer = null; },
  };
}
