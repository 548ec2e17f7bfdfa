"""Starting the child interpreters omni runs (a stage's worker process, the other ranks of a parallel stage): the
one place that starts them, ties them to their parent's life and says how they ended.

A child is a fresh interpreter (`python -c`), never multiprocessing's spawn, which would import the caller's
`__main__` again (a user's script, pytest). It runs `entry` ("module:function") with one JSON argument. Before the
entry runs, the child asks the kernel for SIGKILL when its parent dies (Linux PR_SET_PDEATHSIG), whatever killed
the parent, kill -9 included, and exits at once if the parent is already gone; elsewhere a thread polls getppid.
PR_SET_PDEATHSIG fires when the *thread* that started the child exits, so a child is started from the main thread
or from one long-lived launcher thread here, never from a short-lived thread (an Omni built in a thread, a restart
in a background thread). An exception out of the entry is written to a pipe the parent reads (`Child.cause()`),
as well as to stderr. Restart policy and remote placement (Ray) are the callers' business.
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import traceback
from typing import Any

_LAUNCHER: dict[str, Any] = {}
_LAUNCH_LOCK = threading.Lock()
PR_SET_PDEATHSIG = 1
POLL_S = 0.5  # how often a child polls its parent where the kernel cannot signal it
BOOT = "from omni_kernel.util.launch import boot; boot()"


class Child:
    """A started child: its `Popen` (`proc`), and the pipe it reports its exception on."""

    def __init__(self, proc: subprocess.Popen, report: int):
        self.proc = proc
        self.report = report
        self.error = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def cause(self) -> str:
        """How the child ended, in words ("killed by SIGKILL", "exit code 1: ValueError: ..."); it must have."""
        how = exit_cause(self.proc.returncode)
        error = self.read_error()
        return f"{how}: {error}" if error else how

    def read_error(self) -> str:
        """The last line of the exception the child reported, if it reported one."""
        if self.report >= 0:
            chunks = []
            try:
                while chunk := os.read(self.report, 65536):
                    chunks.append(chunk)
            except OSError:  # nothing more (the child lives on and wrote nothing: non-blocking)
                pass
            if chunks:
                lines = b"".join(chunks).decode(errors="replace").strip().splitlines()
                self.error = lines[-1] if lines else ""
        return self.error

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL, then reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout)
        self.close()

    def close(self) -> None:
        if self.report >= 0:
            self.read_error()
            os.close(self.report)
            self.report = -1


def exit_cause(code: int | None) -> str:
    """A return code in words: the signal's name where a signal ended the process."""
    if code is not None and code < 0 and -code in signal.Signals._value2member_map_:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def start(entry: str, arg: Any = None, *, env: dict | None = None, pass_fds: tuple = (),
          stdout: int | None = 2) -> Child:
    """Start `entry` ("module:function", called with the JSON value `arg`) in a fresh interpreter that dies
    with this process. `pass_fds` stay open in the child; stdin is /dev/null, stdout goes to stderr by default
    (a child's prints must not mix into the parent's output)."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    args = [sys.executable, "-c", BOOT, entry, json.dumps(arg), str(os.getpid()), str(write)]
    try:
        proc = _popen(args, pass_fds=(*pass_fds, write), env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                      close_fds=True)
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)
    return Child(proc, read)


def _popen(args: list, **kwargs) -> subprocess.Popen:
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(args, **kwargs)
    with _LAUNCH_LOCK:
        if "queue" not in _LAUNCHER:
            _LAUNCHER["queue"] = queue.Queue()
            threading.Thread(target=_launcher, args=(_LAUNCHER["queue"],), name="omni-launcher", daemon=True).start()
    done: queue.Queue = queue.Queue()
    _LAUNCHER["queue"].put((args, kwargs, done))
    ok, value = done.get()
    if not ok:
        raise value
    return value


def _launcher(requests: queue.Queue) -> None:
    while True:
        args, kwargs, done = requests.get()
        try:
            done.put((True, subprocess.Popen(args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            done.put((False, exc))


def boot() -> None:
    """The child's side: die with the parent, then run the entry; an exception out of it is reported."""
    entry, arg, parent, report = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    die_with(parent)
    try:
        module, name = entry.split(":")
        getattr(importlib.import_module(module), name)(arg)
    except BaseException as exc:
        if isinstance(exc, SystemExit):
            raise
        text = "".join(traceback.format_exception(exc))
        sys.stderr.write(text)
        try:
            os.write(report, text.encode(errors="replace")[-4096:])  # within the pipe's buffer: never blocks
        except OSError:
            pass
        sys.stderr.flush()
        os._exit(1)


def die_with(parent: int) -> None:
    """SIGKILL this process when `parent` dies (Linux: the kernel does it; elsewhere a polling thread); exit now
    if it already has."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:  # it died before the kernel was asked to tell
        os._exit(0)
    if not armed:
        threading.Thread(target=_poll_parent, args=(parent,), name="omni-parent-poll", daemon=True).start()


def _poll_parent(parent: int) -> None:
    while os.getppid() == parent:
        threading.Event().wait(POLL_S)
    os._exit(0)
