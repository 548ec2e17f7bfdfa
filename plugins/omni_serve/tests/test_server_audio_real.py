"""The audio API on the real speech weights (omni_speech's `tts` and `asr` pipelines: the Piper voice joe and
Whisper tiny.en, converted into the user's cache by `make models`): the official client has a sentence spoken as
it is synthesized, and the same sound transcribed back. Skips, saying why, where omni_speech or its converted
weights are missing (omni_serve's tests cannot use omni_speech's fixtures: the directories are found the same way
its conftest finds them)."""

from __future__ import annotations

import difflib
import re
import subprocess

import imageio_ffmpeg
import pytest

from serving import running, speech_weights_or_skip

pytestmark = [pytest.mark.server, pytest.mark.real_model]

weights = pytest.importorskip("omni_speech.weights", reason="omni-speech is not installed")
SENTENCE = "The quick brown fox jumps over the lazy dog. It was a bright cold day in April."


def converted(model):
    return speech_weights_or_skip(weights, model)


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def heard(text: str) -> bool:
    """Whisper tiny.en heard the sentence: at most 2 of its 17 words wrong (with timestamps it hears "jumped")."""
    said, got = words(SENTENCE), words(text)
    matched = sum(block.size for block in difflib.SequenceMatcher(a=said, b=got).get_matching_blocks())
    return max(len(said), len(got)) - matched <= 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from omni_kernel.plugins import load_host

    pipelines = load_host().registry.pipelines
    args = ["--pipeline", "tts", "-c", f"tts_model={converted(weights.VOICE)}"]
    if "asr" in pipelines:
        args += ["--pipeline", "asr", "-c", f"asr_model={converted(weights.WHISPER)}"]
    tmp = tmp_path_factory.mktemp("audio-real")
    with running([*args, "--output-dir", str(tmp / "out"), "--shutdown-timeout", "5"], tmp / "server.log") as proc:
        yield proc


def test_real_voice_speaks_as_it_goes_and_whisper_hears_it(client, http):
    voices = http.get("/v1/audio/voices").json()["data"]
    assert [(v["id"], v["default"]) for v in voices] == [("joe", True)] and "alloy" in voices[0]["aliases"], voices
    with client.audio.speech.with_streaming_response.create(model="tts", voice="alloy", input=SENTENCE,
                                                            response_format="mp3") as response:
        chunks = list(response.iter_bytes())
    mp3 = b"".join(chunks)
    pcm = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-f", "mp3", "-i", "pipe:0", "-f", "s16le",
                          "-ac", "1", "-ar", "16000", "pipe:1"], input=mp3, capture_output=True, check=True).stdout
    assert 3.0 < len(pcm) / 32000 < 12.0, len(pcm) / 32000
    if "asr" not in {m["id"] for m in http.get("/v1/models").json()["data"]}:
        pytest.skip("omni_speech registers no `asr` pipeline yet: the speech was checked, not transcribed")
    out = client.audio.transcriptions.create(model="asr", file=("speech.mp3", mp3), response_format="verbose_json")
    assert heard(out.text), out.text
    assert out.segments and 0 < out.segments[0].end <= out.segments[-1].end <= out.duration + 0.5, out
    events = list(client.audio.transcriptions.create(model="asr", file=("speech.mp3", mp3), stream=True))
    assert len(events) > 3 and events[-1].type == "transcript.text.done"
    assert "".join(e.delta for e in events[:-1]).strip() == events[-1].text.strip()
    assert heard(events[-1].text), events[-1].text
    r = http.post("/v1/audio/transcriptions", data={"model": "asr"}, files={"file": ("a.mp3", mp3[: len(mp3) // 50])})
    assert r.status_code in (200, 400), r.text  # a cut file: transcribed as far as it goes, or refused in one line
    r = http.post("/v1/audio/transcriptions", data={"model": "asr"}, files={"file": ("a.wav", b"RIFF" + b"x" * 400)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file", r.text
