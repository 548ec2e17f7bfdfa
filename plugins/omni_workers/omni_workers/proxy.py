"""The front's side of a remote stage: `StageProxy`, the Stage contract shared by ProcessStage (process_stage.py)
and RayStage (ray_stage.py), `RemoteEngine`, what the StageScheduler steps for it, and `WorkerGroup`, the remote
stages of one graph (one wait, one close)."""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import pickle
import time
import weakref
from typing import Any

import attrs

from omni_kernel.core.errors import EngineDead, PluginError, RequestError, StageUnavailable, rebuild
from omni_kernel.core.graph import NodeSpec
from omni_kernel.core.request import StageInput, StageStats, StreamChunk
from omni_kernel.events import StageFailed, StageFinished
from omni_kernel.util.files import remove_outputs

from .messages import Check, Submit
from .settings import WorkerStats
from .stage_host import WorkerSpec
from .transport import dumps

log = logging.getLogger("omni")


class WorkerDied(RequestError):
    """A stage's worker process exited while it held requests."""


class WorkerGroup:
    """The remote stages of one graph: one blocking wait over all their pipes, and stopping them all.

    `fail_fast` (the run's `RunSettings.fail_fast`): a call (submit, check) to a stage whose worker is restarting
    raises StageUnavailable at once; otherwise it waits until the worker has built its stage again (a script has
    no other caller to stall)."""

    def __init__(self, fail_fast: bool = False):
        self.stages: list = []
        self.closed = False
        self.fail_fast = fail_fast
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

    def watch(self, timeout: float) -> None:
        """With nothing to step (the graph's `watch`): look at the workers, so one that died while idle is noticed,
        and restarted, before the next request instead of at it."""
        self.wait(timeout)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for stage in self.stages:
            try:
                stage.close()
            except Exception:  # noqa: BLE001 - stop the others anyway
                log.debug("stopping the worker of %s failed", getattr(stage, "node_id", "?"), exc_info=True)
        _LIVE.discard(self)


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for group in list(_LIVE):
        group.close()


@attrs.frozen(eq=False)
class RemoteEngine:
    """A placed stage's engine as the StageScheduler steps it (the Stage contract's `engine`): the engine itself
    runs in the stage's worker, so a step here takes the events the worker sent (made there by the stage's output
    processor), and the stage's `events_for` passes them on as they are."""

    stage: Any  # a StageProxy or a ReplicaStage

    def step(self) -> list:
        return self.stage.take_events()

    def has_unfinished(self) -> bool:
        return self.stage.has_unfinished()

    def wait(self, timeout: float | None = None) -> bool:
        return self.stage.wait(timeout)


