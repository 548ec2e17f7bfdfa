"""Building and driving stages away from the front, the same in a worker process and in a Ray actor.

A worker rebuilds each stage from picklable parts (`WorkerSpec`): a plugin host (`load_host()` under the same
OMNI_PLUGINS, or the host's own `rebuild` callable), then the stage through that host's GraphBuilder, so models
load once, in the worker, bound methods never cross, and the stages of one share key built in one worker share
their engine there as they would in one process. `StageHost` drives one such stage (a kernel Stage) for the
worker's dispatcher; `step_hosts` steps the engines of a worker's stages by the kernel's rule
(omni_kernel/core/stepping.py).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs

from omni_kernel.core.errors import PluginError
from omni_kernel.core.graph import NodeSpec
from omni_kernel.core.planner import NodeBuild, node_policy
from omni_kernel.core.registry import share_key
from omni_kernel.core.request import StageInput, StageStats, StreamChunk
from omni_kernel.core.stepping import step_engine
from omni_kernel.events import StageFailed, StageFinished
from omni_kernel.util.files import remove_outputs

from .cores import SHARED, set_threads

log = logging.getLogger("omni")

WAIT_S = 0.005  # a stage with only background work (an MP4 export) is waited on this long, then the inbox read
KEPT = 4096  # the requests a worker remembers after their end (an abort that may still come for them)


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
    """One stage of a worker (a kernel Stage, stage.py), as the worker's dispatcher drives it: `check`, `process`
    and `add` (a submit, whose processing may run beside a step where `concurrent_inputs` says so, and whose add
    always runs between two steps), `hand_off`, `append` (a streamed input's next chunk), `abort`, and the stage's
    stats, sent to the front whenever they changed. `requests`: the requests added through this stage and not
    finished, whose outputs it owns; `open`: those of them whose input streams in and has not ended."""

    def __init__(self, stage, node_id: str):
        self.stage = stage
        self.node_id = node_id
        self.requests: set[str] = set()
        self.open: set[str] = set()
        self.written: dict[str, str] = {}  # the last KEPT requests it finished with a file: the file
        self.sent: StageStats | None = None  # the stats last sent to the front

    @property
    def concurrent_inputs(self) -> bool:
        return self.stage.concurrent_inputs

    @property
    def engine(self):
        return self.stage.engine

    def check(self, item: StageInput) -> None:
        self.stage.check(item)

    def process(self, item: StageInput) -> StageInput:
        """A submitted input processed; raises the stage's error (a UserError) for the caller."""
        return self.stage.process(item)

    def add(self, item: StageInput) -> list:
        """Add a processed input: no events, or its StageFailed where the engine refused it."""
        return self._alone(self.stage.add_request, item)

    def hand_off(self, item: StageInput) -> list:
        """A downstream input, processed and added by the stage; a processing error fails that request alone. One
        that opens a streamed input (`stream`) takes its chunks next (`append`)."""
        events = self._alone(self.stage.hand_off, item)
        if item.stream and not events:
            self.open.add(item.request_id)
        return events

    def append(self, chunk: StreamChunk) -> list:
        """The next chunk of an open request's input, to the stage (its failure comes back from the next step); a
        request no longer here (failed, aborted) takes nothing."""
        if chunk.request_id not in self.open:
            return []
        if chunk.last:
            self.open.discard(chunk.request_id)
        try:
            self.stage.append(chunk)
        except Exception as exc:  # noqa: BLE001 - e.g. a stage that takes no chunks: that request fails alone
            self.abort(chunk.request_id)
            return [StageFailed.of(chunk.request_id, self.node_id, exc)]
        return []

    def _alone(self, call, item: StageInput) -> list:
        self.requests.add(item.request_id)
        try:
            call(item)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            self.requests.discard(item.request_id)
            return [StageFailed.of(item.request_id, self.node_id, exc)]
        return []

    def abort(self, request_id: str) -> None:
        """Stop the request here; one it finished meanwhile (the front ended it before its output came) leaves no
        file, as in one process, where a stage never finishes a request after its abort."""
        self.open.discard(request_id)
        if request_id in self.requests:
            self.requests.discard(request_id)
            self.stage.abort(request_id)
        else:
            remove_outputs([self.written.pop(request_id, None)])

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def busy(self) -> bool:
        """Whether a step has work now or soon: False when the stage holds nothing, or only open requests whose
        steps so far are done (they wait for their next chunk, a message: the loop waits on its inbox, not spins)."""
        return bool(self.requests - self.open) or (bool(self.requests) and self.engine.wait(0))

    def events_for(self, outputs: list) -> list:
        """The stage's events for its requests' outputs of one engine step."""
        return self.stage.events_for(outputs)

    def settle(self, events: list) -> None:
        """A step's events: the requests they end are no longer this stage's (a failed one is aborted in the
        engine, which a failed step of the engine itself left holding it)."""
        for event in events:
            if isinstance(event, StageFailed):
                self.abort(event.request_id)
            elif isinstance(event, StageFinished):
                self.requests.discard(event.request_id)
                self.open.discard(event.request_id)
                if event.output.path is not None:
                    self.written[event.request_id] = event.output.path
                    while len(self.written) > KEPT:
                        self.written.pop(next(iter(self.written)))

    def new_stats(self) -> StageStats | None:
        """The stage's stats if they changed since they were last sent (a dead engine's reason among them)."""
        stats = self.stage.stats()
        if stats == self.sent:
            return None
        self.sent = stats
        return stats


def step_hosts(hosts: list[StageHost], timeout: float = 0.0) -> dict[StageHost, list]:
    """A worker's stepping round: each engine of `hosts` that holds their requests and would make progress (waiting
    up to `timeout` for one with only background work) steps once, by the kernel's rule (stepping.step_engine);
    each host gets the events of its own requests."""
    engines: dict[int, tuple[Any, list[StageHost]]] = {}
    for host in hosts:
        if host.has_unfinished():
            engines.setdefault(id(host.engine), (host.engine, []))[1].append(host)
    events: dict[StageHost, list] = {}
    for engine, members in engines.values():
        if not (engine.wait(0) or (timeout and engine.wait(timeout))):
            continue
        owners = {rid: host for host in members for rid in host.requests}
        running = [(rid, host) for host in members for rid in sorted(host.requests)]
        for host, event in step_engine(engine, owners.get, lambda running=running: running):
            events.setdefault(host, []).append(event)
    for host, made in events.items():
        host.settle(made)
    return events
