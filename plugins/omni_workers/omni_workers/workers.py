"""Stage placement: a stage in its own OS process (`process`) behind a proxy with the Stage contract.

The StageScheduler sees a `ProcessStage` like any Stage and knows nothing of processes. The worker process
(a fresh interpreter, `python -c`, so the caller's __main__ is never imported again as multiprocessing's spawn
would) rebuilds its stage from picklable parts: a plugin host (`load_host()` under the same
OMNI_PLUGINS, or the host's own `rebuild` callable), then `registry.node_types[type].item.factory(node, config)`,
so models load once, in the worker, and bound methods never cross. The worker runs its engine loop
continuously: it drains its inbox (add_request / hand_off / abort / the process RPC), steps its stage while it
has work and sends the events back (from a sender thread); when idle it blocks on its inbox. The front blocks on every
worker's pipe at once (`multiprocessing.connection.wait`; a dead worker's pipe reads EOF) in `Stage.wait`;
`step()` returns the events received so far.

Input processing: `process`/`check` are calls, so a user error stays synchronous at submit. The worker's
reader thread answers `check` at once (model-free by the Stage contract), so a submit never waits for a long
denoise step of a downstream stage; `process` is answered by the engine loop between two of its steps (it
waits for the step running now: one decode step for an AR entry stage). A downstream input is handed off in
one message (`hand_off`: process then add, in the worker), so the front never waits at a hand-off.

What crosses: requests, events and stage outputs, as plain data pickled over a local Pipe between the runtime's
own processes (never anything read from a network socket). The worker pickles each event, and a call's answer, on
its own inside its message (transport.pack), so one the front cannot unpickle fails its own request or call. A processed input stays in the worker: the process
RPC answers with the item whose `processed` is a `Held` marker. Arrays in `StageOutput.data` (frames) are
written to a `.npy` file in the run's temporary directory and loaded (then deleted) by the front.

Faults: a worker that dies fails its in-flight requests with one error naming the stage (kind runtime) and is
restarted, `max_restarts` times (default 1); after that its stage refuses requests (engine_dead). While a restarted
worker builds its stage, what the front sends it waits in the proxy (`backlog`), so a send never blocks on a full
pipe, and a call (process, check) either waits for the build or, with `WorkerGroup.wait_for_restarts` False (an
AsyncOmni engine thread, which serves every caller), raises StageUnavailable at once. A worker exits
when its parent dies (PR_SET_PDEATHSIG on Linux, plus polling getppid) and on `close()`; the front stops its
workers at exit. Torch-free: numpy and torch are touched only if a stage's output holds their arrays.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any

import attrs

from omni_kernel.errors import EngineDead, OmniError, PluginError, RequestError, StageUnavailable, rebuild
from omni_kernel.events import StageFailed, StageFinished
from omni_kernel.graph import NodeSpec
from omni_kernel.placement import RunSettings, check_placement_nodes, parse_placement  # noqa: F401 - re-exported
from omni_kernel.request import StageInput

from .cores import SHARED, board, host_cores
from .stage_host import WorkerSpec
from .tempdirs import make_dir
from .transport import dumps, unspill
from .worker import THREAD_VARS

log = logging.getLogger("omni")


class WorkerDied(RequestError):
    """A stage's worker process exited while it held requests."""


@attrs.define
class RemoteEngine:
    """What the front knows of a worker's engine: whether it is dead (omni serve reports it)."""

    dead: EngineDead | None = None
    scheduler: Any = None


class WorkerGroup:
    """The remote stages of one graph: one blocking wait over all their pipes, a temporary
    directory for spilled arrays, and stopping them all.

    `wait_for_restarts`: a call (process, check) to a stage whose worker is restarting waits until it has built
    its stage (a script has no other caller to stall); False: it raises StageUnavailable at once, which an AsyncOmni
    sets, since its one engine thread serves every pipeline and would stall them all for the model load."""

    def __init__(self):
        self.stages: list = []
        self.spill_dir = make_dir("run")
        self.closed = False
        self.wait_for_restarts = True
        _LIVE.add(self)

    def add(self, stage) -> None:
        self.stages.append(stage)

    def wait(self, timeout: float | None) -> bool:
        """Block until some stage of the group has events (or a worker died); True if any has them now."""
        if any(s.pending for s in self.stages):
            return True
        handles: dict[Any, Any] = {}
        for stage in self.stages:
            for handle in stage.handles():
                handles[handle] = stage
        if not handles:
            return False
        try:
            ready = multiprocessing.connection.wait(list(handles), timeout)
        except (OSError, ValueError):
            ready = list(handles)
        for handle in ready:
            handles[handle].pump()
        return any(s.pending for s in self.stages)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for stage in self.stages:
            try:
                stage.close()
            except Exception:  # noqa: BLE001 - stop the others anyway
                log.debug("stopping the worker of %s failed", getattr(stage, "node_id", "?"), exc_info=True)
        shutil.rmtree(self.spill_dir, ignore_errors=True)
        _LIVE.discard(self)


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for group in list(_LIVE):
        group.close()


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


