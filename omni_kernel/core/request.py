"""Requests, stage inputs and outputs: the values that cross layers."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from typing import Any

import attrs

from omni_kernel.core.errors import InvalidParameter


def _new_id() -> str:
    return uuid.uuid4().hex[:16]


def _as_dict(value) -> dict[str, Any]:
    return dict(value or {})


def _require_prompt(instance, attribute, value) -> None:
    if not isinstance(value, str):
        raise InvalidParameter("prompt", "must be text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: invalid UTF-8 bytes in argv arrive as these
        raise InvalidParameter("prompt", "is not valid UTF-8 text") from None


def _as_audio(value) -> str | bytes | None:
    if value is None or isinstance(value, (str, bytes)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise InvalidParameter("audio", "must be a file's path or its bytes")


def _short_audio(value) -> str:
    """An uploaded file's bytes are not printed in a repr: its size is."""
    return f"<{len(value)} bytes>" if isinstance(value, bytes) else repr(value)


@attrs.frozen
class Request:
    """What a user asks a pipeline for. `params` is one flat mapping of request parameters; the StageScheduler
    routes each key to the nodes whose node type declares it and refuses keys that none declares. `image` and
    `audio` are the request's inputs besides the prompt (a path; an audio input may also be the file's bytes, as
    uploaded), refused where no node of the pipeline reads them (NodeType.inputs)."""

    pipeline: str
    prompt: str = attrs.field(validator=_require_prompt)
    image: str | None = None
    audio: str | bytes | None = attrs.field(default=None, converter=_as_audio, repr=_short_audio)
    params: Mapping[str, Any] = attrs.field(factory=dict, converter=_as_dict)
    request_id: str = attrs.field(factory=_new_id)
    arrival_time: float = attrs.field(factory=time.time)


@attrs.frozen
class StageInput:
    """What one stage receives for one request: built from the Request, or by a connector. `params` is the
    node's own params instance (filled in by the StageScheduler); `processed` is what the stage's input
    processing made of it (token ids, a decoded image), computed once."""

    request_id: str
    prompt: str
    image: str | None = None
    audio: str | bytes | None = attrs.field(default=None, converter=_as_audio, repr=_short_audio)
    params: Any = None
    trace: Mapping[str, Any] = attrs.field(factory=dict, converter=_as_dict)
    processed: Any = attrs.field(default=None, eq=False, repr=False)
    # The input comes in chunks (a streaming edge's: StreamChunk, Stage.append) after this opening, whose prompt is
    # "" and not the text the stage works on.
    stream: bool = False
    arrival_time: float | None = None  # the Request's (time.time()), which the StageScheduler fills in


@attrs.frozen
class Piece:
    """What a streaming edge's connector cut from its source's stream (its splitter's `feed` and `end`): text, or
    data of the connector's own; the StageScheduler sends it on as the next StreamChunk."""

    text: str = ""
    data: Any = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class StreamChunk:
    """One chunk of a streaming edge's input for one request, as the edge's connector cut it from what its source
    stage streamed: the `index`-th (0, 1, ...) for the stage `node_id`; `last` says the source finished and no chunk
    follows (its text may be ""). A plain value (what `data` holds is the connector's, picklable), so it can cross
    a process boundary as it is."""

    request_id: str
    node_id: str
    index: int
    text: str = ""
    data: Any = attrs.field(default=None, eq=False, repr=False)
    last: bool = False


@attrs.frozen
class Usage:
    """What one stage's request consumed and produced, in the units a client is billed in (omni serve's OpenAI
    `usage`): its prompt tokens (`cached_tokens` of them served from a prefix cache), its generated tokens, and
    seconds of audio. None: the stage does not count it."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    audio_seconds: float | None = None


@attrs.frozen
class Structured:
    """The constraint a stage's text was decoded under: its `kind` (json_schema, json_object, regex, choice) and, for
    the request that compiled its grammar, the compile time (None: compiled before)."""

    kind: str
    compile_ms: float | None = None


@attrs.frozen
class VideoInfo:
    """A rendered video as it was written: a video stage's StageOutput holds it under `data["video"]` (VIDEO)."""

    width: int
    height: int
    num_frames: int
    fps: float

    @property
    def seconds(self) -> float:
        return self.num_frames / self.fps


VIDEO = "video"  # the key of a video stage's VideoInfo in its StageOutput's data


