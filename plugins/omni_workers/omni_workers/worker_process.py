"""The front's handle on one worker process: its pipe, its start and restart, and the stages it hosts.

A worker hosts one stage, or every stage of one share key (the node type's `share_key`: pipelines whose nodes would
share an engine in one process), whichever graph of the front they belong to: the first one starts the process,
the others are built in it (`Build`), each with a tag that its messages carry both ways (messages.py). A stage
that closes is dropped from the worker; the worker stops with the last one.

`WorkerProcess.receive` is the front's one dispatcher of what a worker sends; it tells each stage (a
ProcessStage, process_stage.py) through that stage's public interface: `on_ready`, `on_build_failed`,
`on_events`, `on_worker_died`, `on_not_restarted`, and a call's `Reply` waits in `replies` for its caller.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing.connection
import subprocess
import sys
import time
from multiprocessing.reduction import ForkingPickler

import attrs

from omni_kernel.core.errors import rebuild

from . import shared
from .cores import SHARED, board
from .messages import Build, Drop, Events, Failed, Fds, Ready, Reply, Stop
from .spawn import start_worker
from .stage_host import WorkerSpec

log = logging.getLogger("omni")


class WorkerProcess:
    """One worker process and the stages it hosts (`members`, by tag). `ready`: it built its first stage, so
    what is sent goes down the pipe; before that it waits in `backlog` (the worker reads nothing while it loads
    its first model), so a send never blocks on a full pipe."""

    def __init__(self, threads, on_stop=None):
        self.members: dict = {}  # tag -> ProcessStage
        self.tags = itertools.count()
        self.calls = itertools.count()
        self.replies: dict[int, Reply] = {}
        self.slot = board().take() if threads == SHARED else None
        self.on_stop = on_stop
        self.child = self.conn = None  # the worker's omni_kernel.util.launch.Child, its pipe
        self.ready = False
        self.backlog: list[tuple[bytes, list]] = []  # (pickled message, the shared memory it refers to)
        self.arrived: list[str] = []  # the shared memory the message being read brought
        self.stopped = False

    @property
    def proc(self):
        """The worker's Popen (None before it starts)."""
        return None if self.child is None else self.child.proc

    def spec_for(self, spec: WorkerSpec) -> WorkerSpec:
        cores = None if self.slot is None else (board().path, self.slot)
        return attrs.evolve(spec, cores=cores, tag=next(self.tags))

    def attach(self, stage) -> None:
        """Host `stage` (its `spec` made by `spec_for`): start the process for the first, build it there for the
        others."""
        self.members[stage.spec.tag] = stage
        if self.proc is None:
            self.start()
        else:
            self.send(Build(stage.spec))
        stage.started = time.monotonic()

    def start(self) -> None:
        """Start the process with the first member's stage; the others are built there once it is ready."""
        first, *others = self.members.values()
        self.child, self.conn = start_worker(first.spec)
        self.conn.send(list(sys.path))  # so the worker imports what the front imports (plugins, test modules)
        self.conn.send(Build(first.spec))
        self.ready = False
        self.drop_backlog()
        for stage in others:
            self.send(Build(stage.spec))

    def detach(self, stage) -> None:
        """`stage` closed: dropped from the worker, which stops with the last of its stages."""
        if self.members.pop(stage.spec.tag, None) is None:
            return
        if self.members:
            if self.conn is not None:
                self.send(Drop(stage.spec.tag))
            return
        self.stop()

    def stop(self, timeout: float = 5.0) -> None:
        conn, process = self.conn, self.proc
        self.stopped = True
        self.conn = None
        if conn is not None:
            try:
                conn.send(Stop())
            except (OSError, ValueError):
                pass
        if process is not None:
            _end(process, timeout)
            self.child.close()
        if conn is not None:
            conn.close()
        if self.slot is not None:
            board().give_back(self.slot)
            self.slot = None
        self.drop_backlog()
        if self.on_stop is not None:
            self.on_stop(self)

    # Sending and receiving.

    def send(self, message) -> None:
        self.send_bytes(ForkingPickler.dumps(message))

    def send_bytes(self, data: bytes, fds: list | None = None) -> None:
        """Send a pickled message and the shared memory files it refers to (shared.py), which are closed here."""
        fds = fds or []
        if not self.ready:  # still building its first stage: a send must not block on a pipe no one reads yet
            self.backlog.append((data, fds))
            return
        try:
            shared.send(self.conn, data, fds)
        except (OSError, ValueError):
            self.pump()

    def drop_backlog(self) -> None:
        for _, fds in self.backlog:
            shared.close(fds)
        self.backlog = []

    def pump(self) -> None:
        """Take every message the worker sent so far, for whichever of its stages; notice a worker that died (its
        end of the pipe closed)."""
        conn = self.conn
        try:
            while self.conn is conn and conn is not None and conn.poll(0):
                data = conn.recv_bytes()
                try:
                    message = ForkingPickler.loads(data)
                except Exception as exc:  # noqa: BLE001 - not expected (worker.pack sends plain data): whose it
                    # was is unknown, so the worker is stopped and restarted as if it died, failing what it held
                    self.proc.kill()
                    self.died(f"stopped: the front could not read its message, {type(exc).__name__}: "
                              f"{' '.join(str(exc).split())}")
                    return
                if isinstance(message, Fds):  # the shared memory of the message that follows
                    self.arrived = message.names
                    shared.take_fds(conn, self.arrived)
                    continue
                self.receive(message)
                if not isinstance(message, Reply):  # a call's answer is loaded by its caller, later
                    shared.forget(self.arrived)  # what the message did not load (a dropped or unreadable event)
                self.arrived = []
        except (EOFError, OSError):
            if self.conn is conn and conn is not None:
                self.died()

    def receive(self, message) -> None:
        """The front's one dispatcher of what the worker sends."""
        if isinstance(message, Reply):
            self.replies[message.call_id] = message
            return
        stage = self.members.get(message.tag)
        if stage is None:  # closed meanwhile
            return
        match message:
            case Events(events=events, stats=stats):
                stage.on_events(events, stats)
            case Ready(kind=kind, concurrent_inputs=concurrent_inputs, stats=stats):
                stage.on_ready(kind, concurrent_inputs, stats)
                if not self.ready:
                    self._send_backlog()
            case Failed(error=error):
                stage.on_build_failed(rebuild(*error))

    def _send_backlog(self) -> None:
        """The first stage is built: what waited for it goes down the pipe."""
        self.ready = True
        conn, backlog, self.backlog = self.conn, self.backlog, []
        for index, (data, fds) in enumerate(backlog):
            if self.conn is not conn:  # it died meanwhile: died() failed what these were for
                self.backlog = backlog[index:]
                self.drop_backlog()
                break
            self.send_bytes(data, fds)

    def died(self, how: str | None = None) -> None:
        """The worker's pipe read EOF: its stages fail what they held; restart it if a stage is to be restarted."""
        how = how or self._exit_cause()
        self.child.close()
        shared.forget(self.arrived)
        self.arrived = []
        self.conn.close()
        self.conn = None
        self.ready = False
        if self.slot is not None:
            board().clear(self.slot)
        restart = [stage for stage in list(self.members.values()) if stage.on_worker_died(how)]
        self.members = {stage.spec.tag: stage for stage in restart}  # the dead, and those never built, leave
        if not self.members:
            self.stop()
            return
        self._restart(how)

    def _exit_cause(self) -> str:
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:  # it closed its pipe but lives on: stop it
            self.proc.kill()
            self.proc.wait()
        return self.child.cause()

    def _restart(self, how: str) -> None:
        try:
            self.start()
            for stage in self.members.values():
                stage.started = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - e.g. no file descriptors or memory left to start one
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()  # started, but died before it took its spec
            self.conn = None
            for stage in self.members.values():
                stage.on_not_restarted(how, exc)
            self.members.clear()
            self.stop()

    def wait(self, timeout: float | None) -> bool:
        """Block until the worker sent something (or died); False after `timeout`."""
        conn = self.conn
        if conn is None:
            return True
        try:
            ready = multiprocessing.connection.wait([conn], timeout)
        except (OSError, ValueError):  # closed meanwhile (close() from another thread)
            return True
        return bool(ready)


def _end(process: subprocess.Popen, timeout: float) -> None:
    """Wait for a worker told to stop; terminate, then kill, one that does not."""
    for stop in (None, process.terminate, process.kill):
        if stop is not None:
            stop()
        try:
            process.wait(timeout if stop is None else 2)
            return
        except subprocess.TimeoutExpired:
            continue
