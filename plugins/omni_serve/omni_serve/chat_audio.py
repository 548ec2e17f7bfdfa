"""Spoken chats on POST /v1/chat/completions: a pipeline whose outputs include a voice's audio (`ar_speech`,
`voice_chat`: a final node of kind "tts") answers with sound where the chat asks `modalities: ["text", "audio"]`
and `audio: {voice, format}`, and a pipeline that listens (an entry node of kind "asr": `voice_chat`) hears the
chat's `input_audio` part.

- Not streamed: `message.audio` holds `id`, `data` (base64 of the whole answer in `format`), `transcript` (the
  answer's text) and `expires_at`; `message.content` holds the text where `modalities` has "text", else null.
- Streamed: the text deltas as `delta.content`, as in any chat; the audio as `delta.audio` objects as OpenAI's
  service streams them (the spec's delta schema has no `audio` field): `{id, transcript}` with the text of each
  piece the voice speaks, when it has spoken it, and `{id, data}` with base64 of the encoded bytes as the encoder
  gives them (audio_encode.py); the last audio delta, before the finish chunk, holds `{id, expires_at}`.
- `expires_at` is the answer's creation time: the server keeps no audio for a later turn to refer to.
- `input_audio` (`{data: base64, format: wav|mp3}`) goes to the uploads folder as a file, the request's audio
  input, and is removed when the request ends. A pipeline that listens takes one user message holding one
  `input_audio` part and nothing else (what it hears is the AR stage's prompt).

Refused before any work (400, naming the field): `modalities` with "audio" on a pipeline that makes no audio,
`audio` missing where audio is asked (or given where it is not), an `input_audio` part to a pipeline that does
not listen, a chat to one that listens without one, data that is not base64; an unknown voice is the voice node's
own refusal, named `audio.voice`. Each spoken chat's time to its first audio is the histogram
`omni_chat_time_to_first_audio_seconds` (arrival to the first AudioDelta the route receives).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import struct
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from omni_kernel.events import AudioDelta, RequestFailed, RequestFinished, TokenDelta

from .audio_encode import Encoder
from .guards import until_disconnect
from .handlers import api_error
from .logprobs import chat_content, chat_entries
from .protocol import APIError, AudioPart, ChatCompletionRequest
from .routes_audio import DEFAULT_VOICE, OPENAI_VOICES
from .state import Served
from .text import FINISH, LatencyRecorder

ENCODINGS = {"wav": "wav", "aac": "aac", "mp3": "mp3", "flac": "flac", "opus": "opus", "pcm16": "pcm"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def node_of_kind(graph, kind: str, nodes) -> str | None:
    return next((n for n in nodes if getattr(graph.node_types.get(n), "kind", None) == kind), None)


def chat_modalities(graph) -> dict[str, Any]:
    """What a chat pipeline's model card says of its sound: `modalities` it answers in (["text", "audio"] where a
    final node speaks) and `input_audio` (whether it hears an input_audio part)."""
    speaks = node_of_kind(graph, "tts", graph.finals) is not None
    return {"modalities": ["text", "audio"] if speaks else ["text"],
            "input_audio": node_of_kind(graph, "asr", graph.entries()) is not None}


@attrs.define
class SpokenChat:
    """What one chat asks of a pipeline's sound: the node whose audio answers and in which encoding (None: a text
    answer), whether the text is asked too, what it hears (the upload's path) and the voice's parameter."""

    speaker: str | None
    encoding: str | None
    text: bool
    heard: Path | None = None
    heard_field: str = ""  # where the heard audio was in the request, for errors about it
    params: dict[str, Any] = attrs.Factory(dict)

    def discard(self) -> None:
        if self.heard is not None:
            self.heard.unlink(missing_ok=True)


def spoken_chat(body: ChatCompletionRequest, served: Served, name: str) -> SpokenChat | None:
    """The chat's audio asks, checked (400 naming the field); None for a chat that neither hears nor speaks."""
    graph = served.async_omni.omnis[name].graph
    listens = node_of_kind(graph, "asr", graph.entries()) is not None
    speaks = body.modalities is not None and "audio" in body.modalities
    if body.modalities is not None and not body.modalities:
        raise APIError(400, "invalid modalities: an empty list (give [\"text\"] or [\"text\", \"audio\"])",
                       "modalities", "invalid_value")
    if not speaks and not listens:
        if body.audio is not None:
            raise APIError(400, "invalid audio: only with modalities [\"text\", \"audio\"]", "audio", "invalid_value")
        refuse_heard(body, name)
        return None
    spoken = SpokenChat(None, None, body.modalities is None or "text" in body.modalities)
    if speaks:
        spoken.speaker = node_of_kind(graph, "tts", graph.finals)
        if spoken.speaker is None:
            raise APIError(400, f"invalid modalities: model {body.model!r} makes no audio (its answer is text)",
                           "modalities", "invalid_value")
        if body.audio is None:
            raise APIError(400, "invalid audio: Field required where modalities has \"audio\" ({voice, format})",
                           "audio", "invalid_value")
        spoken.encoding = ENCODINGS[body.audio.format]
        spoken.params = voice_param(served, name, spoken.speaker, body.audio.voice)
    elif body.audio is not None:
        raise APIError(400, "invalid audio: only with modalities [\"text\", \"audio\"]", "audio", "invalid_value")
    if listens:
        spoken.heard_field, data, fmt = heard_part(body, name)
        spoken.heard = served.jobs.uploads.save("heard-" + uuid.uuid4().hex[:24], data, f"input.{fmt}")
    else:
        refuse_heard(body, name)
    return spoken


def refuse_heard(body: ChatCompletionRequest, name: str) -> None:
    for i, m in enumerate(body.messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if isinstance(part, AudioPart):
                raise APIError(400, f"invalid messages[{i}].content[{j}]: model {body.model!r} does not listen; "
                                    "input_audio goes to a pipeline that hears (voice_chat)",
                               f"messages[{i}].content[{j}]", "invalid_value")


def heard_part(body: ChatCompletionRequest, name: str) -> tuple[str, bytes, str]:
    """(its field, the audio file's bytes, its format) of the one input_audio part a listening pipeline takes."""
    message = body.messages[0]
    parts = message.content if isinstance(message.content, list) else []
    if len(body.messages) != 1 or message.role != "user" or len(parts) != 1 or not isinstance(parts[0], AudioPart):
        raise APIError(400, f"invalid messages: model {body.model!r} listens: it takes one user message holding one "
                            "input_audio part ({data: base64, format: wav|mp3}) and nothing else", "messages",
                       "invalid_value")
    field = "messages[0].content[0].input_audio.data"
    try:
        data = base64.b64decode(parts[0].input_audio.data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"invalid {field}: not valid base64", field, "invalid_value") from None
    if not data:
        raise APIError(400, f"invalid {field}: empty", field, "invalid_value")
    return field, data, parts[0].input_audio.format


def voice_param(served: Served, name: str, speaker: str, voice: str | dict[str, str]) -> dict[str, Any]:
    """The voice node's `voice` parameter: an OpenAI built-in name the voice lacks means its default (none given);
    any other name goes to the node, which refuses one its model lacks."""
    if isinstance(voice, dict):
        if set(voice) != {"id"} or not isinstance(voice["id"], str):
            raise APIError(400, "invalid audio.voice: a voice name, or {\"id\": NAME}", "audio.voice", "invalid_value")
        voice = voice["id"]
    graph = served.async_omni.omnis[name].graph
    voices = tuple(graph.choices.get(speaker, {}).get("voice") or ())
    if voice in (*OPENAI_VOICES, DEFAULT_VOICE) and voice not in voices:
        return {}
    return {"voice": voice}


def about_chat(error: APIError, spoken: SpokenChat) -> APIError:
    """An error as the chat's client knows its fields: the voice is `audio.voice`, the heard audio its part's
    data (never the server's path)."""
    if error.param == "voice":
        error.param = "audio.voice"
        error.message = error.message.replace("invalid voice:", "invalid audio.voice:", 1)
    elif spoken.heard is not None and (error.param == "audio" or (error.param is None and "audio" in error.message)):
        error.param = spoken.heard_field
        for shown in (f"the audio file {str(spoken.heard)!r}", repr(str(spoken.heard)), str(spoken.heard)):
            error.message = error.message.replace(shown, "the input audio")
    error.args = (error.message,)
    return error


async def answer_spoken(request: Request, served: Served, body: ChatCompletionRequest, spoken: SpokenChat,
                        call: tuple[str, str, dict[str, Any]], arrival: float):
    """The spoken chat's answer, streamed or whole. `call`: (pipeline, prompt, request parameters)."""
    name, prompt, params = call
    rid = "chatcmpl-" + uuid.uuid4().hex[:24]
    inputs = {} if spoken.heard is None else {"audio": str(spoken.heard)}
    try:
        stream = await served.async_omni.open(name, prompt, request_id=rid, **inputs, **params, **spoken.params)
    except Exception as exc:  # noqa: BLE001 - mapped to its HTTP answer
        spoken.discard()
        raise about_chat(api_error(exc), spoken) from None
    answer = Answer(served, body, spoken, served.final(name), rid, arrival)
    if body.stream:
        return StreamingResponse(answer.sse(stream), media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        result = await until_disconnect(request, answer.collect(stream))
    finally:
        spoken.discard()
    if result is None:
        return Response(status_code=499)
    return await answer.whole(*result)


async def encode_whole(pcm: bytes, sample_rate: int, encoding: str) -> bytes:
    """PCM as one file in `encoding` (read while written: ffmpeg's output pipe would fill and stall it)."""
    encoder = await Encoder(encoding, sample_rate).start()

    async def read_all() -> bytes:
        parts = []
        while data := await encoder.read():
            parts.append(data)
        return b"".join(parts)

    reader = asyncio.ensure_future(read_all())
    try:
        await encoder.write(pcm)
        await encoder.end()
        data = await reader
    finally:
        reader.cancel()
        await asyncio.shield(encoder.close())
    return sized_wav(data) if encoding == "wav" else data


def sized_wav(data: bytes) -> bytes:
    """A whole WAV with its sizes in its header (the streamed header says "unknown length", which some decoders
    refuse: ffmpeg with -xerror, as omni's own speech input reads files)."""
    return data[:4] + struct.pack("<I", len(data) - 8) + data[8:40] + struct.pack("<I", len(data) - 44) + data[44:]


class Answer:
    """One spoken chat's answer: its text deltas, its audio, its metrics."""

    def __init__(self, served: Served, body: ChatCompletionRequest, spoken: SpokenChat, final: str, rid: str,
                 arrival: float):
        self.served, self.body, self.spoken, self.final, self.rid = served, body, spoken, final, rid
        self.recorder = LatencyRecorder(served.metrics, body.model, arrival)
        self.arrival = arrival
        self.created = int(time.time())
        self.audio_id = "audio_" + uuid.uuid4().hex[:24]
        self.heard_audio = False

    def audio_delta(self, event) -> bool:
        """Whether the event is the answer's audio (the first one's time goes into the metrics)."""
        if not isinstance(event, AudioDelta) or event.node_id != self.spoken.speaker:
            return False
        if not self.heard_audio:
            self.heard_audio = True
            self.served.metrics.chat_ttfa.labels(self.body.model).observe(time.perf_counter() - self.arrival)
        return True

    def text_delta(self, event) -> bool:
        if not isinstance(event, TokenDelta) or event.node_id != self.final:
            return False
        self.recorder.delta()
        return True

    async def collect(self, stream) -> tuple[list[AudioDelta], Any]:
        """The answer's audio and the request's last event."""
        audio: list[AudioDelta] = []
        async with stream:
            async for event in stream:
                self.text_delta(event)
                if self.audio_delta(event):
                    audio.append(event)
                elif isinstance(event, (RequestFinished, RequestFailed)):
                    return audio, event
        return audio, RequestFailed(stream.request_id, None, "aborted", "aborted")

    async def whole(self, audio: list[AudioDelta], finished) -> dict[str, Any]:
        if isinstance(finished, RequestFailed):
            raise about_chat(APIError.of_failure(finished.kind, finished.error, finished.field), self.spoken)
        out = finished.result
        self.recorder.done(out, "chat")
        text = out.text or ""
        message: dict[str, Any] = {"role": "assistant", "content": text if self.spoken.text else None,
                                   "refusal": None}
        if self.spoken.speaker is not None:
            pcm = b"".join(d.pcm for d in audio)
            rate = audio[0].sample_rate if audio else 22050
            data = await encode_whole(pcm, rate, self.spoken.encoding)
            message["audio"] = {"id": self.audio_id, "data": base64.b64encode(data).decode(), "transcript": text,
                                "expires_at": self.created}
        choice = {"index": 0, "finish_reason": FINISH[out.output.stop_reason or "eos"],
                  "logprobs": chat_content(chat_entries(out.output)) if self.body.logprobs else None,
                  "message": message}
        return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.body.model,
                "choices": [choice], "usage": self.recorder.usage(out)}

    def line(self, choices: list, **extra) -> str:
        body = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.body.model,
                "choices": choices, **extra}
        return "data: " + json.dumps(body, ensure_ascii=False) + "\n\n"

    def chunk(self, delta: dict, finish: str | None = None, logprobs=None) -> str:
        return self.line([{"index": 0, "delta": delta, "finish_reason": finish,
                           "logprobs": None if logprobs is None else chat_content(logprobs)}])

    async def sse(self, stream) -> AsyncIterator[str]:
        """The chat's chunks: the role, each text delta, each spoken piece's transcript and the encoded audio as it
        comes (`delta.audio`), the finish reason, the usage where asked, or an error event; then [DONE]."""
        pump = SoundPump(self, stream)
        sent = 0  # logprobs entries streamed
        try:
            yield self.chunk({"role": "assistant", "content": ""})
            async for kind, value in pump.items():
                if kind == "text" and self.spoken.text:
                    sent += len(value.logprobs or ())
                    yield self.chunk({"content": value.text}, logprobs=value.logprobs or None)
                elif kind == "spoken":
                    yield self.chunk({"audio": {"id": self.audio_id, "transcript": value.text}})
                elif kind == "data":
                    yield self.chunk({"audio": {"id": self.audio_id, "data": base64.b64encode(value).decode()}})
            for line in self.end(pump.last, sent):
                yield line
        finally:
            await pump.close()
            self.spoken.discard()
        yield "data: [DONE]\n\n"

    def end(self, last, sent: int) -> list[str]:
        if not isinstance(last, RequestFinished):
            failed = last if isinstance(last, RequestFailed) else RequestFailed(self.rid, None, "aborted", "aborted")
            error = about_chat(APIError.of_failure(failed.kind, failed.error, failed.field), self.spoken)
            return ["data: " + json.dumps(error.body()) + "\n\n"]
        out = last.result
        self.recorder.done(out, "chat")
        lines = []
        if self.spoken.speaker is not None:
            lines.append(self.chunk({"audio": {"id": self.audio_id, "expires_at": self.created}}))
        rest = chat_entries(out.output)[sent:]
        lines.append(self.chunk({}, FINISH[out.output.stop_reason or "eos"], logprobs=rest or None))
        if self.body.stream_options and self.body.stream_options.include_usage:
            lines.append(self.line([], usage=self.recorder.usage(out)))
        return lines


class SoundPump:
    """A streamed spoken chat's events and its encoder's bytes, merged in the order they come: ("text",
    TokenDelta), ("spoken", AudioDelta) and ("data", bytes); the request's last event is `last` once `items` ends
    (after the encoder's last byte)."""

    def __init__(self, answer: Answer, stream):
        self.answer, self.stream = answer, stream
        self.queue: asyncio.Queue = asyncio.Queue()
        self.encoder: Encoder | None = None
        self.tasks: list[asyncio.Future] = []
        self.last = None

    async def items(self) -> AsyncIterator[tuple[str, Any]]:
        self.tasks.append(asyncio.ensure_future(self._events()))
        open_ = {"events"}
        while open_:
            kind, value = await self.queue.get()
            if kind == "started":  # queued before the events end, and before the encoder's own end
                open_.add("audio")
            elif kind == "end":
                open_.discard(value)
            else:
                yield kind, value

    async def _events(self) -> None:
        try:
            async with self.stream:
                async for event in self.stream:
                    await self._event(event)
        finally:
            if self.encoder is not None:
                await self.encoder.end()
            self.queue.put_nowait(("end", "events"))

    async def _event(self, event) -> None:
        answer = self.answer
        if answer.text_delta(event):
            self.queue.put_nowait(("text", event))
        elif answer.audio_delta(event):
            if self.encoder is None:
                self.encoder = await Encoder(answer.spoken.encoding, event.sample_rate).start()
                self.queue.put_nowait(("started", None))
                self.tasks.append(asyncio.ensure_future(self._encoded()))
            self.queue.put_nowait(("spoken", event))
            await self.encoder.write(event.pcm)
        elif isinstance(event, (RequestFinished, RequestFailed)):
            self.last = event

    async def _encoded(self) -> None:
        try:
            while data := await self.encoder.read():
                self.queue.put_nowait(("data", data))
        finally:
            self.queue.put_nowait(("end", "audio"))

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.encoder is not None:
            await asyncio.shield(self.encoder.close())
