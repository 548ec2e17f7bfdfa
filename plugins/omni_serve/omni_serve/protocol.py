"""The OpenAI request bodies the server reads (pydantic) and the errors it answers with.

Only the shape is checked here; the values (ranges, stop strings, message roles, sizes) are checked by the
pipeline's node types through their declared request parameters, so the server and `omni run` refuse the
same things with the same messages. A field the server does not know is passed on as a request parameter and
refused by the kernel (400, naming it) unless a node of the pipeline declares it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

# Request parameters a client never sets: the server owns where files go and how text is delivered.
SERVER_OWNED = frozenset({"output", "stream", "return_frames", "profile", "messages", "prompt"})
# OpenAI fields accepted at their neutral value (and refused otherwise, naming the field).
NEUTRAL = {"n": (None, 1), "user": None, "logit_bias": (None, {}),
           "parallel_tool_calls": None, "service_tier": None, "store": None, "metadata": None}

KIND_STATUS = {"invalid_parameter": 400, "bad_input": 400, "user": 400, "model": 422, "runtime": 500,
               "engine_dead": 503, "unavailable": 503, "aborted": 503}
STATUS_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "service_unavailable", 507: "server_error"}


class APIError(Exception):
    """An OpenAI-style error answer: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or STATUS_TYPE.get(status, "invalid_request_error")
        self.retry_after = retry_after  # seconds, sent as Retry-After (a stage restarting, the server full)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def of_failure(cls, kind: str, message: str, field: str | None = None) -> APIError:
        """A failed request (StageFailed kind) as an HTTP error."""
        return cls(KIND_STATUS.get(kind, 500), message, field, kind)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class InputAudio(BaseModel):
    model_config = ConfigDict(extra="forbid")
    data: str = Field(description="base64 of the audio file")
    format: Literal["wav", "mp3"]


class AudioPart(BaseModel):
    """Speech a pipeline that listens hears (omni_serve.chat_audio)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["input_audio"]
    input_audio: InputAudio


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart | AudioPart] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(_Open):
    model: str
    max_tokens: int | None = Field(None, description="most new tokens")
    max_completion_tokens: int | None = Field(None, description="most new tokens (OpenAI's newer name)")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, description="extension: sample from the k most likely tokens (-1: off)")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    ignore_eos: bool | None = Field(None, description="extension: keep generating past EOS")
    presence_penalty: float | None = Field(None, description="-2..2, over the tokens generated so far")
    frequency_penalty: float | None = Field(None, description="-2..2, times each token's count in the output so far")
    repetition_penalty: float | None = Field(None, description="extension (vLLM's): > 0, over the prompt's and "
                                                               "output's tokens (1: off)")
    min_p: float | None = Field(None, description="extension (vLLM's): 0..1, drop tokens less likely than min_p "
                                                  "times the most likely one")


class ChatAudio(BaseModel):
    model_config = ConfigDict(extra="forbid")
    voice: str | dict[str, str]
    format: Literal["wav", "aac", "mp3", "flac", "opus", "pcm16"]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] | None = None  # with "audio": a spoken answer (omni_serve.chat_audio)
    audio: ChatAudio | None = None
    logprobs: StrictBool | None = None  # omni_serve.logprobs
    top_logprobs: StrictInt | None = None


class CompletionRequest(SamplingFields):
    # OpenAI's four forms: a text, several texts, one prompt as token ids, several prompts as token ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: StrictInt | None = None  # omni_serve.logprobs
    echo: StrictBool | None = None


class VideoJob(BaseModel):
    id: str
    object: Literal["video"] = "video"
    status: Literal["queued", "in_progress", "completed", "failed"]
    progress: int
    model: str
    prompt: str | None = None
    size: str | None = None
    seconds: str = ""
    remixed_from_video_id: str | None = None
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict[str, Any] | None = None