class StageProxy:
    """The Stage contract over a stage in a worker, shared by ProcessStage and RayStage.

    State: `pending` (events the worker sent, not yet stepped out), `outstanding` (the requests the worker holds
    for this stage), `remote` (the stats its stage last sent), `concurrent_inputs` (what its stage said when it was
    built). `dead` is the one answer to "does this stage take requests?": None, or why not, which is set once by
    the proxy (`ended`: closed, its build failed, its restarts are used up, it could not be restarted) or comes
    with the worker's stats (its engine died). `restarting`: its worker is alive but building its stage again; a
    call then waits for the build, or raises StageUnavailable at once where the group fails fast
    (`WorkerGroup.fail_fast`).

    A subclass provides `wait_ready`, `pump`, `close`, `handles` (what the group's wait blocks on), `_call` (a `Submit`
    or `Check` answered by its worker; a Submit's request is outstanding once sent), `_running` (its worker is there to
    take a message), `_send_hand_off`, `_send_append` and `_send_abort`. What the worker's messages tell it comes in
    through `on_ready`, `on_events` and `lost` (from the subclass's receiving side)."""

    what = "worker"

    def __init__(self, spec: WorkerSpec, group: WorkerGroup, max_restarts: int):
        self.node: NodeSpec = spec.node
        self.replica = spec.replica
        self.label = f"stage {spec.node.id!r}" + (f" replica {spec.replica}" if spec.replica is not None else "")
        self.where: str | None = None  # the machine its worker runs on, where the placement tells (Ray's node id)
        self.kind = spec.kind
        self.group = group
        self.engine = RemoteEngine(self)
        self.max_restarts = max_restarts
        self.restarts = 0
        self.ended: str | None = None  # why the stage takes no more requests, set once here
        self.remote = StageStats()  # what the worker's stage reported last
        self.concurrent_inputs = False
        self.pending: list = []  # events received, returned by the next step
        self.outstanding: set[str] = set()  # request ids the worker holds
        self.ready = False
        self.started = 0.0  # when the worker (or actor) now running was started
        self.build_s: float | None = None  # how long the last build took: a restart's expected wait

    @property
    def dead(self) -> str | None:
        """Why the stage takes no more requests, or None (see the class docstring)."""
        return self.ended or self.remote.dead

    def end(self, reason: str) -> None:
        """The stage takes no more requests, for `reason` (the first reason given stays)."""
        if self.ended is None:
            self.ended = reason

    def _dumps(self, value):
        """`value` as its worker takes it: pickled bytes (a ProcessStage's: with the shared memory it refers to)."""
        return dumps(value)

    def _pickle(self, value):
        try:
            return self._dumps(value)
        except Exception as exc:  # noqa: BLE001 - e.g. a lock in a connector's output: that request fails alone
            raise RequestError(f"stage {self.node.id!r}: its input could not be sent to its {self.what} "
                               f"({type(exc).__name__}: {exc})") from exc

    def _unreadable(self, what: str, exc: Exception) -> str:
        return (f"stage {self.node.id!r}: its {what} could not be read from its {self.what} ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())})")

    def _load_event(self, data: bytes):
        return pickle.loads(data)

    def _answer(self, call: type, ok: bool, data: bytes):
        """A call's answer, as the worker pickled it: its value, or its error raised (typed)."""
        what = call.__name__.lower()
        try:
            value = pickle.loads(data)
        except Exception as exc:  # noqa: BLE001 - e.g. a class only the worker has
            raise RequestError(self._unreadable(f"answer to {what!r}", exc)) from None
        if not ok:
            raise rebuild(*value)
        return value

    def _fail_outstanding(self, message: str, error_kind: str = "runtime") -> None:
        for rid in sorted(self.outstanding):
            self.pending.append(StageFailed(rid, self.node.id, message, error_kind))
        self.outstanding.clear()

    # What the worker tells it.

    def on_ready(self, kind: str, concurrent_inputs: bool, stats: StageStats) -> None:
        """The worker built its stage (of `kind`, with its `concurrent_inputs` and first stats): ready, if it is
        of the kind its node type declares."""
        if kind != self.kind:
            self.close()
            raise PluginError(f"node type {self.node.type!r} declares kind {self.kind!r} but its factory built a "
                              f"stage of kind {kind!r}")
        self.concurrent_inputs = bool(concurrent_inputs)
        self.remote = stats
        self.ready = True
        self.build_s = time.monotonic() - self.started

    def on_events(self, events, stats: StageStats | None) -> None:
        """A step's events (each `Sealed`: pickled on its own) and the stage's stats after it (None: unchanged)."""
        for sealed in events:
            self._take_event(sealed.request_id, sealed.data)
        if stats is not None:
            self.remote = stats

    def _take_event(self, request_id: str, data: bytes) -> None:
        try:
            event = self._load_event(data)  # loaded even when dropped below: that releases its shared memory
        except Exception as exc:  # noqa: BLE001 - a class the front lacks, shared memory lost: this request only;
            # it stays outstanding, so the abort that comes with its failure stops it in the worker too
            event = StageFailed(request_id, self.node.id, self._unreadable("output", exc), "runtime")
        if request_id not in self.outstanding:
            self._drop([event])  # aborted while its event was on the way: a stale event would also keep `wait`
            return  # from pumping
        if isinstance(event, (StageFinished, StageFailed)):
            self.outstanding.discard(event.request_id)
        self.pending.append(event)

    def lost(self, died: str, who: str) -> bool:
        """The worker died (`died` says how): its requests fail; True if it is to be restarted, one of
        `max_restarts`, else the stage is dead."""
        self.ready = False
        if self.restarts < self.max_restarts:
            self.restarts += 1
            message = (f"{self.label}: its {died}; the request was lost and the {who} restarted "
                       f"({self.restarts} of {self.max_restarts} restarts)")
            log.error("%s", message)
            self._fail_outstanding(message)
            return True
        message = f"{self.label}: its {died} and was not restarted ({self.max_restarts} restarts used)"
        log.error("%s", message)
        self.end(message)
        self._fail_outstanding(message)
        return False

    def stats(self) -> StageStats:
        """The worker's stats as its stage last sent them, with its restarts; while its worker builds its stage,
        what it was sent waits."""
        if self.dead is not None:
            return StageStats(dead=self.dead, placed=WorkerStats(restarts=self.restarts))
        if not self.ready:
            return StageStats(waiting=len(self.outstanding), placed=WorkerStats(self.restarts, self.restarting))
        return attrs.evolve(self.remote, placed=WorkerStats(restarts=self.restarts, node=self.where))

    @property
    def restarting(self) -> bool:
        """Its worker is alive but still building its stage (after a restart): calls wait or fail unavailable."""
        return not self.ready and self.dead is None and self._running()

    def _restarting(self) -> StageUnavailable:
        left = None if self.build_s is None else max(1.0, self.started + self.build_s - time.monotonic())
        return StageUnavailable(f"stage unavailable: {self.label}: its {self.what} is restarting (it died) and takes "
                                "requests again once it has built its stage", left)

    # The Stage contract.

    @property
    def node_id(self) -> str:
        return self.node.id

    def events_for(self, outputs: list) -> list:
        """Its engine's step returns events already (made in the worker)."""
        return outputs

    def check(self, item: StageInput) -> None:
        """Answered by the worker at once, beside the step running now (check is model-free)."""
        self._call(Check, item)

    def submit(self, item: StageInput) -> None:
        """Processed and added in the worker, in one message, answered once processed: between two of its steps (so
        it waits for the step running now), or beside a step where the stage's `concurrent_inputs` allows. A
        processing error raises here; a failure to add, or the worker's death once it had the input, comes back as
        the request's StageFailed."""
        try:
            self._call(Submit, item)
        except WorkerDied:
            if not any(e.request_id == item.request_id for e in self.pending):
                raise
            # the worker died once it had the input (`_call` made it outstanding then): the request was lost with
            # it, as any request it held, and its StageFailed (pending) says so
        except BaseException:
            self.outstanding.discard(item.request_id)
            raise

    def hand_off(self, item: StageInput) -> None:
        """A downstream input: processed and added in the worker, so the front never waits for a step there."""
        if self.dead is not None or not self._running():
            self.pending.append(StageFailed(item.request_id, self.node.id, str(self._refusal()), "engine_dead"))
            return
        self.outstanding.add(item.request_id)  # before the send: a send that finds the worker dead fails it
        try:
            self._send_hand_off(item)
        except RequestError as exc:  # its input could not be pickled: that request alone fails
            self.outstanding.discard(item.request_id)
            self.pending.append(StageFailed(item.request_id, self.node.id, str(exc), "runtime"))

    def append(self, chunk: StreamChunk) -> None:
        """The next chunk of a request's streamed input, opened by its hand-off: one message, sent as it comes and
        never waited for, which the worker's stage takes after that hand-off. A chunk that cannot be sent fails its
        request (the StageScheduler's abort then ends it in the worker); a request the worker no longer holds
        (failed, aborted, lost with a worker) takes nothing."""
        if chunk.request_id not in self.outstanding or not self._running():
            return
        try:
            self._send_append(chunk)
        except RequestError as exc:
            self.pending.append(StageFailed(chunk.request_id, self.node.id, str(exc), "runtime"))

    def _refusal(self) -> Exception:
        """Why a call or a hand-off cannot reach the worker now: the stage is dead, or its worker is gone."""
        return EngineDead(self.dead) if self.dead is not None else WorkerDied(f"{self.label}: its {self.what} is gone")

    def take_events(self) -> list:
        self.pump()
        events, self.pending = self.pending, []
        return events

    def _drop(self, events: list) -> None:
        """Events of requests that ended in the front while their worker went on: the files their outputs name are
        removed, as in one process, where a stage never finishes a request after its abort."""
        remove_outputs(e.output.path for e in events if isinstance(e, StageFinished))

    def abort(self, request_id: str) -> None:
        self._drop([e for e in self.pending if e.request_id == request_id])
        self.pending = [e for e in self.pending if e.request_id != request_id]
        if request_id in self.outstanding:
            self._send_abort(request_id)
        self.outstanding.discard(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.pending) or bool(self.outstanding)

    def request_ids(self) -> set[str]:
        return set(self.outstanding) | {e.request_id for e in self.pending}

    def wait(self, timeout: float | None = None) -> bool:
        """Block on the bells of every Ray stage and the pipes of every worker process of the graph at once."""
        return self.group.wait(timeout)
