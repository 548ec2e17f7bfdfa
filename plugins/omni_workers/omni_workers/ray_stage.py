"""Placement `ray`: a stage in a Ray actor, placed with a placement group (the `omni-workers[ray]` extra).

The same contract as `process_stage.ProcessStage`: the front's proxy sends the messages of messages.py to the
actor's `handle` (`Submit` and `Check` calls, `HandOff`, `Append`, `Abort`); the actor (ray_actor.py) runs its
stage's engine loop on a thread of its own, continuously, and streams its `Events` (`events`, a Ray streaming
generator read by a thread of the front). Outputs come back as stream items through Ray's object store (arrays
included); the front relays them to the next stage (a Ray stream cannot be handed to another actor), a streaming
edge's chunks as they are cut. Each actor has a bundle of its node's Ray resources (`ray_resources`, else
`NodeSpec.resources`, else {"CPU": 1}) in a placement group of its stage's (ray_groups.py: PACK for a stage alone,
SPREAD over a stage's replicas). An actor that dies fails its requests with one error naming the stage, the replica
and, when its node died, the node; it is restarted `max_restarts` times in its own bundle, which Ray places again
where the cluster has room (at once, or when a node joins; RESTART_WAIT_S at most). The front does not wait for the
new actor's build (a thread of its own does and rings the bell), and a call meanwhile waits or raises
StageUnavailable as `WorkerGroup.fail_fast` says, as with worker processes. Inputs, events and a call's answer
cross as bytes pickled by omni on each side (`Sealed`, transport.pack_event, pack_answer), so one that cannot be
pickled or unpickled fails its own request or call, never the actor's stream (which the front would take for its
death).

Ray is imported only when a node is placed on it; the kernel stays importable without it.
"""

from __future__ import annotations

import logging
import pickle
import queue
import socket
import sys
import threading
import time
import uuid

import attrs

from omni_kernel.core.errors import RequestError, rebuild
from omni_kernel.core.request import StageInput, StreamChunk

from .cores import SHARED
from .messages import Abort, Append, Check, Events, Failed, HandOff, Sealed, Submit
from .proxy import StageProxy, WorkerDied
from .ray_actor import actor_class, ensure_ray
from .ray_groups import GONE_TIMEOUT_S, PLACE_TIMEOUT_S, Reservation, kill_all, node_alive, ray_options
from .settings import WorkersSettings
from .stage_host import WorkerSpec

log = logging.getLogger("omni")
START_TIMEOUT_S = 600.0  # an actor placed builds its stage (loads its model) within this
RESTART_WAIT_S = 600.0  # a lost actor waits this long for room (a node that joins) and its build, then its stage
# (or replica) is dead
CALL_TIMEOUT_S = 300.0  # a submit / check call is answered within this (it waits for the step running now)
STARTED = ("started",)  # the mailbox's word that a restarted actor's build is over (ready, failed or timed out)


def ray_stages(spec: WorkerSpec, count: int, group, settings: WorkersSettings) -> list[RayStage]:
    """The node's stage as `count` actors (its replicas when more than one) in one placement group of a bundle
    each, the node's Ray resources (`WorkersSettings.resources_of`): strategy SPREAD for replicas (distinct
    nodes where the cluster has them), PACK for one."""
    ray = ensure_ray(settings.ray_address)
    resources = settings.resources_of(spec.node)
    spec = attrs.evolve(spec, node=attrs.evolve(spec.node, resources=resources))
    strategy = "SPREAD" if count > 1 else "PACK"
    reservation = Reservation(ray, resources, count, strategy, f"omni-{spec.node.id}-{uuid.uuid4().hex[:8]}")
    if count == 1:
        return [RayStage(spec, group, settings, reservation)]
    return [RayStage(attrs.evolve(spec, replica=i), group, settings, reservation, i) for i in range(count)]


