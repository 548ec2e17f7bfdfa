"""Stage placement: a stage in its own OS process (`process`) behind a proxy with the Stage contract.

The StageScheduler sees a `ProcessStage` like any Stage and knows nothing of processes. The worker process
(worker_process.py is the front's handle on it, spawn.py starts it, worker.py is its loop) rebuilds its stage and
runs its engine loop continuously. Stages of one share key (pipelines whose nodes share an engine) are hosted by
one worker, each behind its own ProcessStage. The front blocks on every worker's pipe at once
(`multiprocessing.connection.wait`; a dead worker's pipe reads EOF) in `Stage.wait`; `step()` returns the events
received so far. `process`/`check` are calls, so a user error stays synchronous at submit. What crosses the pipe,
and how: transport.py.

Faults: a worker that dies fails its in-flight requests with one error naming the stage (kind runtime) and is
restarted, `max_restarts` times (default 1); after that its stage refuses requests (engine_dead). While a restarted
worker builds its stage, what the front sends it waits in its WorkerProcess (`backlog`), so a send never blocks on
a full pipe, and a call (process, check) either waits for the build or, with `WorkerGroup.wait_for_restarts` False
(an AsyncOmni engine thread, which serves every caller), raises StageUnavailable at once. A worker dies with
its parent (the kernel launcher's PR_SET_PDEATHSIG, omni_kernel/util/launch.py) and exits on `close()`; the front
stops its workers at exit.
"""

from __future__ import annotations

import logging
import time

from omni_kernel.core.errors import EngineDead, OmniError, RequestError
from omni_kernel.core.request import StageInput

from . import shared
from .proxy import StageProxy, WorkerDied, WorkerGroup
from .stage_host import WorkerSpec
from .worker_process import WorkerProcess

log = logging.getLogger("omni")


class ProcessStage(StageProxy):
    """The Stage contract over a stage in a worker process (see the module docstring); `worker` is shared by
    the stages of one share key."""

    def __init__(self, spec: WorkerSpec, group: WorkerGroup, max_restarts: int = 1,
                 worker: WorkerProcess | None = None):
        super().__init__(spec, group, max_restarts)
        self.worker = worker or WorkerProcess(spec.threads)
        self.spec = self.worker.spec_for(spec)
        self.stopped = False  # close() was called: the stage takes no more requests
        self.built_once = False
        self.build_error: Exception | None = None
        group.add(self)
        self.worker.attach(self)

    @property
    def proc(self):
        return self.worker.proc

    @property
    def conn(self):
        """The worker's pipe while it hosts this stage (None once the stage closed or its worker gave it up)."""
        return self.worker.conn if self.worker.members.get(self.spec.tag) is self else None

    # Lifecycle.

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the worker built its stage; raise its error (typed) if it could not."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ready:
            if self.build_error is not None:
                raise self.build_error
            if self.conn is None:
                raise self._dead_error()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.worker.wait(left):
                raise RequestError(f"stage {self.node.id!r}: its worker did not start within {timeout}s")
            self.worker.pump()

    def close(self, timeout: float = 5.0) -> None:
        if not self.stopped:
            self.stopped = True
            self.worker.detach(self)
        self._fail_held(str(self._dead_error()), "engine_dead")  # none of them will hear from the worker again

    def _built(self, kind: str, concurrent_process: bool = False, stats=None) -> None:
        super()._built(kind, concurrent_process, stats)
        self.built_once = True

    def _build_failed(self, error: Exception) -> None:
        """The worker could not build this stage (or died while building it the first time)."""
        self.build_error = error
        self.dead = EngineDead(f"stage {self.node.id!r}: its worker could not build the stage: {error}")
        if self.built_once:
            log.error("%s", self.dead)
        self.close()  # fails the requests it held with that error

    def _not_restarted(self, how: str, exc: Exception) -> None:
        self.dead = EngineDead(f"stage {self.node.id!r}: its worker process died ({how}) and could not be "
                               f"restarted ({type(exc).__name__}: {exc})")
        log.error("%s", self.dead)

    # Receiving.

    def handles(self) -> list:
        conn = self.conn
        return [] if conn is None else [conn]

    def pump(self) -> None:
        self.worker.pump()

    def _dead_error(self, how: str = "not running") -> OmniError:
        if self.dead is not None:
            return self.dead
        if self.stopped:
            return EngineDead(f"stage {self.node.id!r}: its worker was stopped (close)")
        return RequestError(f"stage {self.node.id!r}: its worker process died while starting ({how})")

    # Calls answered between the worker's steps.

    def _call(self, rpc: str, item: StageInput):
        worker = self.worker
        if not self.ready and self.conn is not None:
            self.pump()  # its ready message may have come
            if not self.ready and self.conn is not None and not self.group.wait_for_restarts:
                raise self._restarting()
        if self.conn is None:
            raise self._dead_error()
        call_id = next(worker.calls)
        process = worker.proc  # before the send: a send that finds the worker dead restarts it, and the new one
        self._send((rpc, self.spec.tag, call_id, item))  # never got this call
        while call_id not in worker.replies:
            if self.stopped:  # closed, or its restarted worker could not build the stage
                raise self._dead_error()
            conn = self.conn
            if conn is None or worker.proc is not process:
                raise WorkerDied(f"stage {self.node.id!r}: its worker process died while processing the input")
            worker.wait(None)
            self.pump()
        return self._answer(rpc, *worker.replies.pop(call_id))

    def _dumps(self, value) -> tuple[bytes, list]:
        """`value` pickled with its arrays in shared memory, and those memory files (shared.py)."""
        fds: list = []
        return shared.dumps(value, fds), fds

    def _send(self, message) -> None:
        self.worker.send_bytes(*self._pickle(message))

    def _gone(self):
        if self.conn is None or self.dead is not None:
            return self.dead or self._dead_error()
        return None

    def _send_add(self, rpc: str, item: StageInput) -> None:
        packed = self._pickle_add(item, (rpc, self.spec.tag, item))
        if packed is not None:
            self.worker.send_bytes(*packed)

    def _send_abort(self, request_id: str) -> None:
        if self.conn is not None:
            self._send(("abort", self.spec.tag, request_id))
