"""Spoken chats on POST /v1/chat/completions (omni_serve.chat_audio) on a real server over chat_speech_plugin.py (the
demo AR checkpoint answers, a sine tone per piece speaks it), driven by the official `openai` client: `message.audio`
whole, `delta.audio` streamed while the answer is written, `input_audio` heard by the voice chat, the bad input
refused before any work naming its field, and the first-audio histogram on /metrics."""

from __future__ import annotations

import base64
import io
import math
import struct
import subprocess
import wave

import httpx
import imageio_ffmpeg
import pytest
from openai_spec import validate

from serving import ServerProcess

pytestmark = pytest.mark.server

SEA = [{"role": "user", "content": "Tell me about the sea."}]
LONG = {"max_tokens": 160, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat-audio")
    proc = ServerProcess(["--pipeline", "fake_ar_speech", "--pipeline", "fake_voice_chat", "--pipeline", "ar_text",
                          "--output-dir", str(tmp / "out"), "--shutdown-timeout", "5"], tmp / "server.log",
                         plugins=("chat_speech_plugin:ChatSpeechPlugin",))
    proc.out_dir = tmp / "out"
    try:
        yield proc.wait_ready()
    finally:
        assert proc.stop() == 0, proc.output()


def pieces_of(text: str) -> list[str]:
    from omni_kernel.events import TokenDelta
    from omni_speech.text_stream import SentenceSplitter

    splitter = SentenceSplitter()
    pieces = [p.text for p in splitter.feed(TokenDelta("r", "answer", text))]
    return pieces + [p.text for p in splitter.end(None)]


def tone_pcm(pieces: list[str], pitch: float = 440.0) -> bytes:
    from speech_plugin import tone

    return b"".join(tone(len(p), pitch, 1.0) for p in pieces)


def spoken_wav(seconds: float = 1.0) -> str:
    """A WAV of a 300 Hz tone, base64, as a chat's input_audio data."""
    out = io.BytesIO()
    with wave.open(out, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(16000)
        f.writeframes(b"".join(struct.pack("<h", int(9000 * math.sin(2 * math.pi * 300 * i / 16000)))
                               for i in range(int(16000 * seconds))))
    return base64.b64encode(out.getvalue()).decode()


def heard_message(data: str, fmt: str = "wav") -> list[dict]:
    return [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": data, "format": fmt}}]}]


def decoded_pcm(data: bytes, container: str) -> bytes:
    args = [imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-f", container, "-i", "pipe:0", "-f", "s16le", "-ac",
            "1", "-ar", "22050", "pipe:1"]
    return subprocess.run(args, input=data, capture_output=True, check=True).stdout


def test_a_spoken_answer_whole_carries_message_audio(client):
    out = client.chat.completions.create(model="fake_ar_speech", messages=SEA, modalities=["text", "audio"],
                                         audio={"voice": "alloy", "format": "wav"}, **LONG)
    body = out.model_dump(exclude_unset=True)
    validate("CreateChatCompletionResponse", body)
    message = out.choices[0].message
    assert message.content and message.audio.transcript == message.content
    assert message.audio.id.startswith("audio_") and message.audio.expires_at <= out.created
    wav = base64.b64decode(message.audio.data)
    assert wav[:4] == b"RIFF" and wav[44:] == tone_pcm(pieces_of(message.content))  # the default voice, ana
    assert out.usage.completion_tokens == 160


def test_a_streamed_spoken_answer_sends_its_audio_while_the_text_is_written(client):
    chunks = list(client.chat.completions.create(model="fake_ar_speech", messages=SEA, stream=True,
                                                 modalities=["text", "audio"],
                                                 audio={"voice": "bob", "format": "wav"}, **LONG))
    kinds, text, transcripts, data = [], [], [], b""
    for chunk in chunks:
        delta = chunk.choices[0].delta
        audio = delta.audio  # the official client's ChoiceDeltaAudio: OpenAI's service streams it
        if delta.content:
            kinds.append("text")
            text.append(delta.content)
        if audio and audio.transcript is not None:
            transcripts.append(audio.transcript)
        if audio and audio.data is not None:
            kinds.append("audio")
            data += base64.b64decode(audio.data)
    answer = "".join(text)
    assert transcripts == pieces_of(answer) and len(transcripts) >= 2
    assert data[44:] == tone_pcm(transcripts, 220.0)  # bob
    assert kinds.index("audio") < len(kinds) - 1 - kinds[::-1].index("text")  # sound before the text's end
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-2].choices[0].delta.audio.expires_at <= chunks[-1].created


@pytest.mark.parametrize("fmt, container", [("mp3", "mp3"), ("pcm16", None)])
def test_encoded_formats_stream_and_decode(client, fmt, container):
    data = b""
    for chunk in client.chat.completions.create(model="fake_ar_speech", messages=SEA, stream=True,
                                                modalities=["text", "audio"], audio={"voice": "ana", "format": fmt},
                                                max_tokens=40, temperature=0, extra_body={"ignore_eos": True}):
        audio = chunk.choices[0].delta.audio if chunk.choices else None
        if audio and audio.data is not None:
            data += base64.b64decode(audio.data)
    seconds = len(data) / 2 / 24000 if container is None else len(decoded_pcm(data, container)) / 2 / 22050
    assert seconds > 0.5


def test_the_voice_chat_hears_input_audio_and_answers_aloud(client, http):
    out = client.chat.completions.create(model="fake_voice_chat", messages=heard_message(spoken_wav(1.0)),
                                         modalities=["text", "audio"], audio={"voice": "ana", "format": "wav"},
                                         max_tokens=24, temperature=0)
    message = out.choices[0].message
    assert message.content and base64.b64decode(message.audio.data)[44:] == tone_pcm(pieces_of(message.content))
    text_only = client.chat.completions.create(model="fake_voice_chat", messages=heard_message(spoken_wav(1.0)),
                                               max_tokens=24, temperature=0)
    assert text_only.choices[0].message.content == message.content and text_only.choices[0].message.audio is None
    assert {m["id"]: m["capabilities"] for m in http.get("/v1/models").json()["data"]}["fake_voice_chat"] == \
        {m["id"]: m["capabilities"] for m in http.get("/v1/models").json()["data"]}["ar_text"]


def test_first_audio_of_chats_is_a_histogram_per_pipeline(client, http):
    client.chat.completions.create(model="fake_ar_speech", messages=SEA, modalities=["text", "audio"],
                                   audio={"voice": "alloy", "format": "wav"}, max_tokens=8)
    metrics = http.get("/metrics").text
    count = [line for line in metrics.splitlines()
             if line.startswith('omni_chat_time_to_first_audio_seconds_count{model="fake_ar_speech"}')]
    assert count and float(count[0].split()[-1]) >= 1


BAD = [
    ("ar_text", SEA, {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
    ("fake_ar_speech", SEA, {"modalities": ["text", "audio"]}, "audio"),
    ("fake_ar_speech", SEA, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("fake_ar_speech", SEA, {"modalities": []}, "modalities"),
    ("fake_ar_speech", SEA, {"modalities": ["text", "audio"], "audio": {"voice": "nobody", "format": "wav"}},
     "audio.voice"),
    ("fake_ar_speech", SEA, {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "ogg"}},
     "audio.format"),
    ("fake_ar_speech", heard_message(spoken_wav(0.2)), {}, "messages[0].content[0]"),
    ("fake_voice_chat", SEA, {}, "messages"),
    ("fake_voice_chat", heard_message("not base64!"), {}, "messages[0].content[0].input_audio.data"),
    ("fake_voice_chat", heard_message(base64.b64encode(b"plain text, not sound").decode()), {},
     "messages[0].content[0].input_audio.data"),
]


@pytest.mark.parametrize("model, messages, extra, param", BAD)
def test_bad_input_is_a_400_naming_its_field(http, server, model, messages, extra, param):
    response = http.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 4,
                                                        **extra})
    assert response.status_code == 400, response.text
    body = response.json()
    validate("ErrorResponse", body)
    assert body["error"]["param"] == param, body
    assert "\n" not in body["error"]["message"] and str(server.url) not in body["error"]["message"]
    assert "/.uploads/" not in body["error"]["message"]


def test_the_heard_audio_is_removed_when_its_request_ends(http, server):
    for messages in (heard_message(spoken_wav(0.5)), heard_message(base64.b64encode(b"no sound").decode())):
        http.post("/v1/chat/completions", json={"model": "fake_voice_chat", "messages": messages, "max_tokens": 4})
    uploads = server.out_dir / ".uploads"
    assert not uploads.exists() or not list(uploads.iterdir())
    assert "omni_requests_in_flight 0.0" in httpx.get(server.url + "/metrics").text


def test_a_client_that_leaves_mid_answer_ends_both_stages(http, server):
    from omni_kernel.testing import wait_until

    body = {"model": "fake_ar_speech", "messages": SEA, "stream": True, "modalities": ["text", "audio"],
            "audio": {"voice": "ana", "format": "mp3"}, "max_tokens": 400, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if '"data"' in line and '"audio"' in line:
                break  # the first encoded sound: the answer is still being written
    def idle() -> bool:
        metrics = http.get("/metrics").text
        running = [line for line in metrics.splitlines() if line.startswith("omni_requests_running{")]
        return "omni_requests_in_flight 0.0" in metrics and all(line.endswith(" 0.0") for line in running)

    wait_until(idle, 30, "the left chat's stages to be idle")
    aborted = [line for line in http.get("/metrics").text.splitlines() if line.startswith("omni_requests_aborted")]
    assert float(aborted[0].split()[-1]) >= 1
