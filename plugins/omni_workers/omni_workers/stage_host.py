"""Building and driving one stage away from the front, the same in a worker process and in a Ray actor.

A worker rebuilds its stage from picklable parts (`WorkerSpec`): a plugin host (`load_host()` under the same
OMNI_PLUGINS, or the host's own `rebuild` callable), then the stage through that host's GraphBuilder, so models
load once, in the worker, bound methods never cross, and the stages of one share key built in one worker share
their engine there as they would in one process. `StageHost` then drives one stage by messages; `step_hosts`
steps each engine of a worker's stages once and hands each stage its own requests' outputs. A processed input
stays in the worker: the process RPC answers with the item whose `processed` is a `Held` marker.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs

from omni_kernel.core.errors import PluginError
from omni_kernel.core.graph import NodeSpec
from omni_kernel.core.planner import NodeBuild, node_policy
from omni_kernel.core.registry import share_key
from omni_kernel.core.request import StageInput, StageStats
from omni_kernel.events import StageFailed, StageFinished

from .cores import SHARED, set_threads

log = logging.getLogger("omni")

WAIT_S = 0.005  # a stage with only background work (an MP4 export) is waited on this long, then the inbox read
HELD_LIMIT = 4096  # processed inputs a worker keeps for add_request (a submit that failed later never adds)


# What the worker needs to rebuild its stage.


@attrs.frozen
class WorkerSpec:
    node: NodeSpec
    kind: str
    config: Any
    host_factory: Callable[[], Any]
    threads: int | str | None = None  # an int, "shared" (cores.py) or None (the library's default)
    cores: tuple[str, int] | None = None  # with "shared": the board's file and this worker's slot
    tag: int = 0  # which of its worker's stages it is (a worker hosts every stage of one share key)
    replica: int | None = None  # which replica of its node it is (replicas.py), if it is one


def default_host_factory() -> Callable[[], Any]:
    """Rebuilds the front's plugins in a worker: `load_host()` under the OMNI_PLUGINS the front had."""
    from omni_kernel.plugins import ALLOWLIST_ENV, load_host

    return partial(load_host, os.environ.get(ALLOWLIST_ENV))


@attrs.frozen
class Held:
    """Marks a processed input that stays in the worker; add_request picks it up there by request id."""

    request_id: str


def load_plugins(spec: WorkerSpec):
    """Rebuild the plugin host quietly (the front already reported its plugins' warnings)."""
    logger = logging.getLogger("omni")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return spec.host_factory()
    finally:
        logger.setLevel(level)


def build_stage(spec: WorkerSpec, host=None):
    """The node's stage from its type's factory, in `host` (a worker hosting several stages builds them all in
    one host, so the plugin shares their engine), else in a host rebuilt for it."""
    host = host or load_plugins(spec)
    registered = host.registry.node_types.get(spec.node.type)
    if registered is None:
        raise PluginError(f"node type {spec.node.type!r} is not registered in the worker of stage {spec.node.id!r} "
                          f"(check OMNI_PLUGINS, or give the host a picklable `rebuild`)")
    node_type = registered.item
    policy = node_policy(spec.node, node_type)
    key = share_key(node_type, spec.node, spec.config, policy)
    return host.builder.stage(NodeBuild(spec.node, node_type, spec.config, policy, key))


def setup_worker(spec: WorkerSpec) -> None:
    """Threads, logging ("omni[NODE]: ...") and Ctrl-C (the front stops its workers) of a worker process."""
    logger = logging.getLogger("omni")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"omni[{spec.node.id}]: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def set_torch_threads(threads: int | str | None) -> None:
    if threads != SHARED:  # shared: set before each step
        set_threads(threads)


