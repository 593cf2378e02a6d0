"""The pages' one fetch client (static/js/api.js), run in the browser on Response objects built in the page.

A body whose read is aborted must reject with the AbortError: the client once caught every body-read failure as
"an error body that is not JSON", so an ok response aborted mid-body (a newer request on the same channel) resolved
to { detail: "OK" }, and the Gaussian page read `res.conv[0]` of it (an uncaught TypeError that failed CI)."""
from __future__ import annotations

READ = """async (body) => {
  const { readJSON, ApiError } = await import('/static/js/api.js');
  const aborted = async () => {  // a real fetch, aborted once its headers are in (as a newer request on a channel does)
    const controller = new AbortController();
    const response = await fetch('/api/gaussian/history', { signal: controller.signal });
    controller.abort();
    return response;
  };
  const make = await {
    aborted,
    cut: (status) => new Response(new ReadableStream({
      start(c) { c.enqueue(new TextEncoder().encode('{"conv": [')); c.error(new DOMException('aborted', 'AbortError')); },
    }), { status }),
    text: (status) => new Response('<html>bad gateway</html>', { status, statusText: 'Bad Gateway' }),
    json: (status) => new Response(JSON.stringify({ detail: 'max_tokens: 9000 > 4096', conv: [[1]] }), { status }),
  }[body.kind](body.status);
  try {
    return { value: await readJSON(make) };
  } catch (err) {
    return { error: err.name, api: err instanceof ApiError, status: err.status ?? null, message: err.message };
  }
}"""


def read(page, kind, status):
    return page.evaluate(READ, {"kind": kind, "status": status})


def test_read_json_rethrows_an_aborted_body_and_names_refusals(page, page_log, live_server):
    page.goto(f"{live_server}/gaussian")
    assert read(page, "aborted", 200)["error"] == "AbortError"
    # an ok body that breaks off is an error, never a value without the fields the caller reads
    assert set(read(page, "cut", 200)) == {"error", "api", "status", "message"}
    assert read(page, "json", 200) == {"value": {"detail": "max_tokens: 9000 > 4096", "conv": [[1]]}}
    refused = read(page, "json", 413)
    assert refused["api"] and refused["status"] == 413 and "max_tokens" in refused["message"]
    # a refusal whose body is not JSON (a proxy's page) is named by its status text
    assert read(page, "text", 502)["message"] == "502: Bad Gateway"
    assert read(page, "text", 200)["error"] == "SyntaxError"
    page_log.check()
