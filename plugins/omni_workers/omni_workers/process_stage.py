"""Stage placement: a stage in its own OS process (`process`) behind a proxy with the Stage contract.

The StageScheduler sees a `ProcessStage` like any Stage and knows nothing of processes. The worker process
(spawn.py starts it, worker.py is its loop) rebuilds its stage and runs its engine loop continuously. The front
blocks on every worker's pipe at once (`multiprocessing.connection.wait`; a dead worker's pipe reads EOF) in
`Stage.wait`; `step()` returns the events received so far. `process`/`check` are calls, so a user error stays
synchronous at submit. What crosses the pipe, and how: transport.py.

Faults: a worker that dies fails its in-flight requests with one error naming the stage (kind runtime) and is
restarted, `max_restarts` times (default 1); after that its stage refuses requests (engine_dead). While a restarted
worker builds its stage, what the front sends it waits in the proxy (`backlog`), so a send never blocks on a full
pipe, and a call (process, check) either waits for the build or, with `WorkerGroup.wait_for_restarts` False (an
AsyncOmni engine thread, which serves every caller), raises StageUnavailable at once. A worker exits
when its parent dies (PR_SET_PDEATHSIG on Linux, plus polling getppid) and on `close()`; the front stops its
workers at exit.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import time
from multiprocessing.reduction import ForkingPickler

import attrs

from omni_kernel.errors import EngineDead, OmniError, RequestError, rebuild
from omni_kernel.request import StageInput

from .cores import SHARED, board
from .proxy import StageProxy, WorkerDied, WorkerGroup
from .spawn import start_worker
from .stage_host import WorkerSpec
from .transport import unspill

log = logging.getLogger("omni")


class ProcessStage(StageProxy):
    """The Stage contract over a worker process (see the module docstring)."""

    def __init__(self, spec: WorkerSpec, group: WorkerGroup, max_restarts: int = 1):
        super().__init__(spec, group, max_restarts)
        self.spec = attrs.evolve(spec, spill_dir=group.spill_dir)
        self.slot = None
        if spec.threads == SHARED:
            self.slot = board().take()
            self.spec = attrs.evolve(self.spec, cores=(board().path, self.slot))
        self.replies: dict[int, tuple] = {}
        self.backlog: list[bytes] = []  # messages for a worker still building its stage, sent once it is ready
        self.stopped = False  # close() was called: the stage takes no more requests
        self.proc = None
        self.conn = None
        group.add(self)
        self._start()

    # Lifecycle.

    def _start(self) -> None:
        self.proc, self.conn = start_worker(self.spec)
        self.conn.send(list(sys.path))  # so the worker imports what the front imports (plugins, test modules)
        self.conn.send(attrs.evolve(self.spec, parent_pid=os.getpid()))
        self.ready = False
        self.backlog = []
        self.started = time.monotonic()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the worker built its stage; raise its error (typed) if it could not."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ready:
            if self.conn is None:
                raise self._dead_error()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait([self.conn], left)
            if not ready:
                raise RequestError(f"stage {self.node.id!r}: its worker did not start within {timeout}s")
            self.pump(starting=True)

    def close(self, timeout: float = 5.0) -> None:
        conn, process = self.conn, self.proc
        self.stopped = True
        self.conn = None
        if conn is not None:
            try:
                conn.send(("stop",))
            except (OSError, ValueError):
                pass
        if process is not None:
            for stop in (None, process.terminate, process.kill):
                if stop is not None:
                    stop()
                try:
                    process.wait(timeout if stop is None else 2)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if conn is not None:
            conn.close()
        if self.slot is not None:
            board().give_back(self.slot)
            self.slot = None
        self._fail_held(str(self._dead_error()), "engine_dead")  # none of them will hear from the worker again

    # Receiving.

    def handles(self) -> list:
        return [] if self.conn is None else [self.conn]

    def pump(self, starting: bool = False) -> None:
        """Take every message the worker sent so far; notice a worker that died (its end of the pipe closed)."""
        conn = self.conn
        try:
            while self.conn is conn and conn is not None and conn.poll(0):
                data = conn.recv_bytes()
                try:
                    message = ForkingPickler.loads(data)
                except Exception as exc:  # noqa: BLE001 - not expected (worker.pack sends plain data): whose it
                    # was is unknown, so the worker is stopped and restarted as if it died, failing what it held
                    self.proc.kill()
                    self._died(starting, f"stopped: the front could not read its message, {type(exc).__name__}: "
                                         f"{' '.join(str(exc).split())}")
                    return
                self._receive(message, starting)
        except (EOFError, OSError):
            if self.conn is conn and conn is not None:
                self._died(starting)

    def _receive(self, message, starting: bool) -> None:
        rpc = message[0]
        if rpc == "events":  # the events of a step (or of an add that failed) and the stage's stats after it
            _, events, stats = message
            for request_id, data in events:
                self._take_event(request_id, data)
            self._take_stats(stats)
        elif rpc == "reply":
            self.replies[message[1]] = message[2:]
        elif rpc == "ready":
            self._built(*message[1:])
            conn, backlog, self.backlog = self.conn, self.backlog, []
            for data in backlog:
                if self.conn is not conn:  # it died meanwhile: _died failed what these were for
                    break
                self._send_bytes(data)
        elif rpc == "failed":
            error = rebuild(*message[1:])
            self.dead = EngineDead(f"stage {self.node.id!r}: its worker could not build the stage: {error}")
            self.close()  # fails the requests it held with that error
            if starting:
                raise error
            log.error("%s", self.dead)

    def _died(self, starting: bool, how: str | None = None) -> None:
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:  # it closed its pipe but lives on: stop it
            self.proc.kill()
            code = self.proc.wait()
        how = how or (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 and -code in
                      signal.Signals._value2member_map_ else f"exit code {code}")
        self.conn.close()
        self.conn = None
        if self.slot is not None:
            board().clear(self.slot)
        if starting:
            raise self._dead_error(how)
        if self._lost(f"worker process died ({how})", "worker"):
            try:
                self._start()
            except Exception as exc:  # noqa: BLE001 - e.g. no file descriptors or memory left to start one
                if self.proc is not None and self.proc.poll() is None:
                    self.proc.kill()  # started, but died before it took its spec
                self.conn = None
                self.dead = EngineDead(f"stage {self.node.id!r}: its worker process died ({how}) and could "
                                       f"not be restarted ({type(exc).__name__}: {exc})")
                log.error("%s", self.dead)

    def _dead_error(self, how: str = "not running") -> OmniError:
        if self.dead is not None:
            return self.dead
        if self.stopped:
            return EngineDead(f"stage {self.node.id!r}: its worker was stopped (close)")
        return RequestError(f"stage {self.node.id!r}: its worker process died while starting ({how})")

    def _load_event(self, data: bytes):
        return unspill(super()._load_event(data))

    # Calls answered between the worker's steps.

    def _call(self, rpc: str, item: StageInput):
        if not self.ready and self.conn is not None:
            self.pump()  # its ready message may have come
            if not self.ready and self.conn is not None and not self.group.wait_for_restarts:
                raise self._restarting()
        if self.conn is None:
            raise self._dead_error()
        call_id = next(self.calls)
        process = self.proc  # before the send: a send that finds the worker dead restarts it, and the new one
        self._send((rpc, call_id, item))  # never got this call
        while call_id not in self.replies:
            if self.stopped:  # closed, or its restarted worker could not build the stage
                raise self._dead_error()
            conn = self.conn
            if conn is None or self.proc is not process:
                raise WorkerDied(f"stage {self.node.id!r}: its worker process died while processing the input")
            try:
                multiprocessing.connection.wait([conn])
            except (OSError, ValueError):  # closed meanwhile (close() from another thread): looked at above
                pass
            self.pump()
        return self._answer(rpc, *self.replies.pop(call_id))

    def _send(self, message) -> None:
        self._send_bytes(self._pickle(message))

    def _send_bytes(self, data: bytes) -> None:
        if not self.ready:  # still building (a restart): a send must not block on a pipe no one reads yet
            self.backlog.append(data)
            return
        try:
            self.conn.send_bytes(data)
        except (OSError, ValueError):
            self.pump()

    def _gone(self):
        if self.conn is None or self.dead is not None:
            return self.dead or self._dead_error()
        return None

    def _send_add(self, rpc: str, item: StageInput) -> None:
        data = self._pickle_add(item, (rpc, item))
        if data is not None:
            self._send_bytes(data)

    def _send_abort(self, request_id: str) -> None:
        if self.conn is not None:
            self._send(("abort", request_id))
