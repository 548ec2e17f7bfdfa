"""The worker process of placement `process`: it rebuilds its stages (stage_host.py: one, or every stage of one
share key, whose plugin gives them one engine) and runs their engine loop.

The front starts it through the kernel's launcher (spawn.py, omni_kernel/util/launch.py) and sends it its sys.path,
then its WorkerSpec. The worker runs its engine loop continuously: it drains its inbox (add_request / hand_off / abort / the process RPC), steps
its stage while it has work and sends the events back with the stage's stats when they changed (from a sender
thread); when idle it blocks on its inbox.
Its reader thread answers `check` at once (model-free by the Stage contract), so a submit never waits for a long
denoise step of a downstream stage; `process` is answered by the engine loop between two of its steps (it waits
for the step running now: one decode step for an AR entry stage), or at once too when the stage's
`concurrent_process` says it may run beside a step (Wan's, the AR stages'). A downstream input is handed off in one message
(`hand_off`: process then add, in the worker), so the front never waits at a hand-off. A worker dies with its
parent (the launcher's PR_SET_PDEATHSIG) and exits on the front's `close()`.
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
    """The worker interpreter's entry: the front's sys.path, then the spec, then `worker_main`."""
    conn = multiprocessing.connection.Connection(fd)
    sys.path[:] = conn.recv()
    try:
        spec = conn.recv()
    except Exception as exc:  # noqa: BLE001 - e.g. a config class this interpreter cannot import
        conn.send(("failed", *classify(exc)))
        return
    worker_main(conn, spec)


def worker_main(conn, spec: WorkerSpec) -> None:
    """A stage worker process: build its first stage, then its engine loop until told to stop or the parent is
    gone; the front may send it more stages to build (`build`: the stages of one share key, in one plugin host)."""
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
        outbox.put(("failed", spec.tag, *classify(exc)))
        outbox.put(None)
        sender.join(10)
        return
    outbox.put(("ready", spec.tag, stage.kind, stage.concurrent_process, stage.stats()))
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
        except Exception as exc:  # noqa: BLE001 - ready / failed / dead are plain data: not expected
            log.error("stage %r: a %r message could not be sent to the front (%s: %s)", node_id, message[0],
                      type(exc).__name__, exc)
            shared.close(fds)
            continue
        try:
            shared.send(conn, data, fds)
        except (OSError, EOFError, ValueError):
            os._exit(0)  # the front is gone


class EngineLoop:
    """The worker's stages (by tag) and the loop that steps them. Its reader thread answers `check` (model-free by
    contract), and `process` of a stage whose `concurrent_process` says it may run beside a step, at once;
    everything else goes to the engine loop, which takes it between two steps."""

    def __init__(self, plugins, hosts: dict[int, StageHost], outbox: queue.Queue, spec: WorkerSpec):
        self.plugins, self.hosts, self.outbox, self.spec = plugins, hosts, outbox, spec
        self.share = CoreShare(*spec.cores) if spec.cores else None

    def read(self, conn, inbox: queue.Queue) -> None:
        try:
            arrived: list[str] = []
            while True:
                message = conn.recv()
                shared.forget(arrived)  # what the message before did not load
                arrived = []
                if message[0] == "fds":  # the shared memory of the message that follows
                    arrived = message[1]
                    shared.take_fds(conn, arrived)
                    continue
                host = self.hosts.get(message[1]) if message[0] in ("check", "process") else None
                if host is not None and (message[0] == "check" or host.concurrent_process):
                    self.outbox.put(self.handle(message))
                    continue
                inbox.put(message)  # a call to a stage still being built waits for its build, in order
                if message[0] == "stop":
                    return
        except (EOFError, OSError):  # the front closed its end
            inbox.put(("stop",))
        except Exception as exc:  # noqa: BLE001 - a message it cannot unpickle: whose it was is unknown, so the
            # worker exits (the front fails what it held and restarts it) instead of leaving requests unanswered
            log.error("stage %s: its worker could not read a message from the front and stops: %s: %s",
                      self.spec.node.id, type(exc).__name__, exc)
            os._exit(1)

    def run(self, conn) -> None:
        """Take the queued messages, then step; wait for a message when nothing is in flight."""
        inbox: queue.Queue = queue.Queue()
        threading.Thread(target=self.read, args=(conn, inbox), name="omni-worker-read", daemon=True).start()
        while True:
            busy = any(h.has_unfinished() for h in self.hosts.values())
            if self.share is not None and not busy:
                self.share.idle()
            if not self.take_messages(inbox, wait=not busy):
                return
            self.step()

    def take_messages(self, inbox: queue.Queue, wait: bool) -> bool:
        """Handle every queued message (waiting up to a second for the first one when `wait`); False on stop."""
        try:
            message = inbox.get(timeout=1.0) if wait else inbox.get_nowait()
        except queue.Empty:
            return True
        while message is not None:
            if message[0] == "stop":
                return False
            if self.share is not None and message[0] in ("process", "hand_off", "build"):
                self.share.before_step()  # input processing is work too (a Wan request encodes its image)
            reply = self.handle(message)
            if reply is not None:
                self.outbox.put(reply)
            try:
                message = inbox.get_nowait()
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
                self.outbox.put(("events", tag, events.get(host, []), stats))
        still_busy = [host for _, host in hosts if host.has_unfinished()]
        if share is not None and events and not still_busy:
            share.idle()  # lend the cores before the next messages
        if still_busy and not events:
            still_busy[0].engine.wait(WAIT_S)

    def handle(self, message):
        rpc, tag = message[0], message[1]
        if rpc == "build":
            return self.build(message[1])
        host = self.hosts.get(tag)
        if host is None:  # dropped meanwhile (its stage closed in the front)
            return ("reply", message[2], False, classify(RuntimeError("the stage was closed"))) \
                if rpc in ("process", "check") else None
        if rpc in ("add", "hand_off"):
            events = host.add(message[2]) if rpc == "add" else host.hand_off(message[2])
            return ("events", tag, events, None) if events else None
        if rpc == "abort":
            host.abort(message[2])
            return None
        if rpc == "drop":
            for request_id in sorted(host.request_ids()):
                host.abort(request_id)
            del self.hosts[tag]
            return None
        if rpc in ("process", "check"):
            _, _, call_id, item = message
            try:
                value = host.process(item) if rpc == "process" else host.check(item)
            except Exception as exc:  # noqa: BLE001 - raised again in the front, typed
                return ("reply", call_id, False, classify(exc))
            return ("reply", call_id, True, value)
        log.warning("unknown message %r", rpc)
        return None

    def build(self, spec: WorkerSpec):
        """Another stage of this worker's share key, built in its plugin host: it shares the engine there."""
        try:
            stage = build_stage(spec, self.plugins)
        except Exception as exc:  # noqa: BLE001 - that stage fails to build; the others go on
            return ("failed", spec.tag, *classify(exc))
        self.hosts[spec.tag] = StageHost(stage, spec.node.id)
        return ("ready", spec.tag, stage.kind, stage.concurrent_process, stage.stats())
