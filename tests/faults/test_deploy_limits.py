"""Issue 19 §5 and §12 in deploy/: the pod's memory limit and the app's memory budget agree, and nginx caps
connections and request rates per client (the /view renders and the streams more tightly)."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from app.settings import Settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
HEADROOM = 512 * 2**20  # allocator slack and responses being sent, above the budget


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "g": 2**30, "m": 2**20}
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", str(quantity)).groups()
    return int(number) * units.get(unit, 1)


def test_k8s_and_compose_memory_limits_match_the_memory_budget():
    deployment = next(d for d in yaml.safe_load_all((DEPLOY / "k8s" / "attnlab.yaml").read_text()) if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    budget = int(env["ATTNLAB_MEMORY_BUDGET_BYTES"])
    assert _bytes(container["resources"]["limits"]["memory"]) == budget + HEADROOM
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["attnlab"]
    assert int(compose["environment"]["ATTNLAB_MEMORY_BUDGET_BYTES"]) == budget
    assert _bytes(compose["mem_limit"]) == budget + HEADROOM
    assert Settings().memory_budget_bytes == budget  # the default is what the examples deploy


def test_caches_are_sized_from_the_budget_and_fit_in_it():
    settings = Settings()
    fixed = (settings.memory_reserved_bytes + settings.max_run_bytes
             + settings.max_concurrent_decodes * settings.max_image_pixels * 8)
    assert settings.result_cache_bytes + settings.image_cache_bytes + fixed <= settings.memory_budget_bytes
    assert settings.result_cache_bytes > 256 * 2**20 and settings.image_cache_bytes > 64 * 2**20
    smaller = Settings(memory_budget_bytes=settings.memory_budget_bytes - 400 * 2**20)
    assert smaller.result_cache_bytes < settings.result_cache_bytes  # derived, not fixed
    assert Settings(result_cache_bytes=123_456_789).result_cache_bytes == 123_456_789  # an explicit value wins


def _locations(conf: str) -> dict[str, str]:
    blocks = {}
    for match in re.finditer(r"location\s+([^{\n]+)\{\n(.*?)\n        \}", conf, re.S):
        blocks[match.group(1).strip()] = match.group(2)
    return blocks


def test_nginx_limits_connections_and_rates_per_client():
    conf = (DEPLOY / "nginx.conf").read_text()
    assert re.search(r"limit_conn_zone \$binary_remote_addr zone=conn_per_client:\d+m;", conf)
    assert re.search(r"limit_req_zone \$binary_remote_addr zone=api_per_client:\d+m rate=\d+r/s;", conf)
    assert re.search(r"limit_req_zone \$binary_remote_addr zone=view_per_client:\d+m rate=\d+r/s;", conf)
    assert "large_client_header_buffers 8 8k;" in conf and "client_header_timeout 10s;" in conf
    locations = _locations(conf)
    proxied = {name: body for name, body in locations.items() if "proxy_pass" in body}
    assert len(proxied) == 3, locations.keys()
    for name, body in proxied.items():  # every way to the app is capped per client
        assert "limit_conn conn_per_client" in body and "limit_req zone=" in body, name
    view = next(body for name, body in proxied.items() if "view" in name)
    assert "zone=view_per_client" in view
    caps = {name: int(re.search(r"limit_conn conn_per_client (\d+);", body).group(1)) for name, body in proxied.items()}
    assert caps["= /api/text/generate"] < caps["/"]
