"""`attnlab`: the one command-line entry point (installed by `pip install -e .` as a console script).

    attnlab serve [--host H --port P --model [ID=]SOURCE --no-allocator-bound + any uvicorn option]  (app/serve.py)
    attnlab prepare [--weights-dir DIR --force --model ID | --gguf PATH --name NAME] (attnlab_prepare.py)
    attnlab bench [--only SECTION ... + run_all.py's options]                        (benchmarks/run_all.py)

Each subcommand hands its arguments, untouched, to the code that already owns them, so `attnlab serve`
behaves exactly like `python -m app.serve` and `attnlab prepare` like `python -m attnlab_prepare`.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from app.allocator import bound_allocator  # shared with app/serve.py (which this module starts)

ROOT = Path(__file__).resolve().parent.parent  # the checkout (the install is editable)
BENCH = ROOT / "benchmarks" / "run_all.py"

USAGE = """usage: attnlab {serve,prepare,bench} [options]

An attention laboratory for Transformers.

commands:
  serve     serve the web app and API (uvicorn with attnlab's lifecycle); `attnlab serve --help`
            lists every option; `--model [ID=]SOURCE` (repeatable) adds an operator's checkpoint
  prepare   prepare the default models' weights into weights/ (a no-op when they are up to date);
            `--model whisper-base|qwen2.5-0.5b|qwen2.5-1.5b` prepares that optional model instead;
            `--gguf PATH --name NAME` prepares a GGUF file of a supported decoder family
  bench     run the benchmarks (benchmarks/run_all.py; `attnlab bench --help`)

Settings come from ATTNLAB_* environment variables (docs/configuration.md)."""

SERVE_PREFACE = """usage: attnlab serve [APP] [options]

Serves attnlab (APP defaults to app.main:app) with uvicorn's options below, plus:
  --model [ID=]SOURCE   add a checkpoint of any family (a local folder or a hub id already in the cache), or a
                        llama.cpp GGUF file (ID=/path/model.gguf: dequantized into weights/ID on first use);
                        repeatable; the command-line form of ATTNLAB_EXTRA_MODELS
  --no-allocator-bound  leave glibc's malloc alone: arenas unbounded, no periodic malloc_trim, no warm heap (the
                        same as ATTNLAB_MALLOC_ARENA_MAX=0 ATTNLAB_MALLOC_TRIM_INTERVAL_S=0
                        ATTNLAB_WARM_HEAP_BYTES=0); by default the server runs with MALLOC_ARENA_MAX=2 (unless the
                        environment sets it), trims every 10 s and keeps 32 MiB of its free heap memory mapped
Weights are read from ATTNLAB_WEIGHTS_DIR (default: weights/ in the checkout, as `attnlab prepare` writes).
"""

def _serve(args: list[str]) -> int:
    if any(a in ("-h", "--help") for a in args):
        print(SERVE_PREFACE, flush=True)
        args = ["--help"]
    # The prepared weights are the checkout's whatever the working directory (the setting's default is
    # relative to it); an explicit ATTNLAB_WEIGHTS_DIR wins.
    os.environ.setdefault("ATTNLAB_WEIGHTS_DIR", str(ROOT / "weights"))
    if args != ["--help"]:
        # before app.serve is imported: the server process is then `python -m app.serve` with the bound from its start
        args = bound_allocator("app.serve", args)
    from app import serve

    serve.main(args)  # exits the process itself (see app/serve.py: no waiting for worker threads)
    return 0


def _prepare(args: list[str]) -> int:
    from attnlab_prepare import main as prepare_main

    return prepare_main(args)


def _bench(args: list[str]) -> int:
    if not BENCH.is_file():
        print(f"attnlab bench: {BENCH} is missing (the benchmarks run from a checkout)", file=sys.stderr)
        return 2
    # As a module from the checkout's root: the bench imports tests/browser's Chromium settings from there.
    return subprocess.run([sys.executable, "-m", "benchmarks.run_all", *args], cwd=ROOT).returncode


COMMANDS = {"serve": _serve, "prepare": _prepare, "bench": _bench}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"attnlab: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return COMMANDS[command](rest)


if __name__ == "__main__":
    sys.exit(main())
