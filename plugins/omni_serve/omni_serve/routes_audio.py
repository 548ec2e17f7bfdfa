"""OpenAI's audio API: POST /v1/audio/speech (text to speech, streamed), POST /v1/audio/transcriptions (speech to
text, multipart) and GET /v1/audio/voices (an extension: the voices each speech pipeline speaks with).

A speech pipeline is one whose final node's kind is "tts": its AudioDelta events are encoded as they come
(audio_encode.py) and sent as a chunked body (`stream_format` "audio", the default) or as `speech.audio.delta`
events (`stream_format` "sse"). A transcription pipeline is one whose entry node's kind is "asr": the uploaded file
goes to disk as it arrives and its path is the request's audio input; the node decodes it (any format ffmpeg
reads) and refuses what is not speech. Nothing here knows a model: the voices are the values of the tts node's
`voice` request option, as its node type names them for the built model (NodeType.choices, kept on the graph:
StageGraph.choices; the first is the default), else as the option declares them (its choices, else its default);
where none are named the one listed is "default", the model's own voice. OpenAI's built-in voice names (alloy, ash,
...) and "default" mean the pipeline's default voice unless the pipeline has a voice of that name; any other name
goes to the node, which refuses one its model lacks, naming the voices it has.

As everywhere in omni serve, values are checked by the node types through their declared request parameters
(empty text, text over 4,096 characters, an unknown voice, speed outside 0.25-4, a file that is not audio: 400
before any model work); a field no node declares is refused, naming the valid ones.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import attrs
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.datastructures import FormData

from omni_kernel.core.params import OptionInfo, parse
from omni_kernel.core.request import AUDIO, SEGMENTS, Audio
from omni_kernel.core.request import Request as OmniRequest
from omni_kernel.events import AudioDelta, RequestFailed, RequestFinished, TokenDelta

from .audio_encode import MEDIA_TYPES, Encoder
from .guards import until_disconnect
from .handlers import api_error
from .protocol import SERVER_OWNED, APIError
from .state import Served, ServedDep
from .uploads import StoredFile, StreamedForm

router = APIRouter()
# OpenAI's built-in voices: each means the pipeline's default voice (unless the pipeline has a voice so named).
OPENAI_VOICES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
                 "shimmer", "verse")
DEFAULT_VOICE = "default"  # the model's own voice, where the node does not declare its voices' names
TRANSCRIPT_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
SEGMENT_FORMATS = ("srt", "verbose_json", "vtt")  # the formats that show the segments' times
# The transcription form's OpenAI fields, read by name; every other field is a declared request option.
TRANSCRIPTION_FIELDS = ("file", "model", "language", "prompt", "response_format", "temperature",
                        "timestamp_granularities", "timestamp_granularities[]", "stream", "include", "include[]",
                        "chunking_strategy")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SpeechRequest(BaseModel):
    """CreateSpeechRequest; any other field is a request option a node of the pipeline declares (e.g. `seed`)."""

    model_config = ConfigDict(extra="allow")
    model: str
    input: str
    voice: str | dict[str, str]
    instructions: str | None = None
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float | None = None
    stream_format: Literal["audio", "sse"] = "audio"


# --- voices ----------------------------------------------------------------------------------------------------


def voices_of(served: Served, name: str) -> tuple[tuple[str, ...], str | None]:
    """The voices of a speech pipeline's final node and its default voice (None: the node picks its model's own):
    the values its built model has (StageGraph.choices, the default first), else its `voice` option's declared
    choices or default."""
    graph = served.async_omni.omnis[name].graph
    info = served.options(name).get("voice")
    if info is None:
        return (), None
    built = tuple(getattr(graph, "choices", {}).get(graph.final, {}).get("voice") or ())
    if built:
        return built, built[0]
    params = getattr(graph.node_types.get(graph.final), "params", None)
    field = attrs.fields_dict(params).get("voice") if params is not None else None
    default = field.default if field is not None and isinstance(field.default, str) else None
    choices = tuple(info.choices or ())
    return choices or ((default,) if default else ()), default or (choices[0] if choices else None)


def voice_param(served: Served, name: str, voice: str | dict[str, str]) -> dict[str, Any]:
    """The `voice` request parameter of a request's voice: an OpenAI built-in name the pipeline lacks means its
    default (no parameter: the node's default)."""
    if isinstance(voice, dict):
        if set(voice) != {"id"} or not isinstance(voice["id"], str):
            raise APIError(400, "invalid voice: a voice name, or {\"id\": NAME}", "voice", "invalid_value")
        voice = voice["id"]
    voices, _ = voices_of(served, name)
    if "voice" not in served.options(name):
        if voice in (*OPENAI_VOICES, DEFAULT_VOICE):
            return {}
        raise APIError(400, f"invalid voice: {voice!r}; model {name!r} has one voice (use one of OpenAI's names, "
                            f"e.g. 'alloy')", "voice", "invalid_value")
    if voice in (*OPENAI_VOICES, DEFAULT_VOICE) and voice not in voices:
        return {}
    return {"voice": voice}


@router.get("/v1/audio/voices")
async def list_voices(served: ServedDep):
    """Each speech pipeline's voices; its default voice lists the OpenAI names that mean it."""
    data = []
    for model, name in served.names.items():
        if served.kinds[name] != "speech":
            continue
        voices, default = voices_of(served, name)
        for voice in voices or (DEFAULT_VOICE,):
            entry = {"id": voice, "object": "voice", "model": model, "default": voice == default or not voices}
            if entry["default"]:
                entry["aliases"] = [v for v in OPENAI_VOICES if v not in voices]
            data.append(entry)
    return {"object": "list", "data": data}


# --- speech ------------------------------------------------------------------------------------------------------


def extra_params(extra: dict[str, Any], options: dict[str, OptionInfo], model: str,
                 known: tuple[str, ...]) -> dict[str, Any]:
    """A request's fields beyond OpenAI's, each a request option the pipeline declares (text values parsed by the
    option's type)."""
    params: dict[str, Any] = {}
    for key, value in extra.items():
        name = key.removesuffix("[]")
        if name in SERVER_OWNED or name == "response_format":
            raise APIError(400, f"invalid {name}: set by the server, not by a request", name, "invalid_value")
        info = options.get(name)
        if info is None:
            valid = sorted({*known, *(options.keys() - SERVER_OWNED - {"response_format"})})
            raise APIError(400, f"invalid {name}: model {model!r} has no field {name!r}; valid fields: "
                                f"{', '.join(valid)}", name, "invalid_value")
        if value is not None and value != "":
            params[name] = parse(name, info, value) if isinstance(value, str) and info.type is not str else value
    return params


@attrs.define
class Outcome:
    """How a streamed speech request ended: its RequestFinished or RequestFailed (None while it runs)."""

    finished: RequestFinished | None = None
    failed: RequestFailed | None = None


@router.post("/v1/audio/speech")
async def speech(request: Request, body: SpeechRequest, served: ServedDep):
    arrival = time.perf_counter()
    name = served.resolve(body.model, "speech")
    if body.instructions:
        raise APIError(400, f"invalid instructions: model {body.model!r} takes no instructions", "instructions",
                       "invalid_value")
    options = served.options(name)
    params = extra_params(body.model_extra or {}, options, body.model, tuple(SpeechRequest.model_fields))
    params.update(voice_param(served, name, body.voice))
    if body.speed is not None:
        if "speed" not in options:
            raise APIError(400, f"invalid speed: model {body.model!r} speaks at one speed", "speed", "invalid_value")
        params["speed"] = body.speed
    rid = "speech-" + uuid.uuid4().hex[:24]
    try:
        stream = await served.async_omni.open(name, body.input, request_id=rid, **params)
    except Exception as exc:  # noqa: BLE001 - mapped to its HTTP answer
        raise about_input(api_error(exc)) from None
    final = served.final(name)
    try:
        first = await until_disconnect(request, first_audio(stream, final))
    except APIError as exc:
        raise about_input(exc) from None
    if first is None:
        await stream.aclose()
        return Response(status_code=499)
    served.metrics.ttfa.labels(body.model).observe(time.perf_counter() - arrival)
    outcome = Outcome(finished=first[1])
    chunks = encoded(first[0], stream, final, body.response_format, outcome)
    done = Recorded(served, body.model, arrival, outcome)
    if body.stream_format == "sse":
        return StreamingResponse(speech_events(chunks, outcome, done), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    return StreamingResponse(audio_body(chunks, outcome, done), media_type=MEDIA_TYPES[body.response_format],
                             headers={"Cache-Control": "no-cache"})


def about_input(error: APIError) -> APIError:
    """An error about the text as the client knows it: its field is `input` (the pipeline's prompt)."""
    if error.param == "prompt" or (error.param is None and error.code == "bad_input"):
        error.param = "input"
        error.message = error.message.replace("invalid prompt:", "invalid input:", 1).replace("the prompt",
                                                                                               "the input", 1)
        error.args = (error.message,)
    return error


async def first_audio(stream, final: str) -> tuple[Audio, RequestFinished | None]:
    """The request's first sound (a failure before it is the HTTP error it deserves); a stage that sends its audio
    only at the end (no AudioDelta) gives its whole Audio, with the request's end."""
    async for event in stream:
        if isinstance(event, AudioDelta) and event.node_id == final:
            return Audio(event.pcm, event.sample_rate), None
        if isinstance(event, RequestFailed):
            raise APIError.of_failure(event.kind, event.error, event.field)
        if isinstance(event, RequestFinished):
            audio = (event.result.output.data or {}).get(AUDIO)
            if not isinstance(audio, Audio):
                raise APIError(500, f"internal error: the final node {final!r} made no audio", None, "internal_error")
            return audio, event
    raise APIError(503, "the request ended before any audio", None, "aborted")


async def feed(encoder: Encoder, stream, final: str, outcome: Outcome) -> None:
    """The request's later sound into the encoder, in order; the encoder's input ends with the request."""
    try:
        if outcome.finished is not None:
            return
        async for event in stream:
            if isinstance(event, AudioDelta) and event.node_id == final:
                if event.sample_rate != encoder.sample_rate:
                    outcome.failed = RequestFailed(event.request_id, final, "the stage changed its sample rate "
                                                   "mid-stream", "runtime")
                    return
                await encoder.write(event.pcm)
            elif isinstance(event, RequestFinished):
                outcome.finished = event
            elif isinstance(event, RequestFailed):
                outcome.failed = event
        if outcome.finished is None and outcome.failed is None:
            outcome.failed = RequestFailed(stream.request_id, None, "aborted", "aborted")
    finally:
        await encoder.end()


async def encoded(first: Audio, stream, final: str, fmt: str, outcome: Outcome) -> AsyncIterator[bytes]:
    """The encoded bytes of the request's sound as they come; closing it early (the client left) aborts the
    request and stops the encoder."""
    encoder = await Encoder(fmt, first.sample_rate).start()
    pump = None
    try:
        await encoder.write(first.pcm)
        pump = asyncio.ensure_future(feed(encoder, stream, final, outcome))
        while chunk := await encoder.read():
            yield chunk
        await pump
    finally:
        if pump is not None and not pump.done():
            pump.cancel()
        await stream.aclose()
        # shielded: a response cancelled (the client left) still reaps its encoder, not the next subprocess made
        await asyncio.shield(encoder.close())


class Recorded:
    """The end of a speech request in the metrics, once."""

    def __init__(self, served: Served, model: str, arrival: float, outcome: Outcome):
        self.served, self.model, self.arrival, self.outcome = served, model, arrival, outcome

    def __call__(self) -> None:
        metrics = self.served.metrics
        metrics.e2e.labels(self.model, "speech").observe(time.perf_counter() - self.arrival)
        if self.outcome.finished is not None:
            spoken = audio_seconds(self.outcome.finished.result)
            metrics.audio.labels(self.model, "speech").inc(spoken)


class SpeechFailed(RuntimeError):
    """A speech request failed after its first bytes were sent: the body is cut (no last chunk), so the client
    sees an incomplete answer rather than a short file."""


async def audio_body(chunks: AsyncIterator[bytes], outcome: Outcome, done: Recorded) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        yield chunk
    if outcome.failed is not None:
        raise SpeechFailed(outcome.failed.error)
    done()


def audio_seconds(result) -> float:
    """The seconds of audio a finished request's stages say they spoke or heard (Usage.audio_seconds)."""
    return sum(out.usage.audio_seconds or 0.0 for out in result.outputs.values() if out.usage is not None)


def speech_usage(result) -> dict[str, Any]:
    """speech.audio.done's usage: the tokens the stages count (0 where they count none), and the seconds spoken."""
    counted = [out.usage for out in result.outputs.values() if out.usage is not None]
    prompt = sum(u.input_tokens or 0 for u in counted)
    output = sum(u.output_tokens or 0 for u in counted)
    return {"input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output,
            "audio_seconds": round(audio_seconds(result), 3)}


def event_line(body: dict[str, Any]) -> str:
    return "data: " + json.dumps(body, ensure_ascii=False) + "\n\n"


async def speech_events(chunks: AsyncIterator[bytes], outcome: Outcome, done: Recorded) -> AsyncIterator[str]:
    """`speech.audio.delta` events (base64 of the encoded bytes as they come), then `speech.audio.done` with the
    usage, or an error event."""
    async for chunk in chunks:
        yield event_line({"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode()})
    if outcome.failed is not None:
        failed = outcome.failed
        yield event_line({"type": "error", **APIError.of_failure(failed.kind, failed.error, failed.field).body()})
        return
    done()
    yield event_line({"type": "speech.audio.done", "usage": speech_usage(outcome.finished.result)})


# --- transcriptions ----------------------------------------------------------------------------------------------


def form_text(form: FormData, key: str) -> str | None:
    value = form.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise APIError(400, f"invalid {key}: a file where a text value belongs", key, "invalid_value")
    return value


def audio_file(form: FormData) -> StoredFile:
    upload = form.get("file")
    if upload is None or upload == "":
        raise APIError(400, "invalid file: Field required (the audio file to transcribe)", "file", "invalid_value")
    if not isinstance(upload, StoredFile):
        raise APIError(400, "invalid file: a text value where the audio file belongs", "file", "invalid_value")
    return upload


def granularities(form: FormData) -> bool:
    """Whether segments with times were asked for; words are not available: refused, naming what is."""
    values = [v for key in ("timestamp_granularities[]", "timestamp_granularities") for v in form.getlist(key)]
    for value in values:
        if value not in ("segment", "word"):
            raise APIError(400, f"invalid timestamp_granularities: {value!r} is not segment or word",
                           "timestamp_granularities", "invalid_value")
        if value == "word":
            raise APIError(400, "invalid timestamp_granularities: word timestamps are not available; segments have "
                                "their times (response_format verbose_json)", "timestamp_granularities",
                           "invalid_value")
    return "segment" in values


def read_transcription_form(form: FormData, served: Served, name: str, model: str) -> tuple[dict, str, str, bool]:
    """(request parameters, prompt, response_format, stream) of a transcription form."""
    options = served.options(name)
    fmt = form_text(form, "response_format") or "json"
    if fmt not in TRANSCRIPT_FORMATS:
        raise APIError(400, f"invalid response_format: {fmt!r} is not one of {', '.join(TRANSCRIPT_FORMATS)}",
                       "response_format", "invalid_value")
    stream_text = form_text(form, "stream") or "false"
    if stream_text.lower() not in ("true", "false"):
        raise APIError(400, f"invalid stream: {stream_text!r} is not true or false", "stream", "invalid_value")
    for key in ("include", "include[]"):
        if form.getlist(key):
            raise APIError(400, "invalid include: logprobs are not available for transcriptions", "include",
                           "invalid_value")
    chunking = form_text(form, "chunking_strategy")
    if chunking not in (None, "auto"):
        raise APIError(400, "invalid chunking_strategy: only 'auto' (30-second windows)", "chunking_strategy",
                       "invalid_value")
    segments = granularities(form) or fmt in SEGMENT_FORMATS
    # a node that decodes times only when asked (Whisper's timestamp tokens) is asked where the answer shows them
    params: dict[str, Any] = {"timestamps": True} if segments and "timestamps" in options else {}
    prompt = form_text(form, "prompt") or ""
    if prompt and "prompt" in options:
        params["prompt"], prompt = prompt, ""
    for key in ("language", "temperature"):
        value = form_text(form, key)
        if value is None:
            continue
        if key not in options:
            raise APIError(400, f"invalid {key}: model {model!r} takes no {key}", key, "invalid_value")
        params[key] = parse(key, options[key], value)
    extra = {k: form_text(form, k) for k in dict.fromkeys(form.keys()) if k not in TRANSCRIPTION_FIELDS}
    params.update(extra_params(extra, options, model, TRANSCRIPTION_FIELDS))
    return params, prompt, fmt, stream_text.lower() == "true"


@router.post("/v1/audio/transcriptions")
async def transcriptions(request: Request, served: ServedDep):
    folder = served.jobs.uploads.folder
    async with StreamedForm(request, folder) as form:  # the file goes to disk as it comes
        model = form_text(form, "model")
        if model is None:
            raise APIError(400, "invalid model: Field required", "model", "invalid_value")
        name = served.resolve(model, "transcription")
        upload = audio_file(form)
        params, prompt, fmt, stream = read_transcription_form(form, served, name, model)
        rid = "transcript-" + uuid.uuid4().hex[:24]
        path = served.jobs.uploads.adopt(rid, upload)
    return await transcribe(request, served, model, name, path, (params, prompt, fmt, stream), rid)


async def transcribe(request: Request, served: Served, model: str, name: str, path: Path,
                     asked: tuple[dict, str, str, bool], rid: str):
    params, prompt, fmt, stream_asked = asked
    arrival = time.perf_counter()
    omni = served.async_omni.omnis[name]
    try:
        item = OmniRequest(omni.graph.name, prompt, audio=str(path), params=params, request_id=rid)
        stream = await served.async_omni.open_request(name, item)
    except Exception as exc:  # noqa: BLE001 - mapped to its HTTP answer
        path.unlink(missing_ok=True)
        raise about_file(api_error(exc), path) from None
    final = served.final(name)
    if stream_asked:
        return StreamingResponse(transcript_events(stream, final, path, served, model, arrival),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        finished = await until_disconnect(request, last_event(stream))
    finally:
        path.unlink(missing_ok=True)
    if finished is None:
        return Response(status_code=499)
    if isinstance(finished, RequestFailed):
        raise about_file(APIError.of_failure(finished.kind, finished.error, finished.field), path)
    transcribed(served, model, arrival, finished.result)
    return transcript_answer(finished.result, fmt, params.get("language"))


def transcribed(served: Served, model: str, arrival: float, result) -> None:
    served.metrics.e2e.labels(model, "transcriptions").observe(time.perf_counter() - arrival)
    served.metrics.audio.labels(model, "transcriptions").inc(audio_seconds(result))


def about_file(error: APIError, path: Path) -> APIError:
    """An error about the upload as the client knows it: its field `file`, never the server's path."""
    message = error.message.replace("invalid audio:", "invalid file:", 1)
    for shown in (f"the audio file {str(path)!r}", f"the audio {str(path)!r}", repr(str(path)), str(path)):
        message = message.replace(shown, "the uploaded file")
    about_audio = "audio" in message or "uploaded file" in message
    if error.param == "audio" or (error.param is None and error.code == "bad_input" and about_audio):
        error.param = "file"
    error.message = message
    error.args = (message,)
    return error


async def last_event(stream):
    async with stream:
        async for event in stream:
            if isinstance(event, (RequestFinished, RequestFailed)):
                return event
    return RequestFailed(stream.request_id, None, "aborted", "aborted")


def transcript_of(result) -> tuple[str, tuple, float | None]:
    """The transcript's text, its segments and the seconds heard."""
    out = result.output
    segments = tuple((out.data or {}).get(SEGMENTS) or ())
    seconds = out.usage.audio_seconds if out.usage is not None else None
    return out.text or "", segments, seconds


def transcript_answer(result, fmt: str, language: str | None):
    text, segments, seconds = transcript_of(result)
    if fmt == "text":
        return PlainTextResponse(text + "\n")
    if fmt in ("srt", "vtt"):
        return PlainTextResponse(subtitles(segments, fmt), media_type="text/vtt" if fmt == "vtt" else "text/plain")
    usage = None if seconds is None else {"type": "duration", "seconds": round(seconds, 3)}
    if fmt == "json":
        return {"text": text, **({"usage": usage} if usage else {})}
    body = {"task": "transcribe", "language": language or (result.output.data or {}).get("language") or "english",
            "duration": round(seconds if seconds is not None else (segments[-1].end if segments else 0.0), 3),
            "text": text, "segments": [segment_json(i, s) for i, s in enumerate(segments)]}
    if usage:
        body["usage"] = usage
    return body


def segment_json(index: int, segment) -> dict[str, Any]:
    """A segment in OpenAI's shape. What the stage does not report (its tokens, log probability, no-speech
    probability) is [] and 0; the compression ratio is Whisper's own measure of the text (gzip)."""
    raw = segment.text.encode()
    ratio = len(raw) / len(zlib.compress(raw)) if raw else 0.0
    return {"id": index, "seek": int(segment.start * 100), "start": round(segment.start, 3),
            "end": round(segment.end, 3), "text": segment.text, "tokens": [], "temperature": 0.0,
            "avg_logprob": 0.0, "compression_ratio": round(ratio, 3), "no_speech_prob": 0.0}


def timestamp(seconds: float, fmt: str) -> str:
    ms = max(int(round(seconds * 1000)), 0)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{',' if fmt == 'srt' else '.'}{ms:03d}"


def subtitles(segments, fmt: str) -> str:
    cues = [f"{timestamp(s.start, fmt)} --> {timestamp(s.end, fmt)}\n{s.text.strip()}\n" for s in segments]
    if fmt == "vtt":
        return "WEBVTT\n\n" + "\n".join(cues)
    return "\n".join(f"{i}\n{cue}" for i, cue in enumerate(cues, 1))


async def transcript_events(stream, final: str, path: Path, served: Served, model: str,
                            arrival: float) -> AsyncIterator[str]:
    """`transcript.text.delta` for each piece of text as the model writes it, then `transcript.text.done` (with
    the tokens the stage counts, where it counts them), or an error event."""
    parts: list[str] = []
    try:
        async with stream:
            async for event in stream:
                if isinstance(event, TokenDelta) and event.node_id == final and event.text:
                    parts.append(event.text)
                    yield event_line({"type": "transcript.text.delta", "delta": event.text})
                elif isinstance(event, RequestFailed):
                    error = about_file(APIError.of_failure(event.kind, event.error, event.field), path)
                    yield event_line({"type": "error", **error.body()})
                elif isinstance(event, RequestFinished):
                    transcribed(served, model, arrival, event.result)
                    yield event_line(transcript_done(event.result, "".join(parts)))
    finally:
        path.unlink(missing_ok=True)


def transcript_done(result, streamed: str) -> dict[str, Any]:
    done: dict[str, Any] = {"type": "transcript.text.done", "text": result.output.text or streamed}
    usage = result.output.usage
    if usage is not None and usage.output_tokens is not None:
        prompt = usage.input_tokens or 0
        done["usage"] = {"type": "tokens", "input_tokens": prompt, "output_tokens": usage.output_tokens,
                         "total_tokens": prompt + usage.output_tokens}
    return done

