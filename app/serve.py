"""`python -m app.serve [APP] [uvicorn options]`: uvicorn's command line, exiting 0 after a graceful SIGTERM.

uvicorn catches SIGTERM, stops accepting connections, lets in-flight requests finish (at most
`--timeout-graceful-shutdown` seconds, default here 8 so that `docker stop`'s 10 s suffice), runs the
lifespan shutdown, and then re-raises the signal with the handler that was in place before it started,
so the process would die *of* SIGTERM (exit status 143 / -15). A no-op handler installed first turns
that into a normal exit 0. APP defaults to app.main:app.
"""
from __future__ import annotations

import signal
import sys

import uvicorn

DEFAULT_APP = "app.main:app"
GRACEFUL_SHUTDOWN_S = "8"


def build_args(argv: list[str]) -> list[str]:
    args = list(argv)
    if not args or args[0].startswith("-"):
        args.insert(0, DEFAULT_APP)
    if not any(a.startswith("--timeout-graceful-shutdown") for a in args):
        args += ["--timeout-graceful-shutdown", GRACEFUL_SHUTDOWN_S]
    return args


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # only until uvicorn installs its own
    uvicorn.main.main(args=build_args(sys.argv[1:] if argv is None else argv), prog_name="uvicorn")


if __name__ == "__main__":
    main()