@attrs.frozen
class Audio:
    """Sound as a stage made or heard it: 16-bit signed little-endian mono PCM at `sample_rate` samples a second.
    An audio stage's StageOutput holds its whole Audio under `data["audio"]` (AUDIO)."""

    pcm: bytes = attrs.field(repr=lambda pcm: f"<{len(pcm)} bytes>")
    sample_rate: int

    @property
    def samples(self) -> int:
        return len(self.pcm) // 2

    @property
    def seconds(self) -> float:
        return self.samples / self.sample_rate


AUDIO = "audio"  # the key of an audio stage's Audio in its StageOutput's data


@attrs.frozen
class Segment:
    """A stretch of a transcript with its times in the audio, in seconds from the start."""

    start: float
    end: float
    text: str


SEGMENTS = "segments"  # the key of a speech-to-text stage's segments (a tuple of Segment) in its StageOutput's data


@attrs.frozen
class StageOutput:
    """A stage's finished result for one request. `trace` keys are already `stage.field`; `data` is a mapping of
    the stage's own values (a video stage's VideoInfo under VIDEO, an audio stage's Audio under AUDIO, a
    transcript's Segments under SEGMENTS). `usage` and `structured` are what a stage that counts tokens or decodes
    under a grammar says of the request (None: it says nothing)."""

    request_id: str
    node_id: str
    text: str | None = None
    path: str | None = None
    data: Any = attrs.field(default=None, eq=False, repr=False)
    stop_reason: str | None = None
    contract: str | None = None
    trace: Mapping[str, Any] = attrs.field(factory=dict, converter=_as_dict)
    usage: Usage | None = None
    structured: Structured | None = None


@attrs.frozen
class RequestResult:
    """A finished request: the final node's output, every node's output, and the merged trace. A pipeline that
    names several outputs (several final nodes, `finals`, in plan order) has the first as `output`; `final_outputs`
    holds each of them."""

    request_id: str
    pipeline: str
    output: StageOutput
    outputs: Mapping[str, StageOutput]
    trace: Mapping[str, Any]
    finals: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    @property
    def final_outputs(self) -> dict[str, StageOutput]:
        """Each output of the pipeline by its node id (the one `output` where it names one)."""
        finals = self.finals or (self.output.node_id,)
        return {node_id: self.outputs.get(node_id, self.output) for node_id in finals}

    @property
    def text(self) -> str | None:
        return self.output.text

    @property
    def path(self) -> str | None:
        return self.output.path

    def to_json(self) -> dict[str, Any]:
        from omni_kernel.core.trace import jsonable

        body: dict[str, Any] = {"request_id": self.request_id, "pipeline": self.pipeline,
                                "output": _output_json(self.output)}
        if len(self.finals) > 1:  # several outputs: each by its node, the first also as `output`
            body["outputs"] = {node_id: _output_json(out) for node_id, out in self.final_outputs.items()}
        if self.output.stop_reason is not None:
            body["stop_reason"] = self.output.stop_reason
        body["trace"] = jsonable(dict(self.trace))
        return body


def _output_json(output: StageOutput) -> dict[str, Any]:
    body: dict[str, Any] = {"path": output.path} if output.path is not None else {"text": output.text}
    data = output.data if isinstance(output.data, Mapping) else {}
    if SEGMENTS in data:  # a transcript's times: what `omni run --json` adds for speech to text
        body["segments"] = [attrs.asdict(segment) for segment in data[SEGMENTS]]
    return body


@attrs.frozen
class StageStats:
    """What a stage reports of itself (`Stage.stats()`, published by `omni serve` on /metrics and /health): its
    requests running and waiting, its KV blocks where it has a paged pool, whether its engine is dead, the counters
    its model keeps (`model`: name -> count, e.g. Wan's step-cache hits; /metrics exports each as `omni_<name>`),
    and what its placement adds (`placed`: an attrs value of the placement plugin's, e.g. omni-workers' restarts
    and replicas; None in this process)."""

    running: int = 0
    waiting: int = 0
    kv_blocks_total: int | None = None
    kv_blocks_used: int | None = None
    prefix_hit_tokens: int | None = None
    dead: str | None = None
    model: Mapping[str, int | float] = attrs.field(factory=dict, converter=_as_dict)
    placed: Any = None
