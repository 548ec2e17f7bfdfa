"""The OpenAI audio API of omni serve (POST /v1/audio/speech, POST /v1/audio/transcriptions, GET /v1/audio/voices)
on a real server over the test speech plugin (speech_plugin.py: a sine tone per sentence, a transcript that says how
long the audio is), driven by the official `openai` client unchanged and validated against the pinned spec
(openai_spec.py): every speech format streamed, both stream formats, every transcription format and stream=True,
the voices, and the bad input that is refused before any model work while other requests go on."""

from __future__ import annotations

import base64
import io
import json
import math
import struct
import subprocess
import threading
import time
import wave
from pathlib import Path

import httpx
import imageio_ffmpeg
import openai
import openai_spec
import pytest
from openai_spec import validate

from omni_kernel.testing import wait_until

from serving import ServerProcess

pytestmark = pytest.mark.server

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
TEXT = "Hello there. The rain in Spain stays mainly in the plain. How are you today?"
CONTAINERS = {"mp3": "mp3", "opus": "ogg", "aac": "aac", "flac": "flac", "wav": "wav"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("audio")
    proc = ServerProcess(["--pipeline", "fake_tts", "--pipeline", "fake_asr", "--pipeline", "echo", "--output-dir",
                          str(tmp / "out"), "--max-body-mb", "2", "--shutdown-timeout", "5"], tmp / "server.log",
                         plugins=("speech_plugin:SpeechPlugin",))
    try:
        yield proc.wait_ready()
    finally:
        assert proc.stop() == 0, proc.output()


def decoded_seconds(data: bytes, fmt: str) -> float:
    """How long a speech answer is, as ffmpeg decodes it (pcm: OpenAI's 24 kHz s16le)."""
    if fmt == "pcm":
        return len(data) / 2 / 24000
    args = [imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-f", CONTAINERS[fmt], "-i", "pipe:0", "-f", "s16le",
            "-ac", "1", "-ar", "16000", "pipe:1"]
    done = subprocess.run(args, input=data, capture_output=True, check=True)
    return len(done.stdout) / 2 / 16000


def spoken_seconds(text: str) -> float:
    return sum(int(22050 * 0.02 * len(s)) for s in text.replace("?", ".").split(".") if s.strip()
               for s in [s + "."]) / 22050


def refused(response: httpx.Response, status: int, param: str | None) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    validate("ErrorResponse", body)
    assert body["error"]["param"] == param, body
    assert "\n" not in body["error"]["message"]
    return body["error"]["message"]


def test_models_and_voices(http):
    models = http.get("/v1/models").json()["data"]
    kinds = {m["id"]: m["capabilities"] for m in models}
    assert kinds["fake_tts"] == ["audio.speech"] and kinds["fake_asr"] == ["audio.transcriptions"]
    voices = http.get("/v1/audio/voices").json()
    assert [(v["id"], v["default"]) for v in voices["data"]] == [("ana", True), ("bob", False)]
    assert "alloy" in voices["data"][0]["aliases"] and "aliases" not in voices["data"][1]


@pytest.mark.parametrize("fmt", FORMATS)
def test_speech_every_format_through_the_official_client(client, fmt):
    with client.audio.speech.with_streaming_response.create(model="fake_tts", voice="alloy", input=TEXT,
                                                            response_format=fmt) as response:
        assert response.headers["content-type"].startswith("audio/")
        data = b"".join(response.iter_bytes())
    assert decoded_seconds(data, fmt) == pytest.approx(spoken_seconds(TEXT), abs=0.1)
    if fmt == "wav":
        assert data[:4] == b"RIFF" and data[36:40] == b"data" and data[40:44] == b"\xff\xff\xff\xff"
        assert int.from_bytes(data[24:28], "little") == 22050


def test_speech_bytes_start_before_the_text_is_spoken(http):
    """The first sentence is quick, the second takes 0.3 s: its first bytes come before the second is made."""
    text = "Quick one. This one is spoken slowly. And done."
    started = time.monotonic()
    with http.stream("POST", "/v1/audio/speech", json={"model": "fake_tts", "voice": "ana", "input": text,
                                                        "response_format": "wav"}) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()
        first = next(chunks)
        first_at = time.monotonic() - started
        rest = b"".join(chunks)
        total = time.monotonic() - started
    assert first_at < total - 0.2, (first_at, total)
    assert len(first) + len(rest) == 44 + 2 * sum(int(22050 * 0.02 * len(s)) for s in
                                                  ("Quick one.", " This one is spoken slowly.", " And done."))


def test_speech_sse_events_conform(http):
    with http.stream("POST", "/v1/audio/speech", json={"model": "fake_tts", "voice": "bob", "input": TEXT,
                                                        "response_format": "pcm", "stream_format": "sse"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    for event in events:
        validate("CreateSpeechResponseStreamEvent", event)
    assert [e["type"] for e in events[-1:]] == ["speech.audio.done"]
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta"} and len(events) >= 3
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(pcm) / 2 / 24000 == pytest.approx(spoken_seconds(TEXT), abs=0.01)
    assert events[-1]["usage"]["audio_seconds"] == pytest.approx(spoken_seconds(TEXT), abs=0.01)


def test_speech_voice_and_speed(http):
    def seconds(**fields):
        r = http.post("/v1/audio/speech", json={"model": "fake_tts", "input": "Hi there.", "response_format": "wav",
                                                **fields})
        assert r.status_code == 200, r.text
        return (len(r.content) - 44) / 2 / 22050

    assert seconds(voice="bob", speed=2) == pytest.approx(seconds(voice="ana") / 2, abs=0.01)
    assert seconds(voice={"id": "bob"}) == pytest.approx(seconds(voice="shimmer"), abs=0.01)


@pytest.mark.parametrize("fields, status, param", [
    ({"input": ""}, 400, "input"),
    ({"input": "   "}, 400, "input"),
    ({"input": "a" * 4097}, 400, "input"),
    ({"voice": "zed"}, 400, "voice"),
    ({"response_format": "ogg"}, 400, "response_format"),
    ({"speed": 0.1}, 400, "speed"),
    ({"speed": 5}, 400, "speed"),
    ({"stream_format": "video"}, 400, "stream_format"),
    ({"instructions": "whisper"}, 400, "instructions"),
    ({"seed": 3}, 400, "seed"),
    ({"output": "/tmp/x.wav"}, 400, "output"),
    ({"model": "fake_asr"}, 400, "model"),
    ({"model": "tts-1"}, 404, "model"),
], ids=lambda v: str(v)[:30])
def test_speech_bad_input_is_one_line(http, fields, status, param):
    body = {"model": "fake_tts", "voice": "ana", "input": "Hello.", **fields}
    r = http.post("/v1/audio/speech", json=body)
    message = refused(r, status, param)
    if fields.get("input", "x").strip() == "" or len(fields.get("input", "")) > 4096:
        assert "empty" in message or "4096" in message


def speech_file(http, fmt: str = "flac", text: str = TEXT) -> bytes:
    r = http.post("/v1/audio/speech", json={"model": "fake_tts", "voice": "ana", "input": text,
                                            "response_format": fmt})
    assert r.status_code == 200
    return r.content


@pytest.mark.parametrize("fmt", ["json", "text", "srt", "vtt", "verbose_json"])
def test_transcription_every_format_through_the_official_client(client, http, fmt):
    audio = speech_file(http, "mp3")
    seconds = decoded_seconds(audio, "mp3")
    out = client.audio.transcriptions.create(model="fake_asr", file=("speech.mp3", audio), response_format=fmt,
                                             language="en", temperature=0)
    if fmt == "json":
        assert out.text.startswith("I heard ") and out.usage.type == "duration"
    elif fmt == "verbose_json":
        validate("CreateTranscriptionResponseVerboseJson", out.model_dump(exclude_unset=True))
        assert out.duration == pytest.approx(seconds, abs=0.05) and len(out.segments) == 2
        assert out.segments[1].end == pytest.approx(seconds, abs=0.05)
    elif fmt == "text":
        assert out.startswith("I heard ")
    elif fmt == "vtt":
        assert out.startswith("WEBVTT\n\n00:00:00.000 --> ")
    else:
        assert out.startswith("1\n00:00:00,000 --> ") and "\n\n2\n" in out
    raw = http.post("/v1/audio/transcriptions", data={"model": "fake_asr", "response_format": fmt},
                    files={"file": ("speech.mp3", audio, "audio/mpeg")})
    if fmt == "json":
        validate("CreateTranscriptionResponseJson", raw.json())


def test_transcription_streamed_through_the_official_client(client, http):
    audio = speech_file(http, "wav")
    events = list(client.audio.transcriptions.create(model="fake_asr", file=("speech.wav", audio), stream=True))
    for event in events:
        validate("CreateTranscriptionResponseStreamEvent", event.model_dump(exclude_unset=True))
    assert [e.type for e in events[-1:]] == ["transcript.text.done"]
    assert "".join(e.delta for e in events[:-1]) == events[-1].text
    assert events[-1].text.startswith("I heard ")


def test_transcription_of_browser_and_other_formats(http):
    for fmt in ("opus", "aac", "flac", "wav"):
        audio = speech_file(http, fmt)
        r = http.post("/v1/audio/transcriptions", data={"model": "fake_asr"},
                      files={"file": (f"speech.{fmt}", audio)})
        assert r.status_code == 200 and r.json()["text"].startswith("I heard "), (fmt, r.text)


def tone_wav(level: int = 8000) -> bytes:
    """One second of a 16 kHz tone as a WAV file (level 0: silence)."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"".join(struct.pack("<h", int(level * math.sin(i / 5))) for i in range(16000)))
    return buffer.getvalue()


@pytest.mark.parametrize("case", ["not_audio", "empty", "truncated", "silent", "no_file", "text_file", "word",
                                  "format", "language", "temperature", "include", "unknown_field", "chat_model"])
def test_transcription_bad_input_is_one_line(http, server, case):
    audio = speech_file(http, "wav")
    files = {"file": ("a.wav", audio, "audio/wav")}
    data = {"model": "fake_asr"}
    status, param = 400, "file"
    if case == "not_audio":
        files = {"file": ("a.wav", b"this is not sound at all" * 10, "audio/wav")}
    elif case == "empty":
        files = {"file": ("a.wav", b"", "audio/wav")}
    elif case == "truncated":
        files = {"file": ("a.wav", audio[:40], "audio/wav")}
    elif case == "silent":
        files = {"file": ("a.wav", tone_wav(0), "audio/wav")}
    elif case == "no_file":
        files = None
        data["x"] = "1"  # a multipart body with no file
        param = "file"
    elif case == "text_file":
        files, data["file"] = None, "hello"
    else:
        param = {"word": "timestamp_granularities", "format": "response_format", "language": "language",
                 "temperature": "temperature", "include": "include", "unknown_field": "beam_size",
                 "chat_model": "model"}[case]
        data.update({"word": {"timestamp_granularities[]": "word"}, "format": {"response_format": "ogg"},
                     "language": {"language": "fr"}, "temperature": {"temperature": "3"},
                     "include": {"include[]": "logprobs"}, "unknown_field": {"beam_size": "5"},
                     "chat_model": {"model": "echo"}}[case])
    if case == "no_file":
        r = http.post("/v1/audio/transcriptions", files={"model": (None, "fake_asr")})
    else:
        r = http.post("/v1/audio/transcriptions", data=data, files=files)
    message = refused(r, status, param if param != "file" or case in ("no_file", "text_file") else r.json()["error"]
                      ["param"])
    assert str(server.url) not in message and ".uploads" not in message, message
    assert not list((server.log_path.parent / "out" / ".uploads").glob("transcript-*")), "an upload was left"


def test_oversized_upload_is_413_and_others_go_on(http, server):
    """A file over --max-body-mb (2 here) is refused with 413 while a speech request streams on."""
    results = {}

    def speak():
        results["speech"] = http.post("/v1/audio/speech", json={
            "model": "fake_tts", "voice": "ana", "input": "This is spoken slowly. And slowly again.",
            "response_format": "wav"})

    thread = threading.Thread(target=speak)
    thread.start()
    big = b"\0" * (3 << 20)
    r = http.post("/v1/audio/transcriptions", data={"model": "fake_asr"}, files={"file": ("big.wav", big)})
    assert r.status_code == 413, r.text
    validate("ErrorResponse", r.json())
    thread.join(30)
    assert results["speech"].status_code == 200 and len(results["speech"].content) > 44


def test_a_failed_request_leaves_the_others_unharmed(http, client):
    """Bad requests, in the middle of a streamed speech request, change nothing in it."""
    expected = speech_file(http, "wav", "One slowly. Two. Three slowly.")
    got = {}

    def speak():
        got["audio"] = speech_file(http, "wav", "One slowly. Two. Three slowly.")

    thread = threading.Thread(target=speak)
    thread.start()
    for _ in range(3):
        refused(http.post("/v1/audio/speech", json={"model": "fake_tts", "voice": "ana", "input": " "}), 400, "input")
        r = http.post("/v1/audio/transcriptions", data={"model": "fake_asr"}, files={"file": ("a.wav", b"junk")})
        assert r.status_code == 400
    thread.join(30)
    assert got["audio"] == expected
    with pytest.raises(openai.BadRequestError):
        client.audio.speech.create(model="fake_tts", voice="ana", input="")


def test_audio_operations_conform_to_the_published_document():
    """The vendored subset holds both audio operations (extract.py's PATHS), so the conformance test's
    schemathesis run reaches them too."""
    paths = openai_spec.load()["paths"]
    assert "post" in paths["/audio/speech"] and "post" in paths["/audio/transcriptions"]


def test_schemathesis_over_the_audio_operations(server):
    """Generated requests (fixed seed) to both audio operations of the published document, the model forced to
    the served one so generation reaches the pipeline: no 5xx, and every answer the document describes matches
    its schema."""
    import schemathesis
    from hypothesis import HealthCheck, given, seed, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import response_schema_conformance

    forced = {"/audio/speech": {"model": "fake_tts", "voice": "alloy"},
              "/audio/transcriptions": {"model": "fake_asr", "file": tone_wav()}}
    api = schemathesis.openapi.from_dict(openai_spec.load())
    answered: dict[str, set[int]] = {}
    for result in api.get_all_operations():
        operation = result.ok()
        if operation.path not in forced:
            continue

        @seed(52)
        @given(case=operation.as_strategy())
        @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  derandomize=False)
        def run(case):
            if isinstance(case.body, dict):
                case.body.update(forced[case.path])
                for unsupported in ("instructions", "include", "chunking_strategy", "known_speaker_names",
                                    "known_speaker_references"):
                    case.body.pop(unsupported, None)  # refused (400) by design: let the rest reach the model
            response = case.call(base_url=server.url + "/v1", timeout=60)
            answered.setdefault(case.path, set()).add(response.status_code)
            sse = "text/event-stream" in str(response.headers.get("content-type"))
            # schemathesis checks an SSE event as {"data": TEXT, "event": ...} against the event's schema, never
            # its JSON: the events are validated one by one in the tests above instead.
            case.validate_response(response, checks=[not_a_server_error] if sse else
                                   [not_a_server_error, response_schema_conformance])

        run()
    assert set(answered) == set(forced), answered
    assert answered["/audio/speech"] >= {200, 400} and answered["/audio/transcriptions"] >= {200, 400}, answered


def encoders_of(pid: int) -> list[str]:
    """The ffmpeg processes the server runs now (its children's command lines)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += (task / "children").read_text().split()
        except OSError:
            continue  # a thread that ended (asyncio's child watcher runs one per subprocess)
    lines = []
    for child in children:
        try:
            lines.append(Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue  # it ended
    return [line for line in lines if "ffmpeg" in line]


def test_a_client_that_leaves_mid_speech_aborts_it_and_its_encoder(http, server):
    text = "Quick. " + "This sentence is spoken slowly. " * 40  # 12 s: it is still being spoken when the client leaves
    with http.stream("POST", "/v1/audio/speech", json={"model": "fake_tts", "voice": "ana", "input": text,
                                                        "response_format": "mp3"}) as r:
        next(r.iter_raw())
        assert encoders_of(server.proc.pid), "the mp3 encoder runs while the sound is made"
    wait_until(lambda: http.get("/health").json()["in_flight"] == 0, 10, "the request to be aborted")
    wait_until(lambda: not encoders_of(server.proc.pid), 10, "the encoder to stop")
    audio = speech_file(http, "wav")
    heard = http.post("/v1/audio/transcriptions", data={"model": "fake_asr"}, files={"file": ("a.wav", audio)})
    assert heard.status_code == 200, heard.text
    metrics = http.get("/metrics").text
    assert 'omni_time_to_first_audio_seconds_count{model="fake_tts"}' in metrics
    assert 'omni_audio_seconds_total{model="fake_asr",route="transcriptions"}' in metrics
    assert 'omni_audio_seconds_total{model="fake_tts",route="speech"}' in metrics
