"""Placement `process`: a stage in a worker process of its own (or of its share key), behind a `ProcessStage`.

Contract: a ProcessStage keeps the Stage contract (omni_kernel/core/protocols.py), so the StageScheduler knows nothing
of processes. Its worker (worker.py; worker_process.py is the front's handle on it, spawn.py starts it) builds its stage
and steps its engine; stages of one share key are hosted by one worker, each behind its own ProcessStage. `check` and
`submit` are calls answered by the worker (a user error raises in the caller); `hand_off`, `append` (a streamed input's
next chunk) and `abort` are one message each, never waited for. The front blocks on every worker's pipe at once in
`wait` (`multiprocessing.connection.wait`; a dead worker's pipe reads EOF), and its engine's step returns the events
received so far. What crosses the pipe, and how: messages.py, transport.py.

Faults: a worker that dies fails each request it held with one error naming the stage (kind runtime) and is
restarted, `max_restarts` times; after that the stage is dead and refuses requests (engine_dead). While a restarted
worker builds its stage, what is sent to it waits in its WorkerProcess (`backlog`), so a send never blocks on a
full pipe, and a call waits for the build or, where the group fails fast, raises StageUnavailable at once. A worker
that cannot build its stage makes `wait_ready` raise the build's error (typed). A worker dies with the front
(the kernel launcher's PR_SET_PDEATHSIG, omni_kernel/util/launch.py) and exits on `close()`; the front stops its
workers at exit.
"""

from __future__ import annotations

import logging
import time

from omni_kernel.core.errors import RequestError
from omni_kernel.core.request import StageInput, StreamChunk

from . import shared
from .messages import Abort, Append, Check, HandOff, Submit
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

    def _running(self) -> bool:
        return self.conn is not None

    # Lifecycle.

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the worker built its stage; raise its error (typed) if it could not."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ready:
            if self.build_error is not None:
                raise self.build_error
            if self.conn is None:
                raise self._refusal()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.worker.wait(left):
                raise RequestError(f"stage {self.node.id!r}: its worker did not start within {timeout}s")
            self.worker.pump()

    def close(self, timeout: float = 5.0) -> None:
        self.end(f"stage {self.node.id!r}: its worker was stopped (close)")
        if not self.stopped:
            self.stopped = True
            self.worker.detach(self)
        self._fail_outstanding(self.dead, "engine_dead")  # none of them will hear from the worker again

    # What its WorkerProcess tells it.

    def on_ready(self, kind: str, concurrent_inputs: bool, stats) -> None:
        super().on_ready(kind, concurrent_inputs, stats)
        self.built_once = True

    def on_build_failed(self, error: Exception) -> None:
        """The worker could not build this stage (or died while building it the first time): `wait_ready` raises
        `error`, and the stage is dead."""
        self.build_error = error
        self.end(f"stage {self.node.id!r}: its worker could not build the stage: {error}")
        if self.built_once:
            log.error("%s", self.dead)
        self.close()  # fails the requests it held with that error

    def on_worker_died(self, how: str) -> bool:
        """Its worker process died (`how`): its requests fail; True if the worker is to be restarted for it."""
        self.ready = False
        if not self.built_once:  # died while building it the first time: its wait_ready raises this
            self.on_build_failed(RequestError(f"stage {self.node.id!r}: its worker process died while starting "
                                              f"({how})"))
            return False
        return self.lost(f"worker process died ({how})", "worker")

    def on_not_restarted(self, how: str, exc: Exception) -> None:
        """Its worker died (`how`) and a new one could not be started (`exc`): the stage is dead."""
        self.end(f"stage {self.node.id!r}: its worker process died ({how}) and could not be restarted "
                 f"({type(exc).__name__}: {exc})")
        log.error("%s", self.dead)

    # Receiving.

    def handles(self) -> list:
        conn = self.conn
        return [] if conn is None else [conn]

    def pump(self) -> None:
        self.worker.pump()

    # Sending.

    def _call(self, call: type[Submit | Check], item: StageInput):
        """A Submit or Check (`call`), answered by the worker: its value, or its error raised (typed)."""
        worker = self.worker
        if not self.ready and self.conn is not None:
            self.pump()  # its Ready may have come
            if not self.ready and self.conn is not None and self.group.fail_fast:
                raise self._restarting()
        if self.conn is None:
            raise self._refusal()
        call_id = next(worker.calls)
        process = worker.proc  # before the send: a send that finds the worker dead restarts it, and the new one
        self._send(call(self.spec.tag, call_id, item))  # never got this call
        if call is Submit and worker.proc is process:  # its worker has it: a death from now on fails it
            self.outstanding.add(item.request_id)
        while call_id not in worker.replies:
            if self.stopped:  # closed, or its restarted worker could not build the stage
                raise self._refusal()
            if self.conn is None or worker.proc is not process:
                raise WorkerDied(f"stage {self.node.id!r}: its worker process died while processing the input")
            worker.wait(None)
            self.pump()
        reply = worker.replies.pop(call_id)
        return self._answer(call, reply.ok, reply.data)

    def _dumps(self, value) -> tuple[bytes, list]:
        """`value` pickled with its arrays in shared memory, and those memory files (shared.py)."""
        fds: list = []
        return shared.dumps(value, fds), fds

    def _send(self, message) -> None:
        self.worker.send_bytes(*self._pickle(message))

    def _send_hand_off(self, item: StageInput) -> None:
        self._send(HandOff(self.spec.tag, item))

    def _send_append(self, chunk: StreamChunk) -> None:
        self._send(Append(self.spec.tag, chunk))

    def _send_abort(self, request_id: str) -> None:
        if self.conn is not None:
            self._send(Abort(self.spec.tag, request_id))
