"""The worker side of `process` placement: the child process that rebuilds one stage and runs its engine loop
continuously, and the spilling of large arrays to files (see workers.py for the whole design)."""

from __future__ import annotations

import collections
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from multiprocessing.reduction import ForkingPickler
from typing import Any

import attrs

from omni_kernel.errors import PluginError, classify
from omni_kernel.events import StageFailed, StageFinished
from omni_kernel.graph import NodeSpec
from omni_kernel.placement import RunSettings, check_placement_nodes, parse_placement  # noqa: F401 - re-exported
from omni_kernel.request import StageInput

from .cores import SHARED, CoreShare, set_threads

log = logging.getLogger("omni")

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
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
    parent_pid: int = attrs.field(factory=os.getpid)


def default_host_factory() -> Callable[[], Any]:
    """Rebuilds the front's plugins in a worker: `load_host()` under the OMNI_PLUGINS the front had."""
    from omni_kernel.plugins import ALLOWLIST_ENV, load_host

    return partial(load_host, os.environ.get(ALLOWLIST_ENV))


@attrs.frozen
class Held:
    """Marks a processed input that stays in the worker; add_request picks it up there by request id."""

    request_id: str


@attrs.frozen
class Spilled:
    """An array of StageOutput.data written to a .npy file; `torch` says to hand it back as a torch tensor."""

    path: str
    torch: bool = False


# The worker side.


def build_stage(spec: WorkerSpec):
    """Rebuild the plugins quietly (the front already reported their warnings) and call the node's factory."""
    logger = logging.getLogger("omni")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        host = spec.host_factory()
    finally:
        logger.setLevel(level)
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


def die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when the process that started it dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - the getppid poll is the fallback
        pass


def spill(events: list, spill_dir: str | None) -> list:
    """Arrays in StageFinished outputs' data go to .npy files; everything else crosses as it is."""
    if spill_dir is None:
        return events
    out = []
    for event in events:
        if isinstance(event, StageFinished) and event.output.data is not None:
            event = attrs.evolve(event, output=attrs.evolve(event.output, data=_spill(event.output.data, spill_dir)))
        out.append(event)
    return out


def _spill(value, spill_dir: str):
    if isinstance(value, dict):
        return {k: _spill(v, spill_dir) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_spill(v, spill_dir) for v in value)
    module = type(value).__module__
    if module == "numpy" and hasattr(value, "dtype") and hasattr(value, "shape"):
        return _save(value, spill_dir, False)
    if module.startswith("torch") and hasattr(value, "detach"):
        return _save(value.detach().cpu().numpy(), spill_dir, True)
    return value


def _save(array, spill_dir: str, torch: bool) -> Spilled:
    import numpy as np

    path = os.path.join(spill_dir, f"{uuid.uuid4().hex}.npy")
    np.save(path, array, allow_pickle=False)
    return Spilled(path, torch)


def unspill(event):
    """An event with its output's spilled arrays loaded (and their files deleted)."""
    if isinstance(event, StageFinished) and event.output.data is not None:
        event = attrs.evolve(event, output=attrs.evolve(event.output, data=_unspill(event.output.data)))
    return event


