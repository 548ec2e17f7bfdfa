"""Shared cores (`worker_threads="shared"`): the worker processes of one front lend their cores to each other.

A small file mapped into the front and every worker holds one byte per worker: 1 while that worker's stage has
unfinished work. Before each step a worker sets torch's threads to max(1, cores // busy workers), cores being
the CPUs it may run on (`os.sched_getaffinity`): the only busy worker uses every core (a pipeline's fill, while
the diffusion worker waits for its first input, and its drain, while the AR worker has nothing left), two busy
workers get half each. A worker marks itself idle before it sends the events of its last step, so the other
one takes the cores at its next step; input processing (a Wan request encodes its image) counts as busy.

A step keeps its threads to its end, so a 2-thread step can find the other worker busy again: its OpenMP
threads then outnumber the cores, and with libgomp's default spin-wait (300,000 spins at each barrier) an AR
step of 8 ms was measured at 100-300 ms. Shared workers are therefore started with GOMP_SPINCOUNT=10000 (unless
set): a waiting thread sleeps after ~10 us. OMP_WAIT_POLICY=PASSIVE fixed it too but lost the second thread's
gain on the AR stage's small ops.

The board is one per front process (every WorkerGroup of it, so two served pipelines share too); workers of
another front process on the same host do not count. Torch-free: torch is called only where it is loaded.
"""

from __future__ import annotations

import atexit
import mmap
import os
import shutil
import sys
import threading

from .tempdirs import make_dir

SLOTS = 256  # workers of one front at once
SHARED = "shared"

_now: int | None = None


def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def set_threads(threads: int | None) -> None:
    """torch's (and OpenMP's, MKL's) threads for the calling thread; remembered for `step_threads`."""
    global _now
    if threads and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    _now = threads or _now


def step_threads() -> int | None:
    """The thread count this worker set for the step running now (None: never set); tests read it."""
    return _now


class CoreBoard:
    """The front's side: the file and its slots, one per live worker (a restarted worker keeps its slot)."""

    def __init__(self):
        self.dir = make_dir("cores")
        self.path = os.path.join(self.dir, "busy")
        with open(self.path, "wb") as f:
            f.write(bytes(SLOTS))
        with open(self.path, "r+b") as f:
            self.map = mmap.mmap(f.fileno(), SLOTS)
        self.free = list(range(SLOTS))
        self.lock = threading.Lock()

    def take(self) -> int:
        with self.lock:
            if not self.free:
                raise RuntimeError(f"more than {SLOTS} worker processes share cores in one front")
            return self.free.pop(0)

    def clear(self, slot: int) -> None:
        """A worker that died or stopped is not busy."""
        self.map[slot] = 0

    def give_back(self, slot: int) -> None:
        self.clear(slot)
        with self.lock:
            self.free.append(slot)

    def close(self) -> None:
        self.map.close()
        shutil.rmtree(self.dir, ignore_errors=True)


_BOARD: list[CoreBoard] = []


def board() -> CoreBoard:
    """The front's one board, made at first use and removed at exit."""
    if not _BOARD:
        _BOARD.append(CoreBoard())
        atexit.register(_BOARD[0].close)
    return _BOARD[0]


class CoreShare:
    """A worker's side: mark busy or idle, and the threads for its next step."""

    def __init__(self, path: str, slot: int):
        self.slot = slot
        self.cores = host_cores()
        with open(path, "r+b") as f:
            self.map = mmap.mmap(f.fileno(), SLOTS)
        self.threads: int | None = None

    def idle(self) -> None:
        if self.map[self.slot]:
            self.map[self.slot] = 0

    def before_step(self) -> int:
        """Mark busy and set the threads for this step (torch is called only when the count changes)."""
        self.map[self.slot] = 1
        threads = max(1, self.cores // max(1, self.map[:].count(1)))
        if threads != self.threads:
            set_threads(threads)
            self.threads = threads if "torch" in sys.modules else None
        return threads
