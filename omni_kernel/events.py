"""Events yielded while requests run. Stages emit the first four; the StageScheduler adds the last two."""

from __future__ import annotations

import attrs

from .request import RequestResult, StageOutput


@attrs.frozen
class TokenDelta:
    """New text of a streaming stage; always whole UTF-8 characters."""

    request_id: str
    node_id: str
    text: str


@attrs.frozen
class StageProgress:
    """A long stage advanced (e.g. one denoise step of `total`)."""

    request_id: str
    node_id: str
    step: int
    total: int
    phase: str = "step"


@attrs.frozen
class StageFinished:
    request_id: str
    node_id: str
    output: StageOutput


@attrs.frozen
class StageFailed:
    """One request failed inside one stage. `user_error` marks a mistake in the input (exit 2 / 4xx)."""

    request_id: str
    node_id: str
    error: str
    user_error: bool = False


@attrs.frozen
class RequestFinished:
    request_id: str
    result: RequestResult


@attrs.frozen
class RequestFailed:
    request_id: str
    node_id: str | None
    error: str
    user_error: bool = False


Event = TokenDelta | StageProgress | StageFinished | StageFailed | RequestFinished | RequestFailed
