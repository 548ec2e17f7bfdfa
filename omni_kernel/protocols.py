"""The contracts between layers, as typing Protocols. Every layer is step-driven: add, step, abort, has work.

The kernel's own classes satisfy them (Stage; Engine; StepScheduler, DiffusionScheduler, ARScheduler); a plugin
brings its ModelRunner and may bring its own implementation of any other layer as long as it keeps the contract.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from .request import Request, StageInput, StageOutput


@runtime_checkable
class Scheduler(Protocol):
    """Owns each request's progress: decides which requests run this step and when each one is finished."""

    def add(self, item: StageInput) -> None: ...
    def schedule(self) -> Any:
        """A SchedulerOutput (falsy when nothing runs this step)."""
    def update(self, batch: Any, results: Mapping[str, Any], step_ms: float = 0.0) -> list:
        """Advance what ran; return a RequestOutput per request that got a result (`finished` set when done).
        A request absent from `results` failed: nothing of its step may be kept."""
    def abort(self, request_id: str) -> None: ...
    def has_unfinished(self) -> bool: ...
    def request_ids(self) -> set[str]: ...


@runtime_checkable
class ModelRunner(Protocol):
    """A model family's code. It keeps per-request model state (KV cache, latents) keyed by request id."""

    def add_request(self, item: StageInput) -> None:
        """Accept a processed input; raise for one it cannot take."""

    def run(self, batch: Any) -> Mapping[str, Any]:
        """One batched step: a result per request id, or an exception for a request that failed alone."""

    def free(self, request_id: str) -> None:
        """Drop everything held for the request; a no-op for an id it never received."""


@runtime_checkable
class Stage(Protocol):
    """One graph node: input processing (once per request), an Engine, output processing."""

    node_id: str
    kind: str

    def check(self, item: StageInput) -> None:
        """Cheap early refusal of a downstream node's input at submit (no model, no full decode)."""
    def process(self, item: StageInput) -> StageInput:
        """Input processing, once per request: returns the input with `processed` set; raises UserError."""
    def add_request(self, item: StageInput) -> None:
        """Take a processed input; a failure is reported as a StageFailed event by a later step."""
    def step(self) -> list: ...
    def abort(self, request_id: str) -> None: ...
    def has_unfinished(self) -> bool: ...
    def request_ids(self) -> set[str]: ...
    def wait(self, timeout: float | None = None) -> bool:
        """Block until a step would make progress (or timeout); True if it would."""


@runtime_checkable
class Connector(Protocol):
    """Turns a finished stage output (plus the original request) into the next stage's input. Converts only."""

    name: str
    source_kind: str
    target_kind: str

    def convert(self, output: StageOutput, request: Request) -> StageInput: ...
