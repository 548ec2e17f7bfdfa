"""Starting a worker process through the kernel's launcher (omni_kernel/util/launch.py: a fresh interpreter that
dies with the front), with its thread and device settings, talking over a socketpair."""

from __future__ import annotations

import multiprocessing.connection
import os
import socket

from omni_kernel.util.launch import Child
from omni_kernel.util.launch import start as launch

from .cores import SHARED, host_cores
from .stage_host import WorkerSpec

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def start_worker(spec: WorkerSpec) -> tuple[Child, multiprocessing.connection.Connection]:
    """The worker's interpreter (worker.child_main) talking over a socketpair as a multiprocessing Connection;
    its end reads EOF when the worker dies."""
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
    try:
        child = launch("omni_workers.worker:child_main", back.fileno(), env=env, pass_fds=(back.fileno(),))
    except BaseException:
        front.close()
        raise
    finally:
        back.close()
    return child, multiprocessing.connection.Connection(front.detach())
