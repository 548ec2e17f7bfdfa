"""Building and driving one stage away from the front, the same in a worker process and in a Ray actor.

A worker rebuilds its stage from picklable parts (`WorkerSpec`): a plugin host (`load_host()` under the same
OMNI_PLUGINS, or the host's own `rebuild` callable), then `registry.node_types[type].item.factory(node, config)`,
so models load once, in the worker, and bound methods never cross. `StageHost` then drives it by messages. A
processed input stays in the worker: the process RPC answers with the item whose `processed` is a `Held` marker.
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
from omni_kernel.core.request import StageInput, StageStats
from omni_kernel.core.stage_scheduler import fail_stage
from omni_kernel.events import StageFailed

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
    spill_dir: str | None = None
    cores: tuple[str, int] | None = None  # with "shared": the board's file and this worker's slot
    tag: int = 0  # which of its worker's stages it is (a worker hosts every stage of one share key)
    replica: int | None = None  # which replica of its node it is (replicas.py), if it is one
    parent_pid: int = attrs.field(factory=os.getpid)


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
    return registered.item.factory(spec.node, spec.config)


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
    add_request with a held processed input, hand_off, abort, one engine step that never raises, and the stage's
    stats, sent to the front with the events whenever they changed."""

    def __init__(self, stage, node_id: str):
        self.stage = stage
        self.node_id = node_id
        self.held: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self.held_lock = threading.Lock()  # a concurrent `process` (reader thread) holds inputs beside the engine loop
        self.sent: StageStats | None = None  # the stats last sent to the front

    @property
    def concurrent_process(self) -> bool:
        """`process` may be answered beside a step (the stage says so), not only between two."""
        return self.stage.concurrent_process

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
        try:
            call(item)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            return [StageFailed.of(item.request_id, self.node_id, exc)]
        return []

    def abort(self, request_id: str) -> None:
        with self.held_lock:
            self.held.pop(request_id, None)
        self.stage.abort(request_id)

    def step(self) -> list:
        try:
            return self.stage.step()
        except Exception as exc:  # noqa: BLE001 - a broken stage fails its own requests, not the worker
            return fail_stage(self.stage, exc)

    def new_stats(self) -> StageStats | None:
        """The stage's stats if they changed since they were last sent (a dead engine's reason among them)."""
        stats = self.stage.stats()
        if stats == self.sent:
            return None
        self.sent = stats
        return stats
