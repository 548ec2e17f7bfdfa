"""The worker process of placement `process`: it builds its stages (stage_host.py: one, or every stage of one
share key, whose plugin gives them one engine) and runs their engine loop until the front sends `Stop`, closes
its end of the pipe, or dies (the kernel launcher's PR_SET_PDEATHSIG, omni_kernel/util/launch.py).

Contract (the messages: messages.py; one dispatcher, `EngineLoop.handle`):
- The front starts it through the launcher (spawn.py) and sends its sys.path, then a `Build` of its first stage;
  it answers each `Build` with `Ready` or `Failed`.
- Its reader thread answers `Check` at once (model-free by the Stage contract), and processes a `Submit` at once
  where the stage's `concurrent_inputs` allows it; everything else, and every add to an engine, is handled by
  the engine loop between two steps, in the order it came (a streamed input's `Append`s after the `HandOff` that
  opened it). A `Submit` is answered by a `Reply` once its input is processed (the
  processing error raises in the front); a failure to add, or to process a `HandOff`, comes back as the
  request's StageFailed in `Events`.
- The engine loop steps its stages while they hold requests (stage_host.step_hosts) and sends each stage's
  `Events` with its stats when they changed (from a sender thread, so a front slow to read never stalls a step);
  idle, or holding only open requests that wait for their next chunk, it blocks on its inbox.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
from multiprocessing.reduction import ForkingPickler

from omni_kernel.core.errors import classify

from . import shared
from .cores import CoreShare
from .messages import Abort, Add, Append, Build, Check, Drop, Events, Failed, Fds, HandOff, Ready, Reply, Stop, Submit
from .stage_host import (
    WAIT_S,
    StageHost,
    WorkerSpec,
    build_stage,
    load_plugins,
    set_torch_threads,
    setup_worker,
    step_hosts,
)
from .transport import pack

log = logging.getLogger("omni")


def child_main(fd: int) -> None:
    """The worker interpreter's entry: the front's sys.path, then its first stage's `Build`, then `worker_main`."""
    conn = multiprocessing.connection.Connection(fd)
    sys.path[:] = conn.recv()
    try:
        build = conn.recv()
    except Exception as exc:  # noqa: BLE001 - e.g. a config class this interpreter cannot import: the front
        conn.send(Failed(-1, classify(exc)))  # sees the worker end while building its first stage
        return
    worker_main(conn, build.spec)


