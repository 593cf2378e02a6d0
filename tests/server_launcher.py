"""Test servers without paying torch's and transformers' imports at each start (issue 41 §3).

A server start (`python -m app.serve`, `python -m uvicorn app.main:app`) spends most of its 15-30 s importing torch
and transformers. `launch()` has them imported once per pytest worker, in a "zygote" process (this module run as
`python -m tests.server_launcher FD`), which forks one child per server. The child sets the server's environment,
working directory, stdin/stdout/stderr (file descriptors passed over a Unix socket) and sys.argv, restores
the signal handlers a fresh interpreter has, and runs the same entry point with runpy: the server under test is the
real app in a real process of its own; only the imports were paid earlier. The test side gets a `ServerProcess`,
which behaves like the `subprocess.Popen` it replaces (pid, poll, wait, terminate, kill, send_signal, returncode,
stdout for a pipe). The zygote reaps its children and tells their exit statuses (negative: killed by that signal).

What a child could not inherit correctly falls back to a plain `subprocess.Popen`:
- anything but `python -m uvicorn|app.serve …` in the checkout's root, and `--no-allocator-bound`;
- ATTNLAB_TEST_EXEC=1 in the test's environment (to compare, or to rule the launcher out).
Environment variables read while the imports run (HF_HUB_OFFLINE, OMP_*, MALLOC_ARENA_MAX, PYTHON*, …) cannot be
changed in a child, nor can sys.path (the working directory and PYTHONPATH, set when the interpreter starts): the
zygote is chosen by the working directory and all of the environment but ATTNLAB_* and PYTEST_* (and a PYTHONPATH that
names only the working directory, already first on sys.path), and a second zygote starts for a second set (in a
`make test` worker: one for `uvicorn`, one or two for `app.serve`). For `app.serve` the test side first
adds what app/allocator.py would re-execute the server with (MALLOC_ARENA_MAX=2), so the zygote starts with it in its
environment, as glibc needs, and the child has the same allocator bound as an exec'd `python -m app.serve`.

Forking a process with threads is unsafe, so the zygote checks that it has one thread before serving. Importing numpy
and scipy starts OpenBLAS's thread pools; OpenBLAS shuts them down at a fork (pthread_atfork) and starts them again
when next used, so the zygote forks once and exits that child before its check; the servers start their pools anew.
What a child shares with its siblings: the hash seed (PYTHONHASHSEED) and the modules imported by the zygote.

ATTNLAB_TEST_SERVER_LOG=FILE appends one line per server start (the test, the module, zygote or exec), to count them.
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("uvicorn", "app.serve")  # the entry points a child can run
EXEC_SETTING = "ATTNLAB_TEST_EXEC"  # =1: every server is a plain subprocess.Popen, as before
COUNT_SETTING = "ATTNLAB_TEST_SERVER_LOG"
RUN_TIME_PREFIXES = ("ATTNLAB_", "PYTEST_")  # read once the app runs, not by the zygote's imports
MAX_MESSAGE = 1 << 20


# ---- the test side ---------------------------------------------------------------------------------------------
class Zygote:
    """One zygote process (`python -m tests.server_launcher FD` in `cwd` with `env`) and the socket to it; calls are
    serialised by a lock. Its own output goes to artifacts/server-zygote-<worker>.log."""

    def __init__(self, env: dict[str, str], cwd: str):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        (ROOT / "artifacts").mkdir(exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(ROOT / "artifacts" / f"server-zygote-{worker}.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.server_launcher", str(theirs.fileno())],
                                         cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, pass_fds=[theirs.fileno()])
        theirs.close()
        self.lock = threading.Lock()

    def call(self, request: dict, fds: list[int] = ()) -> dict:
        with self.lock:
            if fds:
                socket.send_fds(self.sock, [json.dumps(request).encode()], list(fds))
            else:
                self.sock.send(json.dumps(request).encode())
            reply = self.sock.recv(MAX_MESSAGE)
        if not reply:
            raise RuntimeError(f"the server zygote {self.proc.pid} has gone (exit status {self.proc.poll()})")
        answer = json.loads(reply)
        if "error" in answer:
            raise RuntimeError(f"server zygote: {answer['error']}")
        return answer

    def close(self) -> None:
        self.sock.close()  # the zygote kills the children it still has and exits
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_zygotes: dict[tuple, Zygote] = {}
_zygotes_lock = threading.Lock()


def _zygote_for(env: dict[str, str], cwd: str) -> Zygote:
    """The zygote whose imports saw this environment, and whose sys.path this directory's `python -m` has."""
    redundant = {p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() == Path(cwd)}
    key = (cwd, *sorted((k, v) for k, v in env.items() if not k.startswith(RUN_TIME_PREFIXES)
                        and not (k == "PYTHONPATH" and redundant == set(v.split(os.pathsep)))))
    with _zygotes_lock:
        if key not in _zygotes or _zygotes[key].proc.poll() is not None:  # none yet, or it has gone
            _zygotes[key] = Zygote(dict(key[1:]), cwd)
        return _zygotes[key]


