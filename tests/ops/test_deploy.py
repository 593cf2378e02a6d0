"""The deployment files (deploy/): the compose file validated by Debian's docker-compose (`docker-compose
config`), and both it and the Kubernetes example checked against the app they deploy (probe paths that
exist, the port it serves, the settings it reads)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from app.settings import Settings

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
    assert "server attnlab:8000" in nginx and "client_max_body_size" in nginx
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
    gpu = yaml.safe_load((DEPLOY / "k8s" / "gpu-patch.yaml").read_text())
    gpu_container = gpu["spec"]["template"]["spec"]["containers"][0]
    assert gpu_container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {e["name"] for e in gpu_container["env"]} <= SETTINGS


def test_kustomize_renders_with_and_without_the_gpu_patch(tmp_path):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the YAML structure is checked above")
    result = subprocess.run([kubectl, "kustomize", str(DEPLOY / "k8s")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    kinds = sorted(doc["kind"] for doc in yaml.safe_load_all(result.stdout))
    assert kinds == ["Deployment", "Deployment", "HorizontalPodAutoscaler", "Service", "Service"]
    assert "image: registry.example.org/attnlab:0.1.0" in result.stdout
    # The GPU variant as docs/deploy.md describes it: the patch on top, the CUDA tag.
    overlay = tmp_path / "gpu"
    overlay.mkdir()
    for name in ("redis.yaml", "attnlab.yaml", "hpa.yaml", "gpu-patch.yaml"):
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
    assert {e["name"] for e in container["env"]} == {"ATTNLAB_REDIS_URL", "ATTNLAB_REDIS_TTL_S", "ATTNLAB_DEVICE"}
    assert container["readinessProbe"]["httpGet"]["path"] == "/api/ready"  # kept from the base