def worker_main(conn, spec: WorkerSpec) -> None:
    """A stage worker process: build its first stage, then its engine loop until told to stop or the parent is
    gone; the front may send it more stages to build (`Build`: the stages of one share key, in one plugin host)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_worker(spec)
    outbox: queue.Queue = queue.Queue()
    sender = threading.Thread(target=_send_loop, args=(conn, outbox, spec.node.id), name="omni-worker-send",
                              daemon=True)
    sender.start()
    try:
        plugins = load_plugins(spec)
        stage = build_stage(spec, plugins)
        set_torch_threads(spec.threads)
    except BaseException as exc:  # noqa: BLE001 - the front raises it, typed
        outbox.put(Failed(spec.tag, classify(exc)))
        outbox.put(None)
        sender.join(10)
        return
    outbox.put(Ready(spec.tag, stage.kind, stage.concurrent_inputs, stage.stats()))
    loop = EngineLoop(plugins, {spec.tag: StageHost(stage, spec.node.id)}, outbox, spec)
    loop.run(conn)
    outbox.put(None)
    sender.join(5)


def _send_loop(conn, outbox: queue.Queue, node_id: str = "?") -> None:
    """Sends from a thread, so the engine loop keeps reading its inbox while the front is slow to read."""
    while (message := outbox.get()) is not None:
        fds: list = []
        try:
            data = ForkingPickler.dumps(pack(message, node_id, fds))
        except Exception as exc:  # noqa: BLE001 - Ready / Failed are plain data: not expected
            log.error("stage %r: a %s message could not be sent to the front (%s: %s)", node_id,
                      type(message).__name__, type(exc).__name__, exc)
            shared.close(fds)
            continue
        try:
            shared.send(conn, data, fds)
        except (OSError, EOFError, ValueError):
            os._exit(0)  # the front is gone


class EngineLoop:
    """The worker's stages (by tag), its inbox, and the loop that steps them (see the module docstring)."""

    def __init__(self, plugins, hosts: dict[int, StageHost], outbox: queue.Queue, spec: WorkerSpec):
        self.plugins, self.hosts, self.outbox, self.spec = plugins, hosts, outbox, spec
        self.inbox: queue.Queue = queue.Queue()
        self.share = CoreShare(*spec.cores) if spec.cores else None

    def read(self, conn) -> None:
        """The reader thread: every message from the front, answered here when it may be (`now`), else queued for
        the engine loop in the order it came."""
        try:
            arrived: list[str] = []
            while True:
                message = conn.recv()
                shared.forget(arrived)  # what the message before did not load
                arrived = []
                if isinstance(message, Fds):  # the shared memory of the message that follows
                    arrived = message.names
                    shared.take_fds(conn, arrived)
                    continue
                if self.now(message):
                    self.send(self.handle(message))
                    continue
                self.inbox.put(message)  # a call to a stage still being built waits for its build, in order
                if isinstance(message, Stop):
                    return
        except (EOFError, OSError):  # the front closed its end
            self.inbox.put(Stop())
        except Exception as exc:  # noqa: BLE001 - a message it cannot unpickle: whose it was is unknown, so the
            # worker exits (the front fails what it held and restarts it) instead of leaving requests unanswered
            log.error("stage %s: its worker could not read a message from the front and stops: %s: %s",
                      self.spec.node.id, type(exc).__name__, exc)
            os._exit(1)

    def now(self, message) -> bool:
        """Whether the reader thread answers `message` beside the step running now: a check (model-free), or a
        submit to a stage whose inputs may be processed beside a step (its add still waits for the engine loop)."""
        host = self.hosts.get(getattr(message, "tag", None))
        if host is None:
            return False
        return isinstance(message, Check) or (isinstance(message, Submit) and host.concurrent_inputs)

    def run(self, conn) -> None:
        """Take the queued messages, then step; wait for a message when nothing is in flight."""
        threading.Thread(target=self.read, args=(conn,), name="omni-worker-read", daemon=True).start()
        while True:
            busy = any(h.busy() for h in self.hosts.values())
            if self.share is not None and not busy:
                self.share.idle()
            if not self.take_messages(wait=not busy):
                return
            self.step()

    def take_messages(self, wait: bool) -> bool:
        """Handle every queued message (waiting up to a second for the first one when `wait`); False on Stop."""
        try:
            message = self.inbox.get(timeout=1.0) if wait else self.inbox.get_nowait()
        except queue.Empty:
            return True
        while message is not None:
            if isinstance(message, Stop):
                return False
            if self.share is not None and isinstance(message, (Submit, HandOff, Append, Build)):
                self.share.before_step()  # input processing is work too (a Wan request encodes its image)
            self.send(self.handle(message))
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                message = None
        return True

    def step(self) -> None:
        """Step each engine of the worker's stages once (stages of one share key share theirs), send each stage's
        events and its stats where they changed; when none could step, wait a little on a busy one (only
        background work: an MP4 export)."""
        share = self.share
        hosts = list(self.hosts.items())
        busy = [host for _, host in hosts if host.has_unfinished()]
        if share is not None and busy:
            share.before_step()
        events = step_hosts(busy)
        for tag, host in hosts:
            stats = host.new_stats()  # after each step, and after an add or abort that changed them
            if events.get(host) or stats is not None:
                self.outbox.put(Events(tag, tuple(events.get(host, ())), stats))
        still_busy = [host for _, host in hosts if host.busy()]
        if share is not None and events and not still_busy:
            share.idle()  # lend the cores before the next messages
        if still_busy and not events:
            still_busy[0].engine.wait(WAIT_S)

    def send(self, message) -> None:
        if message is not None:
            self.outbox.put(message)

    def handle(self, message):
        """The worker's one dispatcher: what `message` asks, done; the message to send back, or None."""
        if isinstance(message, Build):
            return self.build(message.spec)
        host = self.hosts.get(message.tag)
        if host is None:  # dropped meanwhile (its stage closed in the front)
            return self.closed(message)
        match message:
            case Check(call_id=call_id, item=item):
                return self.call(call_id, host.check, item)
            case Submit():
                return self.submit(host, message)
            case Add(tag=tag, item=item):
                return self.events(tag, host.add(item))
            case HandOff(tag=tag, item=item):
                return self.events(tag, host.hand_off(item))
            case Append(tag=tag, chunk=chunk):
                return self.events(tag, host.append(chunk))
            case Abort(request_id=request_id):
                host.abort(request_id)
            case Drop(tag=tag):
                self.drop(tag)
            case _:
                log.warning("unknown message %r", message)
        return None

    def drop(self, tag: int) -> None:
        """The stage closed in the front: its requests aborted, the stage forgotten."""
        host = self.hosts.pop(tag)
        for request_id in sorted(host.requests):
            host.abort(request_id)

    def submit(self, host: StageHost, message: Submit) -> Reply:
        """Process the input (a user error is the Reply's) and queue its add: the engine loop adds it between two
        steps, before anything queued after this Submit (its abort)."""
        reply = self.call(message.call_id, host.process, message.item)
        if not reply.ok:
            return reply
        self.inbox.put(Add(message.tag, reply.data))
        return Reply(message.call_id, True, None)

    @staticmethod
    def closed(message) -> Reply | None:
        """The answer to a call to a stage no longer here; other messages for it are dropped."""
        if isinstance(message, (Submit, Check)):
            return Reply(message.call_id, False, classify(RuntimeError("the stage was closed")))
        return None

    @staticmethod
    def call(call_id: int, function, item) -> Reply:
        try:
            return Reply(call_id, True, function(item))
        except Exception as exc:  # noqa: BLE001 - raised again in the front, typed
            return Reply(call_id, False, classify(exc))

    @staticmethod
    def events(tag: int, events: list) -> Events | None:
        return Events(tag, tuple(events)) if events else None

    def build(self, spec: WorkerSpec):
        """Another stage of this worker's share key, built in its plugin host: it shares the engine there."""
        try:
            stage = build_stage(spec, self.plugins)
        except Exception as exc:  # noqa: BLE001 - that stage fails to build; the others go on
            return Failed(spec.tag, classify(exc))
        self.hosts[spec.tag] = StageHost(stage, spec.node.id)
        return Ready(spec.tag, stage.kind, stage.concurrent_inputs, stage.stats())
