"""A few rank processes under torch.distributed (gloo over loopback), started once and given work: `Ranks.run(fn,
*args)` calls `fn(rank, context, *args)` on every rank at once and returns each rank's result. `context` is a
dict the rank keeps between calls (a loaded model). A rank that fails or does not answer in time takes the
group down (its peers would wait in a collective): the error names the rank, and the next call starts anew.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from multiprocessing import connection

from omni_wan.comm import init_ranks, open_store

LOOPBACK = "127.0.0.1"
COLLECTIVE_TIMEOUT_S = 60  # a collective whose peer died fails after this
JOIN_TIMEOUT_S = 5
PRELOAD = ("wan_ranks", "omni_wan.model", "diffusers.pipelines.wan.pipeline_wan_i2v")


def _serve(rank: int, num_ranks: int, port: int, pipe, num_threads: int) -> None:
    import torch

    torch.set_num_threads(num_threads)
    try:
        store = open_store(LOOPBACK, port, num_ranks, timeout_s=COLLECTIVE_TIMEOUT_S)
        init_ranks(rank, num_ranks, store, timeout_s=COLLECTIVE_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the test with it
        pipe.send((False, traceback.format_exc()))
        return
    pipe.send((True, None))
    context: dict = {}
    while (work := pipe.recv()) is not None:
        fn, args = work
        try:
            pipe.send((True, fn(rank, context, *args)))
        except Exception:  # noqa: BLE001 - as above
            pipe.send((False, traceback.format_exc()))
    torch.distributed.destroy_process_group()
    pipe.close()
    os._exit(0)  # the interpreter's teardown of torch and diffusers takes seconds and keeps nothing


class Ranks:
    def __init__(self, num_ranks: int, num_threads: int = 1, timeout_s: float = 120):
        self.num_ranks = num_ranks
        self.num_threads = num_threads
        self.timeout_s = timeout_s
        self.processes: list = []
        self.pipes: list = []
        self.store = None

    def start(self) -> None:
        # A fork server imports torch and diffusers once for every rank (not once per rank, on two cores) and has
        # run nothing: no fork of a process that has torch's threads.
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOAD))
        self.store = open_store(LOOPBACK, 0, self.num_ranks)  # hosted here, on a port the OS assigns
        port = self.store.port
        for rank in range(self.num_ranks):
            parent, child = context.Pipe()
            process = context.Process(target=_serve, args=(rank, self.num_ranks, port, child, self.num_threads),
                                      daemon=True, name=f"omni-test-rank-{rank}")
            process.start()
            self.processes.append(process)
            self.pipes.append(parent)
        self._answers("start")

    def run(self, fn, *args) -> list:
        if not self.processes:
            self.start()
        for pipe in self.pipes:
            pipe.send((fn, args))
        return self._answers(fn.__name__)

    def _answers(self, what: str) -> list:
        """Every rank's answer; the first failure (or silence past the timeout) stops the group at once."""
        results: dict[int, object] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(results) < self.num_ranks:
            waiting = [pipe for rank, pipe in enumerate(self.pipes) if rank not in results]
            ready = connection.wait(waiting, max(0.0, deadline - time.monotonic()))
            if not ready:
                late = [rank for rank in range(self.num_ranks) if rank not in results]
                self.close()
                raise TimeoutError(f"rank(s) {late} did not finish {what} in {self.timeout_s:g} s")
            for pipe in ready:
                rank = self.pipes.index(pipe)
                try:
                    ok, value = pipe.recv()
                except EOFError:
                    ok, value = False, f"exited with code {self.processes[rank].exitcode}"
                if not ok:
                    self.close()
                    raise RuntimeError(f"rank {rank} failed {what}:\n{value}")
                results[rank] = value
        return [results[rank] for rank in range(self.num_ranks)]

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:
                pass
        for process in self.processes:
            process.join(JOIN_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(JOIN_TIMEOUT_S)
        self.processes, self.pipes = [], []
