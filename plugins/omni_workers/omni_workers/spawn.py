"""Starting a worker process: a fresh interpreter (`python -c`, so the caller's __main__ is never imported again
as multiprocessing's spawn would), launched from the main thread or from one long-lived launcher thread."""

from __future__ import annotations

import multiprocessing.connection
import os
import queue
import socket
import subprocess
import sys
import threading
from typing import Any

from .cores import SHARED, host_cores
from .stage_host import WorkerSpec

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")

_LAUNCHER: dict[str, Any] = {}
_LAUNCH_LOCK = threading.Lock()


def launch(args, **kwargs) -> subprocess.Popen:
    """Popen from the main thread or from one long-lived launcher thread: PR_SET_PDEATHSIG fires when the
    *thread* that started the worker exits, so a worker started from a short-lived thread (an Omni built in a
    thread, a restart on a server's engine thread) would be killed with it."""
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(args, **kwargs)
    with _LAUNCH_LOCK:
        if "queue" not in _LAUNCHER:
            _LAUNCHER["queue"] = queue.Queue()
            threading.Thread(target=_launcher, args=(_LAUNCHER["queue"],), name="omni-worker-launcher",
                             daemon=True).start()
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


def start_worker(spec: WorkerSpec) -> tuple[subprocess.Popen, multiprocessing.connection.Connection]:
    """A fresh interpreter (not multiprocessing's spawn, which would import the caller's __main__ again)
    talking over a socketpair as a multiprocessing Connection; its end reads EOF when the worker dies."""
    front, back = socket.socketpair()
    env = dict(os.environ)
    if spec.threads:  # shared: the libraries' pools sized for every core, used as the board says
        for var in THREAD_VARS:
            env[var] = str(host_cores() if spec.threads == SHARED else spec.threads)
    if spec.threads == SHARED:  # see cores.py: a step that finds the cores taken must not spin
        env.setdefault("GOMP_SPINCOUNT", "10000")
    devices = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if spec.replica is not None and devices:  # the GPUs the front was given, one to each replica in turn
        env["CUDA_VISIBLE_DEVICES"] = devices[spec.replica % len(devices)]
    code = f"from omni_workers.worker import child_main; child_main({back.fileno()})"
    try:
        proc = launch([sys.executable, "-c", code], pass_fds=(back.fileno(),), env=env,
                      stdin=subprocess.DEVNULL, stdout=2, close_fds=True)
    except BaseException:
        front.close()
        raise
    finally:
        back.close()
    return proc, multiprocessing.connection.Connection(front.detach())