@atexit.register
def _close_zygotes() -> None:
    for zygote in list(_zygotes.values()):
        zygote.close()


class ServerProcess:
    """The test's handle on a zygote's child, with subprocess.Popen's names. `stdout` is a binary file when the
    launch asked for stdout=subprocess.PIPE."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str], stdout=None):
        self.zygote, self.pid, self.args, self.stdout = zygote, pid, args, stdout
        self.stdin = self.stderr = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.call({"op": "status", "pid": self.pid})["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped yet, so the pid is still this child's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.stdout is not None:
            self.stdout.close()
        self.wait()


def _standard_fds(stdin, stdout, stderr) -> tuple[list[int], list[int], object]:
    """(fds for the child's 0, 1, 2; fds to close here once sent; the read end of a stdout pipe or None), from
    Popen's kinds of argument: None (this process's own), DEVNULL, PIPE (stdout only), STDOUT (stderr), a file."""
    opened: list[int] = []

    def fd_of(value, own: int) -> int:
        if value is None:
            return own
        if value == subprocess.DEVNULL:
            opened.append(os.open(os.devnull, os.O_RDWR))
            return opened[-1]
        return value if isinstance(value, int) else value.fileno()

    reader = None
    if stdout == subprocess.PIPE:
        read_fd, write_fd = os.pipe()
        reader, out = os.fdopen(read_fd, "rb"), write_fd
        opened.append(write_fd)
    else:
        out = fd_of(stdout, 1)
    err = out if stderr == subprocess.STDOUT else fd_of(stderr, 2)
    if stdin == subprocess.PIPE or stderr == subprocess.PIPE:
        raise ValueError("launch(): stdin and stderr pipes are not supported (use a file, or stderr=STDOUT)")
    return [fd_of(stdin, 0), out, err], opened, reader


def _child_environ(module: str, env: dict[str, str]) -> dict[str, str]:
    """The environment the server runs with: for app.serve, what app/allocator.py would re-execute it with."""
    if module != "app.serve":
        return env
    from app.allocator import allocator_environ

    return allocator_environ(env) or env


def _count(module: str, mode: str) -> None:
    path = os.environ.get(COUNT_SETTING)
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        with open(path, "a") as out:
            out.write(f"{test}\t{module}\t{mode}\n")


def launch(args: list[str], cwd: str | Path, env: dict[str, str] | None = None, stdin=None, stdout=None,
           stderr=None):
    """A server started like `subprocess.Popen(args, cwd=cwd, env=env, stdin=…, stdout=…, stderr=…)`: a forked
    child of this worker's zygote when args are `[sys.executable, "-m", "uvicorn"|"app.serve", …]`, else (or with
    ATTNLAB_TEST_EXEC=1) that very Popen. Returns a ServerProcess or a Popen."""
    args = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    eligible = (len(args) >= 3 and args[0] == sys.executable and args[1] == "-m" and args[2] in MODULES
                and "--no-allocator-bound" not in args and os.environ.get(EXEC_SETTING, "") in ("", "0")
                and Path(cwd).resolve() == ROOT)  # the zygote is `python -m tests.server_launcher` in the checkout
    _count(args[2] if len(args) > 2 else args[0], "zygote" if eligible else "exec")
    if not eligible:
        return subprocess.Popen(args, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr)
    env = _child_environ(args[2], env)
    fds, opened, reader = _standard_fds(stdin, stdout, stderr)
    cwd = str(Path(cwd).resolve())
    zygote = _zygote_for(env, cwd)
    try:
        request = {"op": "spawn", "module": args[2], "args": args[3:], "cwd": cwd, "env": env}
        pid = zygote.call(request, fds)["pid"]
    finally:
        for fd in opened:
            os.close(fd)
    return ServerProcess(zygote, pid, args, reader)


# ---- the zygote ------------------------------------------------------------------------------------------------
def _import_heavy_modules() -> None:
    """What every server imports and takes longest: torch, transformers and its PreTrainedModel (which pulls
    torch.distributed.tensor, torch._dynamo, scipy.optimize). Nothing of app.*, nothing that reads settings."""
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import PreTrainedModel  # noqa: F401


def _fork_once_to_stop_blas_threads() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def _threads() -> list[str]:
    return sorted(os.listdir("/proc/self/task"))


def _reap(children: dict[int, int | None]) -> None:
    """Collect the exit statuses of children that have ended: Popen's returncode (−N: killed by signal N)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children[pid] = os.waitstatus_to_exitcode(status)