class StageProxy:
    """The Stage contract shared by ProcessStage and RayStage, over `pending` (events the worker sent back, not
    yet stepped out) and `held` (requests the worker holds). A subclass provides `pump`, `_call` (an RPC answered
    between the worker's steps), `_gone` (why the worker cannot take a request, or None), `_send_add` and
    `_send_abort`."""

    node: NodeSpec
    pending: list
    held: set[str]
    started: float  # when the worker (or actor) now running was started
    build_s: float | None  # how long the last build took: a restart's expected wait
    what = "worker"

    def _pickle(self, value) -> bytes:
        try:
            return dumps(value)
        except Exception as exc:  # noqa: BLE001 - e.g. a lock in a connector's output: that request fails alone
            raise RequestError(f"stage {self.node.id!r}: its input could not be sent to its {self.what} "
                               f"({type(exc).__name__}: {exc})") from exc

    def _unreadable(self, what: str, exc: Exception) -> str:
        return (f"stage {self.node.id!r}: its {what} could not be read from its {self.what} ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())})")

    def _restarting(self) -> StageUnavailable:
        left = None if self.build_s is None else max(1.0, self.started + self.build_s - time.monotonic())
        return StageUnavailable(f"stage {self.node.id!r}: its {self.what} is restarting (it died) and takes requests "
                                "again once it has built its stage", left)

    @property
    def node_id(self) -> str:
        return self.node.id

    def check(self, item: StageInput) -> None:
        """Answered by the worker at once, beside the step running now (check is model-free)."""
        self._call("check", item)

    def process(self, item: StageInput) -> StageInput:
        """Runs in the worker, between two of its steps (so it waits for the step running now)."""
        return self._call("process", item)

    def add_request(self, item: StageInput) -> None:
        self._add("add", item)

    def hand_off(self, item: StageInput) -> None:
        """A downstream input: processed and added in the worker, so the front never waits for a step there."""
        self._add("hand_off", item)

    def _add(self, kind: str, item: StageInput) -> None:
        error = self._gone()
        if error is not None:
            self.pending.append(StageFailed(item.request_id, self.node.id, str(error), "engine_dead"))
            return
        self.held.add(item.request_id)
        self._send_add(kind, item)

    def step(self) -> list:
        self.pump()
        events, self.pending = self.pending, []
        return events

    def abort(self, request_id: str) -> None:
        self.pending = [e for e in self.pending if e.request_id != request_id]
        if request_id in self.held:
            self._send_abort(request_id)
        self.held.discard(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.pending) or bool(self.held)

    def request_ids(self) -> set[str]:
        return set(self.held) | {e.request_id for e in self.pending}


