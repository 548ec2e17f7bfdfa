"""Events yielded while requests run. Stages emit the first five; the StageScheduler adds the last two."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

import attrs

from omni_kernel.core.errors import USER_KINDS, ErrorKind, OmniError, classify, rebuild
from omni_kernel.core.request import RequestResult, StageOutput

# Why a stage finished a request (StageOutput.stop_reason): an AR stage at EOS, a stop string, its token budget or the
# context window; a step-scheduled stage after its last step.
StopReason = Literal["eos", "stop", "max_tokens", "context_window", "done"]
STOP_REASONS: tuple[str, ...] = get_args(StopReason)
TRUNCATED_STOP_REASONS = frozenset({"max_tokens", "context_window"})  # cut off, not done: the text may be partial


@attrs.frozen
class TokenDelta:
    """New text of a streaming stage; always whole UTF-8 characters. For a request that asked for logprobs:
    `logprobs`, the entries of the tokens behind this text (those whose text is held back come with a later delta
    or only in the StageOutput's data), and `prompt_logprobs`, the prompt's, once. An entry is OpenAI's chat shape
    plus the token's id: {"token_id", "token", "logprob", "bytes", "top_logprobs": [{"token_id", "token",
    "logprob", "bytes"}]}; the prompt's first entry has `logprob` None. None: the request did not ask."""

    request_id: str
    node_id: str
    text: str
    logprobs: tuple[Mapping[str, Any], ...] | None = None
    prompt_logprobs: tuple[Mapping[str, Any], ...] | None = None


@attrs.frozen
class AudioDelta:
    """New sound of a streaming audio stage, in order: one chunk (e.g. one sentence) as 16-bit signed little-endian
    mono PCM at `sample_rate`; `text` is what it speaks, where the stage knows ("" otherwise)."""

    request_id: str
    node_id: str
    pcm: bytes = attrs.field(repr=lambda pcm: f"<{len(pcm)} bytes>")
    sample_rate: int
    text: str = ""

    @property
    def seconds(self) -> float:
        return len(self.pcm) // 2 / self.sample_rate


@attrs.frozen
class StageProgress:
    """A long stage advanced (e.g. one denoise step of `total`)."""

    request_id: str
    node_id: str
    step: int
    total: int
    phase: str = "step"
    from_cache: bool | None = None  # the step's model calls were served from a step cache (None: no cache)


@attrs.frozen
class StageFinished:
    request_id: str
    node_id: str
    output: StageOutput


@attrs.frozen
class StageFailed:
    """One request failed inside one stage. `kind` says whose fault it is (see errors.ErrorKind)."""

    request_id: str
    node_id: str | None
    error: str
    kind: ErrorKind = "runtime"
    field: str | None = None

    @classmethod
    def of(cls, request_id: str, node_id: str | None, exc: BaseException):
        kind, message, field = classify(exc)
        return cls(request_id, node_id, message, kind, field)

    @property
    def user_error(self) -> bool:
        return self.kind in USER_KINDS

    def exception(self) -> OmniError:
        return rebuild(self.kind, self.error, self.field)


@attrs.frozen
class RequestFinished:
    request_id: str
    result: RequestResult


@attrs.frozen
class RequestFailed(StageFailed):
    """The request failed: in stage `node_id`, in a connector, or (node_id None) aborted by the caller."""
