"""What crosses between a stage's worker (a process or a Ray actor) and the front.

Requests, events and stage outputs, as plain data pickled over a local Pipe between the runtime's own processes (never
anything read from a network socket); the messages are messages.py's. The worker pickles each event, and a call's
answer, on its own inside its message (`pack`), so one the front cannot unpickle fails its own request or call. Between
a worker process and the front, arrays and tensors (latents, frames, embeddings) cross through shared memory (shared.py:
`fds` collects the memory files a message refers to); a Ray actor's cross inside the pickle. Torch-free: numpy and torch
are touched only if a message holds their arrays.
"""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler

import attrs

from omni_kernel.events import StageFailed

from . import shared
from .messages import Events, Reply, Sealed


def pack(message, node_id: str, fds: list | None = None):
    """The message as it crosses: an `Events`'s events each `Sealed` (pickled with its request id) and a `Reply`'s
    value pickled, on their own, so one that cannot be pickled here (an output holding a lock) or unpickled in the
    front (a class only the worker has) fails its own request or call, and the message around it always crosses.
    Other messages are plain data, as they are."""
    match message:
        case Reply(ok=ok, data=value):
            ok, data = pack_answer(ok, value, node_id, fds)
            return attrs.evolve(message, ok=ok, data=data)
        case Events(events=events):
            sealed = tuple(Sealed(event.request_id, pack_event(event, node_id, fds)) for event in events)
            return attrs.evolve(message, events=sealed)
    return message


def pack_event(event, node_id: str, fds: list | None = None) -> bytes:
    """`event` pickled (its arrays in shared memory files added to `fds`, if given)."""
    try:
        return dumps(event, fds)
    except Exception as exc:  # noqa: BLE001 - this request only
        return dumps(StageFailed(event.request_id, node_id, unsendable(node_id, "output", exc), "runtime"))


def pack_answer(ok: bool, value, node_id: str, fds: list | None = None) -> tuple[bool, bytes]:
    """A call's (ok, value or error) with the value pickled; one that cannot be is the call's error instead."""
    try:
        return ok, dumps(value, fds)
    except Exception as exc:  # noqa: BLE001 - the caller gets the error instead of waiting forever
        return False, dumps(("runtime", unsendable(node_id, "processed input", exc), None))


def unsendable(node_id: str, what: str, exc: Exception) -> str:
    return f"stage {node_id!r}: its {what} could not be sent to the front ({type(exc).__name__}: {exc})"


def dumps(value, fds: list | None = None) -> bytes:
    """`value` pickled; with `fds`, its large arrays in shared memory (shared.dumps)."""
    if fds is not None:
        return shared.dumps(value, fds)
    return bytes(ForkingPickler.dumps(value))
