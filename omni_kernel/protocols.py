"""The contracts between layers, as typing Protocols (docs/plugins.md explains each method).

The kernel's own classes satisfy them (Stage; StepScheduler, DiffusionScheduler, ARScheduler); a plugin
brings its ModelRunner and may bring its own implementation of any other layer as long as it keeps the contract.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from .request import Request, StageInput, StageOutput


@runtime_checkable
class Scheduler(Protocol):
    """Owns each request's progress: which requests run this step, and when each one is finished."""

    def add(self, item: StageInput) -> None: ...
    def schedule(self) -> Any: ...  # a SchedulerOutput, falsy when nothing runs
    # A RequestOutput per request that got a result; a request absent from `results` failed: keep nothing of it.
    def update(self, batch: Any, results: Mapping[str, Any], step_ms: float = 0.0) -> list: ...
    def abort(self, request_id: str) -> None: ...
    def has_unfinished(self) -> bool: ...
    def request_ids(self) -> set[str]: ...


@runtime_checkable
class ModelRunner(Protocol):
    """A model family's code. It keeps per-request model state (KV cache, latents) keyed by request id."""

    def add_request(self, item: StageInput) -> None: ...  # a processed input; raise for one it cannot take
    def run(self, batch: Any) -> Mapping[str, Any]: ...  # a result (or exception) per request id
    def free(self, request_id: str) -> None: ...  # a no-op for an id it never received


@runtime_checkable
class Stage(Protocol):
    """One graph node: input processing (once per request), an Engine, output processing."""

    node_id: str
    kind: str

    def check(self, item: StageInput) -> None: ...  # downstream nodes, at submit: cheap, no model
    def process(self, item: StageInput) -> StageInput: ...  # once per request; raises UserError
    def add_request(self, item: StageInput) -> None: ...  # a failure comes back as a StageFailed event
    def step(self) -> list: ...
    def abort(self, request_id: str) -> None: ...
    def has_unfinished(self) -> bool: ...
    def request_ids(self) -> set[str]: ...
    def wait(self, timeout: float | None = None) -> bool: ...  # block until a step would make progress


@runtime_checkable
class Connector(Protocol):
    """Turns a finished stage output (plus the original request) into the next stage's input. Converts only."""

    name: str
    source_kind: str
    target_kind: str

    def convert(self, output: StageOutput, request: Request) -> StageInput: ...
