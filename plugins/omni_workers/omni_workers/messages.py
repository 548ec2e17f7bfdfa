"""Every message between the front and a stage's worker (a worker process, or a Ray actor), as attrs classes.

The front sends `Build`, `Submit`, `Check`, `HandOff`, `Append`, `Abort`, `Drop` and `Stop`; the worker answers a call
(`Submit`, `Check`) with a `Reply` of the same `call_id` and sends `Ready` or `Failed` for each stage it builds and
`Events` after each step that made events or changed its stage's stats. `tag` names one stage of the worker (a
worker hosts every stage of one share key). `Fds` precedes a message whose arrays cross in shared memory
(shared.py), in either direction. `Add` only passes between the threads of a worker.

Each side has one dispatcher, a `match` on these classes: `worker.EngineLoop.handle` in a worker process,
`StageActor._dispatch` in a Ray actor (its remote `handle` only chooses now or queued), `WorkerProcess.receive` in
the front (a Ray stage reads its actor's replies and events directly). What a message carries is plain data; an
event and a reply's value are pickled on their own (`Sealed`, `Reply.data`: transport.py), so one that cannot be
pickled or unpickled fails its own request or call and the message around it always crosses; for the same reason
the front seals the input it sends a Ray actor.
"""

from __future__ import annotations

from typing import Any

import attrs

from omni_kernel.core.request import StageStats

# The front to the worker.


@attrs.frozen
class Build:
    """Build this stage (a worker's first, or another of its share key, in the same plugin host)."""

    spec: Any  # a stage_host.WorkerSpec


@attrs.frozen
class Submit:
    """Process a request's input and add it to the engine; answered by a Reply once processed (the error: a
    UserError raised in the front). A failure to add comes back as the request's StageFailed event."""

    tag: int
    call_id: int
    item: Any  # StageInput (a Ray actor's: Sealed)


@attrs.frozen
class Check:
    """Check a downstream node's input at submit (model-free): answered by a Reply at once, beside any step."""

    tag: int
    call_id: int
    item: Any  # StageInput (a Ray actor's: Sealed)


@attrs.frozen
class HandOff:
    """Process and add an upstream stage's output; a failure comes back as the request's StageFailed event."""

    tag: int
    item: Any  # StageInput (a Ray actor's: Sealed)


@attrs.frozen
class Append:
    """The next chunk of a request's streamed input (a streaming edge's StreamChunk), for the request a stream
    hand-off opened; the worker's stage takes it (`Stage.append`). A failure comes back as the request's
    StageFailed event. Sent as the source's events arrive in the front, each on its own, never waited for."""

    tag: int
    chunk: Any  # StreamChunk (a Ray actor's: Sealed)


@attrs.frozen
class Abort:
    tag: int
    request_id: str


@attrs.frozen
class Drop:
    """The stage closed in the front: abort its requests and forget it (the worker stops with its last stage)."""

    tag: int


@attrs.frozen
class Stop:
    """Stop the worker."""


# The worker to the front.


@attrs.frozen
class Reply:
    """A call's answer: `ok` and its value (None for Submit and Check), or its error as `errors.classify` gives
    it, pickled (transport.pack_answer)."""

    call_id: int
    ok: bool
    data: Any  # the value or the classified error; bytes once packed


@attrs.frozen
class Events:
    """A stage's events from one step (or from a hand-off that failed), and its stats when they changed (None:
    unchanged). The events are event objects in the worker and `Sealed` once packed."""

    tag: int
    events: tuple = ()
    stats: StageStats | None = None


@attrs.frozen
class Ready:
    """The stage is built: its kind, whether its inputs may be processed beside a step, its first stats."""

    tag: int
    kind: str
    concurrent_inputs: bool
    stats: StageStats


@attrs.frozen
class Failed:
    """The stage could not be built: the error as `errors.classify` gives it (the front raises it, typed)."""

    tag: int
    error: tuple


# Either way.


@attrs.frozen
class Sealed:
    """A value pickled on its own, with the request it belongs to: an event (transport.pack_event), or the input
    the front sends a Ray actor (so one the actor cannot read fails that request alone)."""

    request_id: str
    data: bytes


@attrs.frozen
class Fds:
    """The shared memory files the next message refers to (shared.py); their descriptors follow on the socket."""

    names: list


# Between a worker's threads.


@attrs.frozen
class Add:
    """A submitted input, processed, for the engine loop (a Ray actor's engine thread) to add between two steps,
    before any message that came after its Submit."""

    tag: int
    item: Any
