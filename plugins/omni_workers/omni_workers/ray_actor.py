"""The Ray actor that hosts one stage (placement `ray`; its proxy in the front is ray_stage.RayStage): its body,
`StageActor` (a StageHost, the engine thread that steps it, and the stream of its events), and what the front
needs to make one: Ray itself, imported and connected at first use, and `StageActor` wrapped with `ray.remote`
(keep the class name: benchmarks/overlap.py finds the actors' processes by it).

Contract: the front sends the messages of messages.py to `handle` (`Submit`, `Check`, `HandOff`, `Append`, `Abort`; the
tag is always 0: an actor hosts one stage), whose calls return their `Reply`; `ready()` returns the build's `Ready` or
`Failed`; `events()` streams `Events` (each event `Sealed`) for the actor's life.
"""

from __future__ import annotations

import collections
import logging
import pickle
import sys
import threading

import attrs

from omni_kernel.core.errors import PluginError, classify
from omni_kernel.core.request import StageInput, StreamChunk
from omni_kernel.events import StageFailed, StageFinished

from .messages import Abort, Add, Append, Check, Events, Failed, HandOff, Ready, Reply, Sealed, Submit
from .ray_groups import RayRankLauncher
from .stage_host import (
    KEPT,
    WAIT_S,
    StageHost,
    WorkerSpec,
    build_stage,
    set_torch_threads,
    setup_worker,
    step_hosts,
)
from .transport import pack, pack_answer

log = logging.getLogger("omni")


def import_ray():
    try:
        import ray
    except ImportError:
        raise PluginError("placement 'ray' needs Ray: pip install 'omni-workers[ray]'") from None
    return ray