class ProcessStage(StageProxy):
    """The Stage contract over a worker process (see the module docstring)."""

    def __init__(self, spec: WorkerSpec, group: WorkerGroup, max_restarts: int = 1):
        self.node = spec.node
        self.kind = spec.kind
        self.spec = attrs.evolve(spec, spill_dir=group.spill_dir)
        self.slot = None
        if spec.threads == SHARED:
            self.slot = board().take()
            self.spec = attrs.evolve(self.spec, cores=(board().path, self.slot))
        self.group = group
        self.max_restarts = max_restarts
        self.restarts = 0
        self.engine = RemoteEngine()
        self.pending: list = []  # events received, returned by the next step
        self.held: set[str] = set()  # request ids the worker holds
        self.replies: dict[int, tuple] = {}
        self.calls = itertools.count()
        self.ready = False
        self.backlog: list[bytes] = []  # messages for a worker still building its stage, sent once it is ready
        self.started = 0.0
        self.build_s: float | None = None  # how long the last build took: a restart's expected wait
        self.stopped = False  # close() was called: the stage takes no more requests
        self.proc = None
        self.conn = None
        group.add(self)
        self._start()

    # Lifecycle.

    def _start(self) -> None:
        """A fresh interpreter (not multiprocessing's spawn, which would import the caller's __main__ again)
        talking over a socketpair as a multiprocessing Connection; its end reads EOF when the worker dies."""
        front, back = socket.socketpair()
        env = dict(os.environ)
        if self.spec.threads:  # shared: the libraries' pools sized for every core, used as the board says
            for var in THREAD_VARS:
                env[var] = str(host_cores() if self.spec.threads == SHARED else self.spec.threads)
        if self.spec.threads == SHARED:  # see cores.py: a step that finds the cores taken must not spin
            env.setdefault("GOMP_SPINCOUNT", "10000")
        code = f"from omni_workers.worker import child_main; child_main({back.fileno()})"
        try:
            self.proc = launch([sys.executable, "-c", code], pass_fds=(back.fileno(),), env=env,
                               stdin=subprocess.DEVNULL, stdout=2, close_fds=True)
        except BaseException:
            front.close()
            raise
        finally:
            back.close()
        self.conn = multiprocessing.connection.Connection(front.detach())
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
                except Exception as exc:  # noqa: BLE001 - not expected (transport.pack sends plain data): whose it
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
        kind = message[0]
        if kind == "events":
            for request_id, data in message[1]:
                try:
                    event = unspill(ForkingPickler.loads(data))
                except Exception as exc:  # noqa: BLE001 - a class the front lacks, a spill file gone: this request
                    # only; it stays held, so the abort that comes with its failure stops it in the worker too
                    self.pending.append(StageFailed(request_id, self.node.id, self._unreadable("output", exc),
                                                    "runtime"))
                    continue
                if isinstance(event, (StageFinished, StageFailed)):
                    self.held.discard(event.request_id)
                self.pending.append(event)
        elif kind == "reply":
            self.replies[message[1]] = message[2:]
        elif kind == "ready":
            if message[1] != self.kind:
                self.close()
                raise PluginError(f"node type {self.node.type!r} declares kind {self.kind!r} but its factory built "
                                  f"a stage of kind {message[1]!r}")
            self.ready = True
            self.build_s = time.monotonic() - self.started
            conn, backlog, self.backlog = self.conn, self.backlog, []
            for data in backlog:
                if self.conn is not conn:  # it died meanwhile: _died failed what these were for
                    break
                self._send_bytes(data)
        elif kind == "failed":
            error = rebuild(*message[1:])
            self.engine.dead = EngineDead(f"stage {self.node.id!r}: its worker could not build the stage: {error}")
            self.close()  # fails the requests it held with that error
            if starting:
                raise error
            log.error("%s", self.engine.dead)
        elif kind == "dead":
            self.engine.dead = EngineDead(message[1])

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
        if self.restarts < self.max_restarts:
            self.restarts += 1
            message = (f"stage {self.node.id!r}: its worker process died ({how}); the request was lost and the "
                       f"worker restarted ({self.restarts} of {self.max_restarts} restarts)")
            log.error("%s", message)
            self._fail_held(message, "runtime")
            try:
                self._start()
            except Exception as exc:  # noqa: BLE001 - e.g. no file descriptors or memory left to start one
                if self.proc is not None and self.proc.poll() is None:
                    self.proc.kill()  # started, but died before it took its spec
                self.conn = None
                self.engine.dead = EngineDead(f"stage {self.node.id!r}: its worker process died ({how}) and could "
                                              f"not be restarted ({type(exc).__name__}: {exc})")
                log.error("%s", self.engine.dead)
        else:
            message = (f"stage {self.node.id!r}: its worker process died ({how}) and was not restarted "
                       f"({self.max_restarts} restarts used)")
            log.error("%s", message)
            self.engine.dead = EngineDead(message)
            self._fail_held(message, "runtime")

    def _dead_error(self, how: str = "not running") -> OmniError:
        if self.engine.dead is not None:
            return self.engine.dead
        if self.stopped:
            return EngineDead(f"stage {self.node.id!r}: its worker was stopped (close)")
        return RequestError(f"stage {self.node.id!r}: its worker process died while starting ({how})")

    def _fail_held(self, message: str, kind: str) -> None:
        for rid in sorted(self.held):
            self.pending.append(StageFailed(rid, self.node.id, message, kind))
        self.held.clear()

    # Calls answered between the worker's steps.

    def _call(self, kind: str, item: StageInput):
        if not self.ready and self.conn is not None:
            self.pump()  # its ready message may have come
            if not self.ready and self.conn is not None and not self.group.wait_for_restarts:
                raise self._restarting()
        if self.conn is None:
            raise self._dead_error()
        call_id = next(self.calls)
        process = self.proc  # before the send: a send that finds the worker dead restarts it, and the new one
        self._send((kind, call_id, item))  # never got this call
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
        ok, data = self.replies.pop(call_id)
        try:
            value = ForkingPickler.loads(data)
        except Exception as exc:  # noqa: BLE001 - e.g. a class only the worker has, in the processed input
            raise RequestError(self._unreadable(f"answer to {kind!r}", exc)) from None
        if not ok:
            raise rebuild(*value)
        return value

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
        if self.conn is None or self.engine.dead is not None:
            return self.engine.dead or self._dead_error()
        return None

    def _send_add(self, kind: str, item: StageInput) -> None:
        try:
            data = self._pickle((kind, item))
        except RequestError as exc:
            self.held.discard(item.request_id)
            self.pending.append(StageFailed(item.request_id, self.node.id, str(exc), "runtime"))
            return
        self._send_bytes(data)

    def _send_abort(self, request_id: str) -> None:
        if self.conn is not None:
            self._send(("abort", request_id))

    def wait(self, timeout: float | None = None) -> bool:
        return self.group.wait(timeout)
