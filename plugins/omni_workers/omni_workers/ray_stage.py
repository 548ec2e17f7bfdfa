"""Placement `ray`: a stage in a Ray actor, placed with a placement group (the `omni-workers[ray]` extra).

The same contract as `process_stage.ProcessStage`: the front's proxy sends add / hand_off / abort and the
process / check calls; the actor (ray_actor.py) runs its stage's engine loop on a thread of its own, continuously,
and streams its events (`events`, a Ray streaming generator read by a thread of the front). Outputs come back as
stream items through Ray's object store (arrays included); the front relays them to the next stage (a Ray stream
cannot be handed to another actor). Each actor gets its own placement group of one bundle, `NodeSpec.resources`
(default {"CPU": 1}; {"GPU": 1} puts the stage on a GPU of whichever node of the cluster has one). An actor that
dies fails its requests with one error naming the stage and is restarted, `max_restarts` times; the front does not
wait for the new actor's build (a thread of its own does and rings the bell), and a call meanwhile waits or raises
StageUnavailable as `WorkerGroup.wait_for_restarts` says, as with worker processes. Requests, events and a call's
answer cross as bytes pickled by omni on each side (transport.pack_event, pack_answer), so one that cannot be
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

import attrs

from omni_kernel.core.errors import EngineDead, RequestError, rebuild
from omni_kernel.core.request import StageInput

from .cores import SHARED
from .proxy import StageProxy, WorkerDied
from .ray_actor import actor_class, ensure_ray
from .settings import WorkersSettings
from .stage_host import WorkerSpec

log = logging.getLogger("omni")
START_TIMEOUT_S = 600.0
STARTED = ("started",)  # the mailbox's word that a restarted actor's build is over (ready, failed or timed out)


class RayStage(StageProxy):
    """The Stage contract over a Ray actor (see the module docstring)."""

    what = "Ray actor"

    def __init__(self, spec: WorkerSpec, group, settings: WorkersSettings):
        self.ray = ensure_ray(settings.ray_address)
        super().__init__(spec, group, settings.max_restarts)
        self.spec = spec
        self.actor = None
        # The actor's event stream is read on a thread of the front per stage (blocking in Ray, never spinning);
        # what it brings back waits in `mailbox`, and a byte on `bell` wakes the front's one wait over every pipe.
        self.mailbox: queue.SimpleQueue = queue.SimpleQueue()
        self.bell, self.ringer = socket.socketpair()
        self.bell.setblocking(False)
        resources = dict(spec.node.resources or {"CPU": 1})
        self.resources = resources
        if spec.threads == SHARED:  # not shared across actors: the fixed split of the bundle's CPUs
            self.spec = attrs.evolve(self.spec, threads=max(1, int(resources.get("CPU", 1))))
        from ray.util.placement_group import placement_group

        self.pg = placement_group([resources], strategy="PACK", name=f"omni-{spec.node.id}-{id(self):x}")
        group.add(self)
        self._start()

    def _start(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        r = self.resources
        custom = {k: v for k, v in r.items() if k not in ("CPU", "GPU")}
        options = dict(num_cpus=r.get("CPU", 0), num_gpus=r.get("GPU", 0), max_concurrency=8,
                       scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0),
                       name=None)
        if custom:
            options["resources"] = custom
        self.actor = actor_class(self.ray).options(**options).remote(list(sys.path), pickle.dumps(self.spec))
        self.ready_ref = self.actor.ready.remote()
        self.ready = False
        self.started = time.monotonic()

    def wait_ready(self, timeout: float | None = START_TIMEOUT_S) -> None:
        try:
            self.ray.get(self.pg.ready(), timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - GetTimeoutError: no node has the resources
            raise RequestError(f"stage {self.node.id!r}: Ray could not place it with resources {self.resources} "
                               f"within {timeout}s ({type(exc).__name__}); see `ray status`") from None
        self._take_status(timeout)

    def _take_status(self, timeout: float | None) -> None:
        """The actor's build is over (or `timeout` passes): ready, with its event stream read, or the typed error."""
        try:
            status = self.ray.get(self.ready_ref, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - the actor died while starting
            raise RequestError(f"stage {self.node.id!r}: its Ray actor failed to start: {type(exc).__name__}: "
                               f"{' '.join(str(exc).split())[:300]}") from None
        if status[0] == "failed":
            self.close()
            raise rebuild(*status[1:])
        self._built(*status[1:])
        threading.Thread(target=self._poller, args=(self.actor,), name=f"omni-ray-poll-{self.node.id}",
                         daemon=True).start()

    def _await_start(self, actor, ready_ref) -> None:
        """On a thread of its own: wait for a restarted actor's build, then ring the front (pump takes it)."""
        try:
            self.ray.wait([ready_ref], timeout=START_TIMEOUT_S)
        finally:
            self._deliver(actor, STARTED)

    def _restarted(self) -> None:
        """A restarted actor's build is over: it serves, or its stage is dead with the reason."""
        if self.ready or self.actor is None:
            return
        try:
            self._take_status(0)
        except Exception as exc:  # noqa: BLE001 - e.g. its model is gone now
            self.dead = EngineDead(f"stage {self.node.id!r}: its Ray actor could not restart: {exc}")
            log.error("%s", self.dead)
            self.close()

    def _poller(self, actor) -> None:
        """Reads one actor's event stream until the proxy moves on from it (closed, or restarted)."""
        try:
            for ref in actor.events.options(num_returns="streaming").remote():
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
        actor, self.actor = self.actor, None
        for sock in (self.bell, self.ringer):
            sock.close()
        if actor is not None:
            try:
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001
                pass
        try:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001
            pass

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
            for message in payload:  # a step's events, then the stage's stats after it
                if message[0] == "stats":
                    self._take_stats(message[1])
                    continue
                _, request_id, data = message
                self._take_event(request_id, data)

    def _died(self, exc: BaseException) -> None:
        why = type(exc).__name__
        actor, self.actor = self.actor, None
        try:
            self.ray.kill(actor)  # its stream failed but it may live on
        except Exception:  # noqa: BLE001 - dead already
            log.debug("stage %s: its Ray actor was gone already", self.node.id, exc_info=True)
        if self._lost(f"Ray actor died ({why})", "actor"):
            try:
                self._start()
            except Exception as error:  # noqa: BLE001 - Ray itself is gone
                self.dead = EngineDead(f"stage {self.node.id!r}: its Ray actor could not restart: {error}")
                log.error("%s", self.dead)
                self.actor = None
                return
            threading.Thread(target=self._await_start, args=(self.actor, self.ready_ref),
                             name=f"omni-ray-start-{self.node.id}", daemon=True).start()

    # The Stage contract.

    def _call(self, rpc: str, item: StageInput):
        if not self.ready and self.actor is not None:  # restarting
            self.pump()
            if not self.ready and self.actor is not None:
                if not self.group.wait_for_restarts:
                    raise self._restarting()
                self.ray.wait([self.ready_ref], timeout=START_TIMEOUT_S)
                self._restarted()
        if self.actor is None:
            raise self.dead or WorkerDied(f"stage {self.node.id!r}: its Ray actor is gone")
        data = self._pickle(item)
        try:
            ok, answer = self.ray.get(self.actor.process.remote(rpc, data))
        except Exception as exc:  # noqa: BLE001 - the actor died, or (not expected) the call failed in it
            if not isinstance(exc, self.ray.exceptions.RayActorError):
                raise RequestError(f"stage {self.node.id!r}: its Ray actor failed the {rpc!r} call "
                                   f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]})") from None
            self._died(exc)
            raise WorkerDied(f"stage {self.node.id!r}: its Ray actor died while processing the input") from None
        return self._answer(rpc, ok, answer)

    def _gone(self):
        if self.actor is None or self.dead is not None:
            return self.dead or f"stage {self.node.id!r}: its Ray actor is gone"
        return None

    def _send_add(self, rpc: str, item: StageInput) -> None:
        data = self._pickle_add(item, item)
        if data is not None:
            getattr(self.actor, rpc).remote(item.request_id, data)  # in order: Ray keeps a caller's calls ordered

    def _send_abort(self, request_id: str) -> None:
        if self.actor is not None:
            self.actor.abort.remote(request_id)