def ensure_ray(address: str | None):
    """Connect to the cluster at `address` (or start a local Ray) once per process."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, ignore_reinit_error=True, log_to_driver=True,
                 logging_level=logging.WARNING)
    return ray


_ACTOR = None


def actor_class(ray):
    """`StageActor` as a Ray actor class, wrapped once per process."""
    global _ACTOR
    if _ACTOR is None:
        _ACTOR = ray.remote(StageActor)
    return _ACTOR


class StageActor:
    """The body of the Ray actor (wrapped by `ray.remote` at first use): a StageHost and its engine thread.

    `handle` runs on Ray's threads and only queues work (`inbox`) under a short lock, except what may be answered
    beside a step: a `Check` (model-free by contract) and the processing of a `Submit` to a stage whose
    `concurrent_inputs` says so (its add is queued). The engine thread alone adds to and steps the stage, without
    holding the lock, so a call never starves behind back-to-back steps; it answers any other `Submit` between two
    steps, as in a worker process. `events` hands the front what the engine thread emitted (`out`)."""

    def __init__(self, sys_path: list[str], spec_bytes: bytes, rank_strategy: str = "STRICT_PACK"):
        for entry in sys_path:  # what the front imports (plugins, test modules), where it exists here
            if entry not in sys.path:
                sys.path.append(entry)
        self.lock = threading.Lock()
        self.work = threading.Condition(self.lock)  # the engine thread waits here for the inbox
        self.emitted = threading.Condition(self.lock)  # a long poll waits here for `out`
        self.inbox: collections.deque = collections.deque()  # (message, the _Reply of a Submit or None)
        self.out: list[Events] = []
        self.aborted: dict[str, None] = {}
        self.order = StreamOrder()  # the engine thread's alone
        self.status: Ready | Failed | None = None
        self.stop = False
        self.ranks: RayRankLauncher | None = None
        try:
            spec: WorkerSpec = pickle.loads(spec_bytes)  # our own bytes, from the front, through Ray
            setup_worker(spec)
            # a parallel stage built here starts its other ranks as actors with this one's resources
            self.ranks = RayRankLauncher(dict(spec.node.resources or {"CPU": 1}), rank_strategy)
            stage = build_stage(attrs.evolve(spec, node=attrs.evolve(spec.node, ranks=self.ranks)))
            set_torch_threads(spec.threads)
        except BaseException as exc:  # noqa: BLE001 - the front raises it, typed
            self.status = Failed(0, classify(exc))
            return
        self.host = StageHost(stage, spec.node.id)
        self.threads = spec.threads
        self.status = Ready(0, stage.kind, stage.concurrent_inputs, stage.stats())
        threading.Thread(target=self._loop, name="omni-ray-engine", daemon=True).start()

    def ready(self) -> tuple[str, Ready | Failed]:
        """(the Ray node id this actor runs on, its build's outcome)."""
        return import_ray().get_runtime_context().get_node_id(), self.status

    def handle(self, message) -> Reply | None:
        """The actor's entry for the front's messages, on one of Ray's threads: dispatched here when it may be
        answered beside a step (`_now`), else queued for the engine thread (a Submit's caller waits for its Reply)."""
        if self._now(message):
            return self._dispatch(message)[0]
        done = _Reply() if isinstance(message, Submit) else None
        self._queue(message, done)
        return None if done is None else done.wait()

    def _now(self, message) -> bool:
        """A check (model-free), or a submit to a stage whose inputs may be processed beside a step."""
        return isinstance(message, Check) or (isinstance(message, Submit) and self.host.concurrent_inputs)

    def _loop(self) -> None:
        set_torch_threads(self.threads)  # OpenMP's thread count is per calling thread
        busy = False
        while True:
            with self.lock:
                while not self.stop and not self.inbox and not busy:
                    self.work.wait()
                if self.stop:
                    return
            events = self._take_inbox()
            events.extend(step_hosts([self.host], WAIT_S).get(self.host, []))
            for event in events:
                if isinstance(event, (StageFailed, StageFinished)):
                    self.order.end(event.request_id)
            stats = self.host.new_stats()  # after each step, and after an add or abort that changed them
            busy = self.host.busy()
            if events or stats is not None:
                self._emit(pack(Events(0, tuple(events), stats), self.host.node_id))

    def _take_inbox(self) -> list:
        """Dispatch every queued message, those they queue (a submit's add) included; the events they made."""
        events: list = []
        while True:
            with self.lock:
                messages = list(self.inbox)
                self.inbox.clear()
            if not messages:
                return events
            for message, done in messages:
                try:
                    reply, made = self._dispatch(message)
                except Exception as exc:  # noqa: BLE001 - one bad message must not stop the engine thread
                    log.error("stage actor: %s failed: %s: %s", type(message).__name__, type(exc).__name__, exc,
                              exc_info=exc)
                    reply, made = Reply(0, *pack_answer(False, classify(exc), self.host.node_id)), []
                events.extend(made)
                if done is not None:
                    done.put(reply)

    def _dispatch(self, message) -> tuple[Reply | None, list]:
        """The actor's one dispatcher: what `message` asks, done; a call's Reply and the events made at once (a
        failed add). Ray runs a threaded actor's calls in any order, so an abort can overtake the hand-off it
        follows: it is remembered."""
        match message:
            case Check(call_id=call_id, item=sealed):
                return self._call(call_id, self.host.check, sealed)[0], []
            case Submit(call_id=call_id, item=sealed):  # added by the engine thread, before what is queued after
                reply, item = self._call(call_id, self.host.process, sealed, answer=False)
                if reply.ok:
                    self._queue(Add(0, item))
                return reply, []
            case Add(item=item):
                return None, self.host.add(item)
            case HandOff(item=sealed):
                return None, self._hand_off(sealed)
            case Append(chunk=sealed):
                return None, self._append(sealed)
            case Abort(request_id=request_id):
                self._abort(request_id)
        return None, []

    def _abort(self, request_id: str) -> None:
        if request_id not in self.host.requests:
            self.aborted[request_id] = None
            while len(self.aborted) > KEPT:
                self.aborted.pop(next(iter(self.aborted)))
        self.order.end(request_id)
        self.host.abort(request_id)

    def _hand_off(self, sealed: Sealed) -> list:
        if self.aborted.pop(sealed.request_id, 0) is None:
            return []
        item = self._load(sealed)
        if not isinstance(item, StageInput):
            return item  # its StageFailed
        events = self.host.hand_off(item)
        if item.stream and not events:  # it takes its chunks now, those that came before it first
            events = self._take_chunks(self.order.open(item.request_id))
        return events

    def _append(self, sealed: Sealed) -> list:
        chunk = self._load(sealed)
        if not isinstance(chunk, StreamChunk):
            self.order.end(sealed.request_id)
            return chunk  # its StageFailed
        return self._take_chunks(self.order.arrive(chunk))

    def _take_chunks(self, chunks: list[StreamChunk]) -> list:
        events = []
        for chunk in chunks:
            events.extend(self.host.append(chunk))
        return events

    def _load(self, sealed: Sealed):
        """The front's pickled input, or its request's StageFailed (in a list) where this actor cannot read it."""
        try:
            return pickle.loads(sealed.data)
        except Exception as exc:  # noqa: BLE001 - e.g. a class only the front has: this request only
            return [StageFailed(sealed.request_id, self.host.node_id, self._unreadable(exc), "runtime")]

    def _call(self, call_id: int, function, sealed: Sealed, answer: bool = True) -> tuple[Reply, object]:
        """A call on the front's pickled input: its Reply, with the value pickled here where `answer` (so that an
        input this actor cannot read, the call's error and a value the front cannot take all come back as the
        call's error), and the value itself."""
        node_id = self.host.node_id
        try:
            item = pickle.loads(sealed.data)
        except Exception as exc:  # noqa: BLE001 - this call only
            return Reply(call_id, *pack_answer(False, ("runtime", self._unreadable(exc), None), node_id)), None
        try:
            value = function(item)
        except Exception as exc:  # noqa: BLE001 - raised again in the front, typed
            return Reply(call_id, *pack_answer(False, classify(exc), node_id)), None
        return Reply(call_id, *pack_answer(True, value if answer else None, node_id)), value

    def _unreadable(self, exc: Exception) -> str:
        return (f"stage {self.host.node_id!r}: its input could not be read by its Ray actor ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())})")

    def _queue(self, message, done: _Reply | None = None) -> None:
        with self.lock:
            self.inbox.append((message, done))
            self.work.notify()

    def _emit(self, message: Events) -> None:
        with self.lock:
            self.out.append(message)
            self.emitted.notify_all()

    def events(self):
        """The stage's `Events` as a Ray stream (one call for the actor's life, `num_returns="streaming"`): each
        item is everything emitted since the last, so a slow reader gets them in fewer, larger items. A stream
        item costs a fraction of a call's round trip (about 0.14 ms of CPU on each side against 0.55 ms here)."""
        while True:
            with self.lock:
                while not self.out and not self.stop:
                    self.emitted.wait()
                if not self.out:
                    return
                out, self.out = self.out, []
            yield out

    def stop_ranks(self) -> None:
        """End the actors of this stage's rank groups (the front's close() calls it before killing this actor)."""
        if self.ranks is not None:
            self.ranks.stop_all()

    def shutdown(self) -> None:
        with self.lock:
            self.stop = True
            self.work.notify_all()
            self.emitted.notify_all()


class StreamOrder:
    """A Ray actor's streamed inputs, in order. Ray runs a threaded actor's calls in any order, so a chunk can
    overtake the hand-off that opens its request's input, or the chunk before it: each waits here for its turn (its
    `StreamChunk.index`). A request's stream ends at its last chunk, its abort or its failure (`end`); a chunk that
    comes after is dropped (the last KEPT ends are remembered)."""

    def __init__(self):
        self.next: dict[str, int] = {}  # an open request -> the index of the chunk it takes next
        self.early: dict[str, dict[int, StreamChunk]] = {}  # chunks that came before their turn, by request
        self.ended: dict[str, None] = {}

    def open(self, request_id: str) -> list[StreamChunk]:
        """A request's input opened (its hand-off was added): the chunks due now, those that came before it."""
        self.ended.pop(request_id, None)
        self.next[request_id] = 0
        return self._due(request_id)

    def arrive(self, chunk: StreamChunk) -> list[StreamChunk]:
        """A chunk came: the chunks due now, in order (none while one before it, or the hand-off, is missing)."""
        if chunk.request_id in self.ended:
            return []
        self.early.setdefault(chunk.request_id, {})[chunk.index] = chunk
        return self._due(chunk.request_id)

    def end(self, request_id: str) -> None:
        self.next.pop(request_id, None)
        self.early.pop(request_id, None)
        self.ended[request_id] = None
        while len(self.ended) > KEPT:
            self.ended.pop(next(iter(self.ended)))

    def _due(self, request_id: str) -> list[StreamChunk]:
        waiting = self.early.get(request_id, {})
        due = []
        while request_id in self.next and self.next[request_id] in waiting:
            chunk = waiting.pop(self.next[request_id])
            due.append(chunk)
            self.next[request_id] += 1
            if chunk.last:
                self.end(request_id)
        if not waiting:
            self.early.pop(request_id, None)
        return due


class _Reply:
    """Where the engine thread puts a Submit's Reply, for the Ray thread that waits for it."""

    def __init__(self):
        self.reply: Reply | None = None
        self.done = threading.Event()

    def put(self, reply: Reply) -> None:
        self.reply = reply
        self.done.set()

    def wait(self) -> Reply:
        self.done.wait()
        return self.reply
