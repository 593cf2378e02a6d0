"""`attnlab`: the one command-line entry point (installed by `pip install -e .` as a console script).

    attnlab serve [--host H --port P --model [ID=]SOURCE --no-allocator-bound + any uvicorn option]  (app/serve.py)
    attnlab prepare [--weights-dir DIR --force --model ID | --gguf PATH --name NAME] (attnlab_prepare.py)
    attnlab bench [--only SECTION ... + run_all.py's options]                        (benchmarks/run_all.py)

Each subcommand hands its arguments, untouched, to the code that already owns them, so `attnlab serve`
behaves exactly like `python -m app.serve` and `attnlab prepare` like `python -m attnlab_prepare`.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

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
  --no-allocator-bound  leave glibc's malloc alone: arenas unbounded, no periodic malloc_trim (the same as
                        ATTNLAB_MALLOC_ARENA_MAX=0 ATTNLAB_MALLOC_TRIM_INTERVAL_S=0); by default the server runs
                        with MALLOC_ARENA_MAX=2 (unless the environment sets it) and trims every 10 s
Weights are read from ATTNLAB_WEIGHTS_DIR (default: weights/ in the checkout, as `attnlab prepare` writes).
"""

# The allocator bound (docs/deploy.md "Memory allocator"). glibc's malloc gives threads that allocate at once arenas
# of their own (up to 8 per core) and keeps what is freed inside them, for reuse by that arena only: under a mixed
# load of 20 clients RSS grew from 1.65 to 5.57 GB, 4.58 GB of it still held once the result cache was emptied; with
# 2 arenas the same load peaked at 3.9 GB (benchmarks/results/allocator.md). glibc reads MALLOC_ARENA_MAX once,
# before the process's first allocation, so the server re-executes itself with it set.
ARENA_ENV = "MALLOC_ARENA_MAX"
ARENA_SETTING = "ATTNLAB_MALLOC_ARENA_MAX"  # app/settings.py malloc_arena_max; 0: glibc's own default
NO_BOUND_FLAG = "--no-allocator-bound"
DEFAULT_ARENAS = 2
OWN_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")  # preloaded by the operator: their own arenas, left alone


def arena_setting(environ: Mapping[str, str]) -> int:
    raw = environ.get(ARENA_SETTING, str(DEFAULT_ARENAS)).strip()
    value = int(raw) if raw.isdigit() else -1
    if value < 0:
        raise SystemExit(f"{ARENA_SETTING}={raw!r}: a whole number of malloc arenas (0: glibc's own default)")
    return value


def allocator_environ(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment the server must start with for the allocator bound, or None when it already has what it
    needs: MALLOC_ARENA_MAX set by the user (kept as it is), an allocator of its own preloaded, or the bound off."""
    if ARENA_ENV in environ or any(name in environ.get("LD_PRELOAD", "") for name in OWN_ALLOCATORS):
        return None
    arenas = arena_setting(environ)
    return None if arenas == 0 else {**environ, ARENA_ENV: str(arenas)}


def allocator_report(environ: Mapping[str, str]) -> str:
    """What bounds this process's allocator, for the start-up log."""
    preload = environ.get("LD_PRELOAD", "")
    if any(name in preload for name in OWN_ALLOCATORS):
        return f"LD_PRELOAD={preload}"
    if ARENA_ENV in environ:
        return f"{ARENA_ENV}={environ[ARENA_ENV]}"
    return f"glibc's default malloc arenas (8 per core; {ARENA_SETTING}=0 or {NO_BOUND_FLAG})"


def bound_allocator(module: str, args: list[str]) -> list[str]:
    """`args` without --no-allocator-bound; when the bound is on and not yet in this process's environment, replace
    the process (same pid) by `python -m module args` with MALLOC_ARENA_MAX set, and never return."""
    if NO_BOUND_FLAG in args:
        args = [a for a in args if a != NO_BOUND_FLAG]
        os.environ[ARENA_SETTING] = "0"  # the settings (and a re-executed child) see the choice too
        os.environ["ATTNLAB_MALLOC_TRIM_INTERVAL_S"] = "0"  # and no periodic malloc_trim (app/serve.py)
    environ = allocator_environ(os.environ)
    if environ is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        # A SIGTERM while the new image starts (`docker stop` of a starting server) would kill it with status 143:
        # blocked across exec (the mask and a pending signal survive it), it is taken by app/serve.py's exit-at-once
        # handler as soon as that is installed (main() unblocks it).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        os.execve(sys.executable, [sys.executable, "-m", module, *args], environ)
    return args


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
