"""The contracts between layers, as typing Protocols. Every layer is step-driven: add, step, abort, has work.

The kernel's own classes (Stage, Engine, RequestScheduler, StepScheduler, ARScheduler, ModelRunner) satisfy
them; a plugin may bring its own implementation of any layer as long as it keeps the contract.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from .request import Request, StageInput, StageOutput
from .scheduler import SchedulerOutput


@runtime_checkable
class Scheduler(Protocol):
    """Decides which requests of one engine run this step."""

    def add(self, item: StageInput) -> None: ...
    def schedule(self) -> SchedulerOutput: ...
    def update(self, done, results: Mapping[str, Any] | None = None) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def has_unfinished(self) -> bool: ...


@runtime_checkable
class Executor(Protocol):
    """A model family's executor. It owns per-request model state (KV cache, latents) keyed by request id."""

    def add_request(self, item: StageInput) -> None:
        """Accept a request (tokenize, validate); raise UserError for bad input."""

    def execute(self, batch: SchedulerOutput) -> Any:
        """Run one step for every request in the batch; return events (ending a request with StageFinished),
        or a RunnerOutput when the scheduler needs results back (e.g. sampled token ids)."""

    def free(self, request_id: str) -> None:
        """Drop everything held for the request; called on finish, failure and abort."""


@runtime_checkable
class ModelRunner(Protocol):
    def add_request(self, item: StageInput) -> list: ...
    def execute(self, batch: SchedulerOutput) -> Any: ...
    def free(self, request_id: str) -> None: ...


@runtime_checkable
class Engine(Protocol):
    """step() = schedule -> run -> update; returns the step's events."""

    def add_request(self, item: StageInput) -> None: ...
    def step(self) -> list: ...
    def abort(self, request_id: str) -> None: ...
    def has_unfinished(self) -> bool: ...


@runtime_checkable
class Stage(Protocol):
    """One graph node: an Engine plus the node's policy."""

    node_id: str
    kind: str

    def check(self, request: Request) -> None: ...
    def add_request(self, item: StageInput) -> None: ...
    def step(self) -> list: ...
    def abort(self, request_id: str) -> None: ...
    def has_unfinished(self) -> bool: ...


@runtime_checkable
class Connector(Protocol):
    """Turns a finished stage output (plus the original request) into the next stage's input. Converts only."""

    name: str
    source_kind: str
    target_kind: str

    def convert(self, output: StageOutput, request: Request) -> StageInput: ...
