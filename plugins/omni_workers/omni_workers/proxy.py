"""The front's side of a remote stage: `StageProxy`, the Stage contract shared by ProcessStage (process_stage.py)
and RayStage (ray_stage.py), and `WorkerGroup`, the remote stages of one graph (one wait, one close)."""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing.connection
import pickle
import time
import weakref
from typing import Any

import attrs

from omni_kernel.core.errors import EngineDead, PluginError, RequestError, StageUnavailable, rebuild
from omni_kernel.core.graph import NodeSpec
from omni_kernel.core.request import StageInput, StageStats
from omni_kernel.events import StageFailed, StageFinished

from .settings import WorkerStats
from .stage_host import WorkerSpec
from .transport import dumps

log = logging.getLogger("omni")


class WorkerDied(RequestError):
    """A stage's worker process exited while it held requests."""


class WorkerGroup:
    """The remote stages of one graph: one blocking wait over all their pipes, and stopping them all.

    `wait_for_restarts`: a call (process, check) to a stage whose worker is restarting waits until it has built
    its stage (a script has no other caller to stall); False: it raises StageUnavailable at once, which an AsyncOmni
    sets, since its one engine thread serves every pipeline and would stall them all for the model load."""

    def __init__(self):
        self.stages: list = []
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


class StageProxy:
    """The Stage contract shared by ProcessStage and RayStage, over `pending` (events the worker sent back, not
    yet stepped out), `held` (requests the worker holds) and `remote` (the stats its stage last sent, with its
    events). A subclass provides `wait_ready`, `pump`, `_call` (an RPC answered between the worker's steps),
    `_gone` (why the worker cannot take a request, or None), `_send_add` and `_send_abort`.

    `dead` is set when the stage takes no more requests: its worker's engine died (its stats say so), or its
    worker died and was not restarted. `concurrent_process` is what the worker's stage said when it was built."""

    what = "worker"

    def __init__(self, spec: WorkerSpec, group: WorkerGroup, max_restarts: int):
        self.node: NodeSpec = spec.node
        self.replica = spec.replica
        self.label = f"stage {spec.node.id!r}" + (f" replica {spec.replica}" if spec.replica is not None else "")
        self.where: str | None = None  # the machine its worker runs on, where the placement tells (Ray's node id)
        self.kind = spec.kind
        self.group = group
        self.max_restarts = max_restarts
        self.restarts = 0
        self.dead: EngineDead | None = None
        self.remote = StageStats()  # what the worker's stage reported last
        self.concurrent_process = False
        self.pending: list = []  # events received, returned by the next step
        self.held: set[str] = set()  # request ids the worker holds
        self.calls = itertools.count()
        self.ready = False
        self.started = 0.0  # when the worker (or actor) now running was started
        self.build_s: float | None = None  # how long the last build took: a restart's expected wait

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

    def _pickle_add(self, item: StageInput, value):
        """`value` pickled to add `item`; None where it cannot be: that request alone fails, no longer held."""
        try:
            return self._pickle(value)
        except RequestError as exc:
            self.held.discard(item.request_id)
            self.pending.append(StageFailed(item.request_id, self.node.id, str(exc), "runtime"))
            return None

    def _load_event(self, data: bytes):
        return pickle.loads(data)

    def _take_event(self, request_id: str, data: bytes) -> None:
        try:
            event = self._load_event(data)  # loaded even when dropped below: that releases its shared memory
        except Exception as exc:  # noqa: BLE001 - a class the front lacks, shared memory lost: this request only;
            # it stays held, so the abort that comes with its failure stops it in the worker too
            event = StageFailed(request_id, self.node.id, self._unreadable("output", exc), "runtime")
        if request_id not in self.held:
            return  # aborted while its event was on the way: a stale event would also keep `wait` from pumping
        if isinstance(event, (StageFinished, StageFailed)):
            self.held.discard(event.request_id)
        self.pending.append(event)

    def _answer(self, rpc: str, ok: bool, data: bytes):
        """A call's answer, as the worker pickled it: its value, or its error raised (typed)."""
        try:
            value = pickle.loads(data)
        except Exception as exc:  # noqa: BLE001 - e.g. a class only the worker has, in the processed input
            raise RequestError(self._unreadable(f"answer to {rpc!r}", exc)) from None
        if not ok:
            raise rebuild(*value)
        return value

    def _fail_held(self, message: str, error_kind: str = "runtime") -> None:
        for rid in sorted(self.held):
            self.pending.append(StageFailed(rid, self.node.id, message, error_kind))
        self.held.clear()

    def _built(self, kind: str, concurrent_process: bool = False, stats: StageStats | None = None) -> None:
        """The worker built its stage (of `kind`, with its `concurrent_process` and first stats): ready, if it is
        of the kind its node type declares."""
        if kind != self.kind:
            self.close()
            raise PluginError(f"node type {self.node.type!r} declares kind {self.kind!r} but its factory built a "
                              f"stage of kind {kind!r}")
        self.concurrent_process = bool(concurrent_process)
        self.remote = stats or StageStats()
        self.ready = True
        self.build_s = time.monotonic() - self.started

    def _take_stats(self, stats: StageStats | None) -> None:
        """The worker's stage's stats, sent after its step (None: unchanged); a dead engine makes the stage dead."""
        if stats is None:
            return
        self.remote = stats
        if stats.dead is not None and self.dead is None:
            self.dead = EngineDead(stats.dead)

    def stats(self) -> StageStats:
        """The worker's stats as its stage last sent them, with its restarts; while its worker builds its stage,
        what it was sent waits."""
        if self.dead is not None:
            return StageStats(dead=str(self.dead), placed=WorkerStats(restarts=self.restarts))
        if not self.ready:
            return StageStats(waiting=len(self.held), placed=WorkerStats(self.restarts, self.restarting))
        return attrs.evolve(self.remote, placed=WorkerStats(restarts=self.restarts, node=self.where))

    def _lost(self, died: str, who: str) -> bool:
        """The worker died (`died` says how): its requests fail; True if it is to be restarted, one of
        `max_restarts`, else the stage is dead."""
        if self.restarts < self.max_restarts:
            self.restarts += 1
            message = (f"{self.label}: its {died}; the request was lost and the {who} restarted "
                       f"({self.restarts} of {self.max_restarts} restarts)")
            log.error("%s", message)
            self._fail_held(message)
            return True
        message = f"{self.label}: its {died} and was not restarted ({self.max_restarts} restarts used)"
        log.error("%s", message)
        self.dead = EngineDead(message)
        self._fail_held(message)
        return False

    @property
    def restarting(self) -> bool:
        """Its worker is alive but still building its stage (after a restart): calls wait or fail unavailable."""
        return not self.ready and self._gone() is None

    def _restarting(self) -> StageUnavailable:
        left = None if self.build_s is None else max(1.0, self.started + self.build_s - time.monotonic())
        return StageUnavailable(f"stage unavailable: {self.label}: its {self.what} is restarting (it died) and takes "
                                "requests again once it has built its stage", left)

    @property
    def node_id(self) -> str:
        return self.node.id

    @property
    def engine(self) -> StageProxy:
        """What the StageScheduler steps: the proxy itself (its worker steps the engine there)."""
        return self

    def events_for(self, outputs: list) -> list:
        """Its step's outputs are events already (made in the worker)."""
        return outputs

    def check(self, item: StageInput) -> None:
        """Answered by the worker at once, beside the step running now (check is model-free)."""
        self._call("check", item)

    def process(self, item: StageInput) -> StageInput:
        """Runs in the worker, between two of its steps (so it waits for the step running now), or beside a step
        when the stage's `concurrent_process` allows."""
        return self._call("process", item)

    def add_request(self, item: StageInput) -> None:
        self._add("add", item)

    def hand_off(self, item: StageInput) -> None:
        """A downstream input: processed and added in the worker, so the front never waits for a step there."""
        self._add("hand_off", item)

    def _add(self, rpc: str, item: StageInput) -> None:
        error = self._gone()
        if error is not None:
            self.pending.append(StageFailed(item.request_id, self.node.id, str(error), "engine_dead"))
            return
        self.held.add(item.request_id)
        self._send_add(rpc, item)

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

    def wait(self, timeout: float | None = None) -> bool:
        """Block on the bells of every Ray stage and the pipes of every worker process of the graph at once."""
        return self.group.wait(timeout)
