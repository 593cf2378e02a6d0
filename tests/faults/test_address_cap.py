"""Issue 53 §6 on the real server (uvicorn, raw HTTP): a client id costs nothing to mint (a new X-Attnlab-Client value
is a new client), so the job caps also hold per source address. 40 client ids from one address (forwarded by a
trusted proxy: here the test itself, 127.0.0.1 in trusted_proxies) get that address's cap, answered 429 with
Retry-After naming max_queued_jobs_per_address; another address is still served, and so is the proxy's own."""
from __future__ import annotations

import json

import httpx

from tests.faults.conftest import long_request, text_models

STREAM = {"Accept": "text/event-stream"}
CAP = 3


def _submit(base: str, client: str, address: str | None, seed: int) -> tuple[int, dict, str | None]:
    """One job: (status, its first event or JSON body, Retry-After). The stream is left after its first event: the job
    stays on the board for job_reattach_grace_s, waiting for a re-attach."""
    headers = {**STREAM, "X-Attnlab-Client": client, **({"X-Forwarded-For": address} if address else {})}
    with httpx.stream("POST", base + "/api/text/attention", json=long_request(seed=seed, samples=16), timeout=60,
                      headers=headers) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, response.json(), response.headers.get("Retry-After")
        for line in response.iter_lines():
            if line.startswith("data:"):
                return 200, json.loads(line[5:]), None
    raise AssertionError("the stream ended without an event")


def test_forty_client_ids_from_one_address_get_its_cap_and_another_address_is_served(tiny_bert, big_bert,
                                                                                       start_server):
    server = start_server({**text_models(tiny_bert, big_bert), "max_queued_jobs_per_address": CAP,
                           "trusted_proxies": ["127.0.0.1"], "job_reattach_grace_s": 120})
    server.wait_ready()
    answers = [_submit(server.base, f"minted-client-{i:02d}", "198.51.100.7", seed=i) for i in range(40)]
    statuses = [status for status, _, _ in answers]
    assert statuses.count(200) == CAP and statuses[:CAP] == [200] * CAP, statuses
    assert set(statuses[CAP:]) == {429}, statuses
    for _, body, retry_after in answers[CAP:]:
        assert "max_queued_jobs_per_address=3" in body["detail"] and "198.51.100.7" in body["detail"], body
        assert retry_after is not None and int(retry_after) >= 1
    status, event, _ = _submit(server.base, "another-address-01", "203.0.113.9", seed=99)
    assert status == 200 and event.get("accepted") is True, event  # another address is still served
    status, event, _ = _submit(server.base, "the-proxy-itself-01", None, seed=98)
    assert status == 200 and event.get("accepted") is True, event
    for i, (_, event, _) in enumerate(answers[:CAP]):  # the held jobs end now (DELETE: the page's Cancel)
        cancelled = httpx.delete(f"{server.base}/api/jobs/{event['job_id']}", timeout=10,
                                 headers={"X-Attnlab-Client": f"minted-client-{i:02d}"})
        assert cancelled.status_code == 200, cancelled.text