class StageHost:
    """A stage driven by messages, the same in a worker process and in a Ray actor: the RPCs (process, check),
    add_request with a held processed input, hand_off, abort, the events of its own requests from its engine's
    steps (`step_hosts`), and the stage's stats, sent to the front with the events whenever they changed."""

    def __init__(self, stage, node_id: str):
        self.stage = stage
        self.node_id = node_id
        self.held: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self.held_lock = threading.Lock()  # a concurrent `process` (reader thread) holds inputs beside the engine loop
        self.requests: set[str] = set()  # the requests added to its engine through this stage, not finished
        self.sent: StageStats | None = None  # the stats last sent to the front

    @property
    def concurrent_process(self) -> bool:
        """`process` may be answered beside a step (the stage says so), not only between two."""
        return self.stage.concurrent_process

    @property
    def engine(self):
        return self.stage.engine

    def process(self, item: StageInput) -> StageInput:
        out = self.stage.process(item)
        with self.held_lock:
            self.held[item.request_id] = out.processed
            self.held.move_to_end(item.request_id)
            while len(self.held) > HELD_LIMIT:
                self.held.popitem(last=False)
        return attrs.evolve(out, processed=Held(item.request_id))

    def check(self, item: StageInput) -> None:
        self.stage.check(item)

    def add(self, item: StageInput) -> list:
        """Events at once only when the input is lost or refused; otherwise the stage reports through its steps."""
        if isinstance(item.processed, Held):
            with self.held_lock:
                processed = self.held.pop(item.request_id, None)
            if processed is None:
                return [StageFailed(item.request_id, self.node_id, f"stage {self.node_id!r} lost the processed input "
                                                                   "of this request", "runtime")]
            item = attrs.evolve(item, processed=processed)
        return self._alone(self.stage.add_request, item)

    def hand_off(self, item: StageInput) -> list:
        """A downstream input, processed and added by the stage; a processing error fails that request alone."""
        return self._alone(self.stage.hand_off, item)

    def _alone(self, call, item: StageInput) -> list:
        self.requests.add(item.request_id)
        try:
            call(item)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            self.requests.discard(item.request_id)
            return [StageFailed.of(item.request_id, self.node_id, exc)]
        return []

    def abort(self, request_id: str) -> None:
        with self.held_lock:
            self.held.pop(request_id, None)
        if request_id in self.requests:
            self.requests.discard(request_id)
            self.stage.abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def request_ids(self) -> set[str]:
        return set(self.requests)

    def events_for(self, outputs: list) -> list:
        """The stage's events for its requests' outputs of one engine step; a stage that cannot make them fails
        those requests, not the worker."""
        try:
            events = self.stage.events_for(outputs)
        except Exception as exc:  # noqa: BLE001 - a broken output processor fails its own requests
            log.error("stage %s failed: %s: %s", self.node_id, type(exc).__name__, exc, exc_info=exc)
            events = [StageFailed.of(rid, self.node_id, exc) for rid in dict.fromkeys(o.request_id for o in outputs)]
        for event in events:
            if isinstance(event, (StageFinished, StageFailed)):
                self.requests.discard(event.request_id)
        return events

    def fail_all(self, exc: Exception) -> list:
        """Its engine's step raised: every request of this stage fails (and is dropped)."""
        log.error("stage %s failed: %s: %s", self.node_id, type(exc).__name__, exc, exc_info=exc)
        failed = sorted(self.requests)
        for rid in failed:
            self.abort(rid)
        return [StageFailed.of(rid, self.node_id, exc) for rid in failed]

    def new_stats(self) -> StageStats | None:
        """The stage's stats if they changed since they were last sent (a dead engine's reason among them)."""
        stats = self.stage.stats()
        if stats == self.sent:
            return None
        self.sent = stats
        return stats


def step_hosts(hosts: list[StageHost], timeout: float = 0.0) -> dict[StageHost, list]:
    """Step each engine of the hosts that holds their requests and would make progress (waiting up to `timeout`
    for one with only background work) once; each host's events from its own requests' outputs."""
    engines: dict[int, tuple[Any, list[StageHost]]] = {}
    for host in hosts:
        if host.has_unfinished():
            engines.setdefault(id(host.engine), (host.engine, []))[1].append(host)
    events: dict[StageHost, list] = {}
    for engine, members in engines.values():
        if engine.wait(0) or (timeout and engine.wait(timeout)):
            events.update(_step_engine(engine, members))
    return events


def _step_engine(engine, members: list[StageHost]) -> dict[StageHost, list]:
    try:
        outputs = engine.step()
    except Exception as exc:  # noqa: BLE001 - a broken engine fails its stages' requests, not the worker
        return {host: host.fail_all(exc) for host in members}
    owners = {rid: host for host in members for rid in host.requests}
    mine: dict[StageHost, list] = {}
    for out in outputs:
        host = owners.get(out.request_id)
        if host is not None:  # else aborted since
            mine.setdefault(host, []).append(out)
    return {host: host.events_for(outs) for host, outs in mine.items()}
