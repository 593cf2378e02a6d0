"""The allocator bound the server starts with (docs/deploy.md "Memory allocator"): shared by the `attnlab serve`
entry point (app/cli.py) and the server itself (app/serve.py), which is why it is a module of its own."""
from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping

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
