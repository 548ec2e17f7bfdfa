"""The contracts between layers, as typing Protocols (docs/plugins.md explains each method).

A stage is the kernel's `Stage` (stage.py), assembled from a plugin's three parts: an InputProcessor, an Engine
over the plugin's Scheduler (or one of the kernel's) and ModelRunner, and an OutputProcessor. The proxies of
stage workers (omni_workers) implement the same Stage contract over a pipe.

A streaming edge (docs/architecture.md, "Streaming edges") adds three: its connector's Splitter cuts the source's
streamed events into pieces, the target stage takes each as a StreamChunk (StreamStage), its input processor
adds it to the request's input (StreamInputs) and its scheduler counts the steps it adds (StreamScheduler).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from omni_kernel.core.request import Piece, Request, StageInput, StageOutput, StageStats, StreamChunk


@runtime_checkable
class Scheduler(Protocol):
    """Owns each request's record and progress: which requests run this step, and when each one is finished."""

    def add(self, item: StageInput) -> Any: ...  # the new request's record (with `item`, `state`, `output`)
    def schedule(self) -> Any: ...  # a SchedulerOutput (with the records), falsy when nothing runs
    # A RequestOutput per request that got a result; a request absent from `results` failed: keep nothing of it.
    def update(self, batch: Any, results: Mapping[str, Any], step_ms: float = 0.0) -> list: ...
    def collect(self) -> list: ...  # RequestOutputs of work that ended beside the steps (a background export)
    def abort(self, request_id: str) -> Any: ...  # the removed record, or None
    def has_unfinished(self) -> bool: ...
    def request_ids(self) -> set[str]: ...
    def wait(self, timeout: float | None = None) -> bool: ...  # block until a step would make progress
    def stats(self) -> StageStats: ...


@runtime_checkable
class ModelRunner(Protocol):
    """A model family's code. It keeps per-request model state in the record's `state` slot."""

    def add_request(self, record: Any) -> None: ...  # raise for a request it cannot take
    def run(self, batch: Any) -> Mapping[str, Any]: ...  # a result (or exception) per request id
    def free(self, record: Any) -> None: ...  # release what the request holds outside its record


@runtime_checkable
class InputProcessor(Protocol):
    """What a stage makes of a request's input, once, before its engine sees it: no model, only its tokenizer or
    config. `concurrent`: `process` reads nothing a step changes, so a stage worker may run it beside a step."""

    concurrent: bool

    def check(self, item: StageInput) -> None: ...  # downstream nodes, at submit: cheap; raises UserError
    def process(self, item: StageInput) -> StageInput: ...  # sets `processed`; raises UserError


@runtime_checkable
class OutputProcessor(Protocol):
    """Turns the engine's RequestOutputs into events (token deltas, progress, StageFinished, StageFailed).
    `process` also returns the ids of requests it stops itself (a stop string); the stage aborts them."""

    def add(self, record: Any) -> None: ...  # a request the engine took; may set `record.output`
    def process(self, outputs: list) -> tuple[list, list[str]]: ...


@runtime_checkable
class Stepped(Protocol):
    """An engine, local or remote, as the StageScheduler steps it once per round: an in-process stage's Engine
    (shared by the stages built on it; its step returns RequestOutputs), or a placed stage's handle on the engine
    in its worker (its step returns the events the worker made there)."""

    def step(self) -> list: ...  # RequestOutputs (an Engine) or events (a placed stage's), each with a request_id
    def has_unfinished(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...  # block until a step would make progress


@runtime_checkable
class Stage(Protocol):
    """One graph node, in this process (the kernel's Stage) or placed elsewhere behind a proxy (a worker, an
    actor). The StageScheduler steps its `engine` and hands it the outputs of its own requests (`events_for`).

    `submit` and `hand_off` each process the input and add it to the engine, in one call: `submit` (a request's
    entry node) raises a processing error (a UserError) in its caller; `hand_off` (an upstream stage's output)
    reports any failure as the request's StageFailed event. `concurrent_inputs`: the stage's inputs may be
    processed beside a step of its engine (its InputProcessor's `concurrent`). `dead`: why the stage takes no
    more requests (its engine died, its worker could not be restarted), or None; the one answer to "is this stage
    dead?", which its `stats()` report too. A placed stage whose worker is restarting waits for it in `check` and
    `submit`, or raises StageUnavailable at once where its placement was built to fail fast (`RunSettings`)."""

    node_id: str
    kind: str
    concurrent_inputs: bool
    engine: Stepped

    @property
    def dead(self) -> str | None: ...
    def check(self, item: StageInput) -> None: ...  # a downstream node's input at submit: model-free; raises
    def submit(self, item: StageInput) -> None: ...  # process + add; raises a processing error (UserError)
    def hand_off(self, item: StageInput) -> None: ...  # process + add; a failure comes back as a StageFailed event
    def events_for(self, outputs: list) -> list: ...  # this stage's events from its requests' step outputs
    def abort(self, request_id: str) -> None: ...
    def wait_ready(self, timeout: float | None = None) -> None: ...  # block until built (a worker loads)
    def stats(self) -> StageStats: ...


@runtime_checkable
class Connector(Protocol):
    """Turns a finished stage output (plus the original request) into the next stage's input. Converts only."""

    name: str
    source_kind: str
    target_kind: str

    def convert(self, output: StageOutput, request: Request) -> StageInput: ...


@runtime_checkable
class StreamStage(Protocol):
    """A stage that takes a streamed input: after a hand-off whose StageInput has `stream` set, each chunk of that
    request's input, in order, the last with `last` set. A failure comes back as the request's StageFailed."""

    def append(self, chunk: StreamChunk) -> None: ...


@runtime_checkable
class StreamInputs(Protocol):
    """An input processor that takes a streamed input: the request's processed input with the next chunk added
    (model-free, as `process`); raises for a chunk it cannot take (the request fails)."""

    def extend(self, item: StageInput, chunk: StreamChunk) -> StageInput: ...


@runtime_checkable
class StreamScheduler(Protocol):
    """A scheduler whose requests may be open (their input streams in): `extend(item)` gives one its input with the
    next chunk; it counts its steps again and, after the `last`, finishes it once they are done. Returns the
    record, or None for a request it does not hold."""

    def extend(self, request_id: str, extend: Callable[[StageInput], StageInput], last: bool) -> Any: ...


@runtime_checkable
class Splitter(Protocol):
    """One request's cutter of a streaming edge (its connector's `splitter(request)`): `feed` gets each event the
    source stage streams for the request (its own kinds: token deltas, audio, ...), `end` the source's finished
    output; each returns the pieces now complete, in order."""

    def feed(self, event: Any) -> list[Piece]: ...
    def end(self, output: StageOutput) -> list[Piece]: ...


@runtime_checkable
class StreamConnector(Connector, Protocol):
    """A connector that can stream: a Splitter per request decides the chunk boundaries (`convert` still serves the
    edge where it does not stream)."""

    def splitter(self, request: Request) -> Splitter: ...