def _unspill(value):
    if isinstance(value, dict):
        return {k: _unspill(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_unspill(v) for v in value)
    if isinstance(value, Spilled):
        import numpy as np

        try:
            array = np.load(value.path, allow_pickle=False)
        finally:
            try:
                os.unlink(value.path)
            except OSError:
                pass
        if value.torch:
            import torch

            return torch.from_numpy(array)
        return array
    return value


class StageHost:
    """A stage driven by messages, the same in a worker process and in a Ray actor: the RPCs (process, check),
    add_request with a held processed input, abort, and one engine step that never raises."""

    def __init__(self, stage, node_id: str):
        self.stage = stage
        self.node_id = node_id
        self.held: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self.dead_sent = False

    def process(self, item: StageInput) -> StageInput:
        out = self.stage.process(item)
        self.held[item.request_id] = out.processed
        self.held.move_to_end(item.request_id)
        while len(self.held) > HELD_LIMIT:
            self.held.popitem(last=False)
        return attrs.evolve(out, processed=Held(item.request_id))

    def check(self, item: StageInput) -> None:
        self.stage.check(item)

    def add(self, item: StageInput) -> list:
        """Events at once only when the input is lost; otherwise the stage reports through its own steps."""
        if isinstance(item.processed, Held):
            if item.request_id not in self.held:
                return [StageFailed(item.request_id, self.node_id, f"stage {self.node_id!r} lost the processed input "
                                                                   "of this request", "runtime")]
            item = attrs.evolve(item, processed=self.held.pop(item.request_id))
        try:
            self.stage.add_request(item)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            return [StageFailed.of(item.request_id, self.node_id, exc)]
        return []

    def hand_off(self, item: StageInput) -> list:
        """Process then add a downstream input; a processing error fails that request alone, as an event."""
        try:
            item = self.stage.process(item)
        except Exception as exc:  # noqa: BLE001 - this request only
            return [StageFailed.of(item.request_id, self.node_id, exc)]
        return self.add(item)

    def abort(self, request_id: str) -> None:
        self.held.pop(request_id, None)
        self.stage.abort(request_id)

    def step(self) -> list:
        try:
            return self.stage.step()
        except Exception as exc:  # noqa: BLE001 - as the StageScheduler does in-process
            log.error("stage %s failed: %s: %s", self.node_id, type(exc).__name__, exc, exc_info=exc)
            held = sorted(self.stage.request_ids())
            for rid in held:
                self.stage.abort(rid)
            return [StageFailed.of(rid, self.node_id, exc) for rid in held]

    def newly_dead(self) -> str | None:
        dead = getattr(getattr(self.stage, "engine", None), "dead", None)
        if dead is not None and not self.dead_sent:
            self.dead_sent = True
            return str(dead)
        return None


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
    """A stage worker process: build the stage, then its engine loop until told to stop or the parent is gone."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_worker(spec)
    outbox: queue.Queue = queue.Queue()
    sender = threading.Thread(target=_send_loop, args=(conn, outbox, spec.node.id), name="omni-worker-send",
                              daemon=True)
    sender.start()
    try:
        stage = build_stage(spec)
        set_torch_threads(spec.threads)
    except BaseException as exc:  # noqa: BLE001 - the front raises it, typed
        outbox.put(("failed", *classify(exc)))
        outbox.put(None)
        sender.join(10)
        return
    outbox.put(("ready", stage.kind))
    host = StageHost(stage, spec.node.id)
    share = CoreShare(*spec.cores) if spec.cores else None
    _engine_loop(conn, outbox, host, spec.parent_pid, spec.spill_dir, share)
    outbox.put(None)
    sender.join(5)


def _send_loop(conn, outbox: queue.Queue, node_id: str = "?") -> None:
    """Sends from a thread, so the engine loop keeps reading its inbox while the front is slow to read."""
    while (message := outbox.get()) is not None:
        try:
            data = ForkingPickler.dumps(pack(message, node_id))
        except Exception as exc:  # noqa: BLE001 - ready / failed / dead are plain data: not expected
            log.error("stage %r: a %r message could not be sent to the front (%s: %s)", node_id, message[0],
                      type(exc).__name__, exc)
            continue
        try:
            conn.send_bytes(data)
        except (OSError, EOFError, ValueError):
            os._exit(0)  # the front is gone


def pack(message, node_id: str):
    """Each event (with its request id) and a call's answer pickled on their own, so one that cannot be pickled
    here (an output holding a lock) or unpickled in the front (a class only the worker has) fails its own request
    or call, and the message around it always crosses."""
    if message[0] == "reply":
        _, call_id, ok, value = message
        return ("reply", call_id, *pack_answer(ok, value, node_id))
    if message[0] != "events":
        return message
    return ("events", [(event.request_id, pack_event(event, node_id)) for event in message[1]])


def pack_event(event, node_id: str) -> bytes:
    try:
        return dumps(event)
    except Exception as exc:  # noqa: BLE001 - this request only
        return dumps(StageFailed(event.request_id, node_id, unsendable(node_id, "output", exc), "runtime"))


def pack_answer(ok: bool, value, node_id: str) -> tuple[bool, bytes]:
    """A call's (ok, value or error) with the value pickled; one that cannot be is the call's error instead."""
    try:
        return ok, dumps(value)
    except Exception as exc:  # noqa: BLE001 - the caller gets the error instead of waiting forever
        return False, dumps(("runtime", unsendable(node_id, "processed input", exc), None))


def unsendable(node_id: str, what: str, exc: Exception) -> str:
    return f"stage {node_id!r}: its {what} could not be sent to the front ({type(exc).__name__}: {exc})"


def dumps(value) -> bytes:
    return bytes(ForkingPickler.dumps(value))


def _read_loop(conn, inbox: queue.Queue, outbox: queue.Queue, host: StageHost) -> None:
    """Reads the front's messages as they come: `check` (model-free by contract) is answered at once, not after
    the running step; everything else goes to the engine loop, which takes it between two steps."""
    try:
        while True:
            message = conn.recv()
            if message[0] == "check":
                outbox.put(_handle(host, message))
                continue
            inbox.put(message)
            if message[0] == "stop":
                return
    except (EOFError, OSError):  # the front closed its end
        inbox.put(("stop",))
    except Exception as exc:  # noqa: BLE001 - a message it cannot unpickle: whose it was is unknown, so the
        # worker exits (the front fails what it held and restarts it) instead of leaving every request unanswered
        log.error("stage %s: its worker could not read a message from the front and stops: %s: %s", host.node_id,
                  type(exc).__name__, exc)
        os._exit(1)


def _engine_loop(conn, outbox: queue.Queue, host: StageHost, parent_pid: int, spill_dir: str | None,
                 share: CoreShare | None = None) -> None:
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_read_loop, args=(conn, inbox, outbox, host), name="omni-worker-read",
                     daemon=True).start()
    checked = time.monotonic()
    while True:
        if time.monotonic() - checked > 1.0:
            checked = time.monotonic()
            if os.getppid() != parent_pid:
                return
        busy = host.stage.has_unfinished()
        if share is not None and not busy:
            share.idle()
        try:
            message = inbox.get_nowait() if busy else inbox.get(timeout=1.0)
        except queue.Empty:
            message = None
        while message is not None:
            if message[0] == "stop":
                return
            if share is not None and message[0] in ("process", "hand_off"):
                share.before_step()  # input processing is work too (a Wan request encodes its image)
            reply = _handle(host, message)
            if reply is not None:
                outbox.put(reply)
            try:
                message = inbox.get_nowait()
            except queue.Empty:
                message = None
        if host.stage.has_unfinished() and (host.stage.wait(0) or host.stage.wait(WAIT_S)):
            if share is not None:
                share.before_step()
            events = host.step()
            if share is not None and not host.stage.has_unfinished():
                share.idle()  # lend the cores before the events go out
            if events:
                outbox.put(("events", spill(events, spill_dir)))
            if (dead := host.newly_dead()) is not None:
                outbox.put(("dead", dead))


def _handle(host: StageHost, message):
    kind = message[0]
    if kind in ("add", "hand_off"):
        events = host.add(message[1]) if kind == "add" else host.hand_off(message[1])
        return ("events", events) if events else None
    if kind == "abort":
        host.abort(message[1])
        return None
    if kind in ("process", "check"):
        _, call_id, item = message
        try:
            value = host.process(item) if kind == "process" else host.check(item)
        except Exception as exc:  # noqa: BLE001 - raised again in the front, typed
            return ("reply", call_id, False, classify(exc))
        return ("reply", call_id, True, value)
    log.warning("unknown message %r", kind)
    return None


# The front side.