class RayStage(StageProxy):
    """The Stage contract over a Ray actor (see the module docstring)."""

    what = "Ray actor"

    def __init__(self, spec: WorkerSpec, group, settings: WorkersSettings, reservation: Reservation, index: int = 0):
        self.ray = ensure_ray(settings.ray_address)
        super().__init__(spec, group, settings.max_restarts)
        self.spec = spec
        self.actor = None
        self.where: str | None = None  # the Ray node id of the actor now serving
        # The actor's event stream is read on a thread of the front per stage (blocking in Ray, never spinning);
        # what it brings back waits in `mailbox`, and a byte on `bell` wakes the front's one wait over every pipe.
        self.mailbox: queue.SimpleQueue = queue.SimpleQueue()
        self.bell, self.ringer = socket.socketpair()
        self.bell.setblocking(False)
        self.threads: list[threading.Thread] = []  # the pollers and restart waits (_spawn)
        self.resources = dict(spec.node.resources or {"CPU": 1})
        if spec.threads == SHARED:  # not shared across actors: the fixed split of the bundle's CPUs
            self.spec = attrs.evolve(self.spec, threads=max(1, int(self.resources.get("CPU", 1))))
        self.reservation, self.index = reservation.hold(), index
        self.rank_strategy = settings.ray_rank_strategy
        group.add(self)
        self._start()

    def _start(self) -> None:
        options = ray_options(self.resources, self.reservation, self.index)
        self.actor = actor_class(self.ray).options(max_concurrency=8, **options).remote(
            list(sys.path), pickle.dumps(self.spec), self.rank_strategy)
        self.ready_ref = self.actor.ready.remote()
        self.ready = False
        self.where = None
        self.started = time.monotonic()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Its placement group placed (`timeout`, else PLACE_TIMEOUT_S), then its actor's build (START_TIMEOUT_S)."""
        timeout = PLACE_TIMEOUT_S if timeout is None else timeout
        if not self.reservation.wait_placed(timeout):
            raise RequestError(f"{self.label}: Ray could not place it with resources {self.resources} "
                               f"({self.reservation.strategy}) within {timeout:g}s; see `ray status`") from None
        self._take_status(START_TIMEOUT_S)

    def _take_status(self, timeout: float | None) -> None:
        """The actor's build is over (or `timeout` passes): ready, with its event stream read, or the typed error."""
        try:
            node, status = self.ray.get(self.ready_ref, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - the actor died while starting, or no room within the bound
            raise RequestError(f"{self.label}: its Ray actor failed to start: {type(exc).__name__}: "
                               f"{' '.join(str(exc).split())[:300]}") from None
        self.where = node
        if isinstance(status, Failed):
            self.close()
            raise rebuild(*status.error)
        self.on_ready(status.kind, status.concurrent_inputs, status.stats)
        self._spawn(self._poller, (self.actor,), f"omni-ray-poll-{self.node.id}")

    def _spawn(self, target, args: tuple, name: str) -> None:
        """A thread that waits in Ray for one actor; close() joins it, so none makes a Ray call after it returns
        (a call after the caller's ray.shutdown() would connect this process to the cluster again)."""
        self.threads = [thread for thread in self.threads if thread.is_alive()]
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _await_start(self, actor, ready_ref) -> None:
        """On a thread of its own: wait for a restarted actor's build, then ring the front (pump takes it)."""
        try:
            self.ray.wait([ready_ref], timeout=RESTART_WAIT_S)
        finally:
            self._deliver(actor, STARTED)

    def _restarted(self) -> None:
        """A restarted actor's build is over: it serves, or its stage is dead with the reason."""
        if self.ready or self.actor is None:
            return
        try:
            self._take_status(0)
        except Exception as exc:  # noqa: BLE001 - e.g. its model is gone now
            self.end(f"{self.label}: its Ray actor could not restart within {RESTART_WAIT_S:g}s: {exc}")
            log.error("%s", self.dead)
            self.close()

    def _poller(self, actor) -> None:
        """Reads one actor's event stream until the proxy moves on from it (closed, or restarted)."""
        try:
            for ref in actor.events.options(num_returns="streaming").remote():
                if self.actor is not actor:
                    return
                events = self.ray.get(ref)
                if self.actor is not actor:
                    return
                self._deliver(actor, events)
            raise RequestError("the event stream ended")
        except Exception as exc:  # noqa: BLE001 - RayActorError: the actor died; handled by pump
            self._deliver(actor, exc)

    def _deliver(self, actor, payload) -> None:
        self.mailbox.put((actor, payload))
        try:
            self.ringer.send(b"\0")
        except OSError:  # closed, or the bell is full (it will ring anyway)
            pass

    def close(self) -> None:
        """Kill the actor and return once Ray reports it dead (GONE_TIMEOUT_S at most); the last holder of its
        placement group removes it."""
        actor, self.actor = self.actor, None
        for sock in (self.bell, self.ringer):
            sock.close()
        if actor is not None:
            stop_ranks(self.ray, actor)
            kill_all(self.ray, [actor])
        deadline = time.monotonic() + GONE_TIMEOUT_S
        for thread in self.threads:  # each ends as its dead actor's stream or build fails
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        if self.reservation is not None:
            self.reservation.drop()
            self.reservation = None

    # Receiving.

    def handles(self) -> list:
        return [] if self.bell.fileno() < 0 else [self.bell]

    def pump(self) -> None:
        """Take what the pollers brought back so far (no Ray call here)."""
        try:
            while self.bell.recv(4096):
                pass
        except OSError:  # nothing more to read (or closed)
            pass
        while True:
            try:
                actor, payload = self.mailbox.get_nowait()
            except queue.Empty:
                return
            if actor is not self.actor:
                continue  # from an actor already given up (restarted, or closed)
            if payload is STARTED:
                self._restarted()
                continue
            if isinstance(payload, BaseException):
                self._died(payload)
                continue
            for message in payload:
                match message:
                    case Events(events=events, stats=stats):
                        self.on_events(events, stats)

    def _died(self, exc: BaseException) -> None:
        actor, self.actor = self.actor, None
        try:
            self.ray.kill(actor)  # its stream failed but it may live on
        except Exception:  # noqa: BLE001 - dead already
            log.debug("%s: its Ray actor was gone already", self.label, exc_info=True)
        if not node_alive(self.ray, self.where):
            died = f"Ray node {self.where[:12]} died (and its actor with it)"
        else:
            died = f"Ray actor died ({type(exc).__name__})"
        if self.lost(died, "replica" if self.spec.replica is not None else "actor"):
            try:
                self._start()
            except Exception as error:  # noqa: BLE001 - Ray itself is gone
                self.end(f"{self.label}: its Ray actor could not restart: {error}")
                log.error("%s", self.dead)
                self.actor = None
                return
            self._spawn(self._await_start, (self.actor, self.ready_ref), f"omni-ray-start-{self.node.id}")

    # The Stage contract.

    def _call(self, call: type[Submit | Check], item: StageInput):
        """A Submit or Check (`call`), answered by the actor: its value, or its error raised (typed)."""
        if not self.ready and self.actor is not None:  # restarting
            self.pump()
            if not self.ready and self.actor is not None:
                if self.group.fail_fast:
                    raise self._restarting()
                self.ray.wait([self.ready_ref], timeout=RESTART_WAIT_S)
                self._restarted()
        if self.actor is None:
            raise self._refusal()
        sealed = Sealed(item.request_id, self._pickle(item))
        sent = self.actor.handle.remote(call(0, 0, sealed))
        if call is Submit:  # its actor has it: a death from now on fails it
            self.outstanding.add(item.request_id)
        try:
            reply = self.ray.get(sent, timeout=CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the actor died, or (not expected) the call failed in it
            if not isinstance(exc, self.ray.exceptions.RayActorError):
                raise RequestError(f"stage {self.node.id!r}: its Ray actor failed the {call.__name__.lower()!r} call "
                                   f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]})") from None
            self._died(exc)
            raise WorkerDied(f"{self.label}: its Ray actor died while processing the input") from None
        return self._answer(call, reply.ok, reply.data)

    def _running(self) -> bool:
        return self.actor is not None

    def _send_hand_off(self, item: StageInput) -> None:
        # in order with this caller's other messages where Ray keeps them so; the actor remembers an abort that
        # overtook the hand-off it follows
        self.actor.handle.remote(HandOff(0, Sealed(item.request_id, self._pickle(item))))

    def _send_append(self, chunk: StreamChunk) -> None:
        # Ray may run it before the hand-off or the chunk it follows: the actor puts them back in order
        self.actor.handle.remote(Append(0, Sealed(chunk.request_id, self._pickle(chunk))))

    def _send_abort(self, request_id: str) -> None:
        if self.actor is not None:
            self.actor.handle.remote(Abort(0, request_id))


def stop_ranks(ray, actor) -> None:
    """Ask the stage's actor to end its rank groups' actors (GONE_TIMEOUT_S at most; a dead actor has none)."""
    try:
        ray.get(actor.stop_ranks.remote(), timeout=GONE_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - the actor is dead or stuck: killing it ends its ranks with it, later
        pass