def _serve(control: socket.socket, children: dict[int, int | None]):
    """Answer the test side until it closes the socket. Returns the request in a forked child (which goes on to be
    the server), None in the zygote at the end."""
    while True:
        ready, _, _ = select.select([control], [], [], 0.5)
        _reap(children)
        if not ready:
            continue
        message, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 3)
        if not message:
            return None
        request = json.loads(message)
        if request["op"] == "status":
            control.send(json.dumps({"returncode": children.get(request["pid"])}).encode())
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            request["fds"] = fds
            return request
        for fd in fds:
            os.close(fd)
        children[pid] = None
        control.send(json.dumps({"pid": pid}).encode())


def _become_server(request: dict, control: socket.socket, handlers: dict) -> None:
    """In the forked child: take the server's standard streams, environment, sys.argv and a fresh interpreter's
    signal handlers, then run its module as `python -m` would (an exception or SystemExit ends this process the same
    way). Its directory and sys.path are the zygote's, chosen for them."""
    control.close()
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)  # 0, 1, 2; dup2 clears close-on-exec, as the child of a Popen has them
    for fd in set(request["fds"]):
        if fd > 2:
            os.close(fd)
    for sig, handler in handlers.items():
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError):  # the C library's own real-time signals
            pass
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["module"], *request["args"]]  # run_module puts the module's file first, as -m does
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    handlers = {sig: signal.getsignal(sig) for sig in signal.valid_signals()
                if sig not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(sig) is not None}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the servers, not the zygote the tests still ask
    started = time.monotonic()
    _import_heavy_modules()
    _fork_once_to_stop_blas_threads()
    threads = _threads()
    print(f"server zygote {os.getpid()}: imports in {time.monotonic() - started:.1f} s, threads {threads}", flush=True)
    children: dict[int, int | None] = {}
    if len(threads) != 1:
        control.send(json.dumps({"error": f"the zygote has {len(threads)} threads after its imports; "
                                          f"set {EXEC_SETTING}=1"}).encode())
        return
    request = _serve(control, children)
    if request is None:  # the test side has gone: its servers go too
        for pid, code in children.items():
            if code is None:
                os.kill(pid, signal.SIGKILL)
        return
    _become_server(request, control, handlers)


if __name__ == "__main__":
    main()
