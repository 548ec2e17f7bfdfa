"""Test servers forked from one preloaded interpreter, so that each `omni serve` a test starts skips the ~9 s of
CPU its imports cost (torch, transformers, diffusers, the plugins) on a 2-core machine.

The fork server is a fresh interpreter per pytest process (per xdist worker), started on first use, that imports
the modules a server needs and runs nothing: no Python thread runs in it when it forks (torch's import leaves one
native helper thread, as it does under the forked workers of torch's own DataLoader). Each child it forks
applies the request's environment, working directory and log file (stdout and stderr), then runs the request's
`python -c` code with its arguments, and ends the way that interpreter would (SystemExit, uncaught exception,
atexit handlers, non-daemon threads joined). A child is a real process with its own pid: signals reach it,
`/proc` shows its workers as its children, and it dies with the fork server, which dies with pytest
(PR_SET_PDEATHSIG). `Forked` answers the part of `subprocess.Popen` the tests use; the fork server reports each
child's exit status as Popen would (minus the signal number for a signal).
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Everything a served pipeline imports on its way to /health, so that a child imports nothing heavy itself.
PRELOAD_PACKAGES = ("omni_kernel", "omni_hf", "omni_qwen", "omni_wan", "omni_bridge", "omni_serve")
PRELOAD_MODULES = ("diffusers", "transformers", "torch", "fastapi", "uvicorn", "httpx", "omni_workers.plugin",
                   "omni_workers.process_stage", "omni_workers.worker_process")
REAP_S = 0.02
BOOT = f"import sys; sys.path.insert(0, {str(HERE)!r}); import forkserver; forkserver.serve()"


class Forked:
    """A child of the fork server, seen from the test: pid, returncode, poll, wait, send_signal, kill."""

    def __init__(self, server: ForkServer, pid: int):
        self.server = server
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        return self.server.codes.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.server.changed:
            if not self.server.changed.wait_for(lambda: self.pid in self.server.codes or not self.server.alive(),
                                                timeout):
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout)
        if self.pid not in self.server.codes:
            raise RuntimeError(f"the fork server died before pid {self.pid} ended: {self.server.log_path}")
        return self.server.codes[self.pid]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it ended since: the exit report is on its way
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The test's end: starts the fork server, asks it for children, collects their exit codes."""

    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.codes: dict[int, int] = {}
        self.pids: list[int] = []
        self.changed = threading.Condition()
        self.lock = threading.Lock()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", BOOT, str(os.getpid())], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=env)
        threading.Thread(target=self._read, name="forkserver-reports", daemon=True).start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, code: str, args: list[str], env: dict, log_path: Path, cwd: str | None = None) -> Forked:
        request = {"code": code, "args": args, "env": env, "log": str(log_path), "cwd": cwd or os.getcwd()}
        with self.lock:
            count = len(self.pids)
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            with self.changed:
                if not self.changed.wait_for(lambda: len(self.pids) > count or not self.alive(), 300):
                    raise RuntimeError(f"the fork server did not fork in 300 s: {self.log_path}")
            if len(self.pids) == count:
                raise RuntimeError(f"the fork server exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            return Forked(self, self.pids[count])

    def _read(self) -> None:
        for line in self.proc.stdout:
            report = json.loads(line)
            with self.changed:
                if "exit" in report:
                    self.codes[report["exit"]] = report["code"]
                else:
                    self.pids.append(report["pid"])
                self.changed.notify_all()
        self.proc.wait()
        with self.changed:
            self.changed.notify_all()


_SERVER: list[ForkServer] = []
_SERVER_LOCK = threading.Lock()


def fork_server(log_dir: Path) -> ForkServer:
    """This process's fork server, started on the first call (its log in that call's `log_dir`); a new one if it
    died."""
    with _SERVER_LOCK:
        if not _SERVER or not _SERVER[0].alive():
            _SERVER[:] = [ForkServer(log_dir / f"forkserver-{os.getpid()}.log")]
        return _SERVER[0]


# The fork server's side.

def serve() -> None:
    """Preload, then fork a child per request line on stdin; report pids and exit codes on stdout. A child
    leaves the loop and runs its request; the fork server exits when pytest closes its stdin."""
    from omni_kernel.util.launch import die_with

    die_with(int(sys.argv[1]))
    preload()
    request = loop(sys.stdin.buffer.raw, sys.stdout.fileno())
    if request is not None:
        run(request)


def preload() -> None:
    for name in PRELOAD_MODULES:
        importlib.import_module(name)
    for package in PRELOAD_PACKAGES:
        module = importlib.import_module(package)
        for info in pkgutil.walk_packages(module.__path__, package + "."):
            importlib.import_module(info.name)
    if threading.active_count() != 1:
        raise RuntimeError(f"a preloaded module started threads, so forking is unsafe: {threading.enumerate()}")


def loop(requests, reports: int) -> dict | None:
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([requests], [], [], REAP_S)
        reap(children, reports)
        if not readable:
            continue
        line = requests.readline()
        if not line:
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return json.loads(line)
        children.add(pid)
        os.write(reports, json.dumps({"pid": pid}).encode() + b"\n")


def reap(children: set[int], reports: int) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            os.write(reports, json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


def run(request: dict) -> None:
    """Become the requested `python -c code args...`: its fds, directory and environment, then its code."""
    from omni_kernel.util.launch import die_with

    die_with(os.getppid())
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for target, source in ((0, null), (1, log), (2, log)):
        os.dup2(source, target)
    os.close(null)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["-c", *request["args"]]
    exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
