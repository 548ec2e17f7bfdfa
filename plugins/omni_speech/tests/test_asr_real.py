"""Speech to text on the real Whisper tiny.en (converted from its registry wheel): real recorded speech comes back as
its transcript; requests decoded together give each the tokens transformers' `generate` gives it alone; the CLI
prints the transcript and its segments, and refuses bad input in one line with exit 2 before any model loads.

How a transcript is compared with what the recording says: both lowercased, the number words one to twenty written
as digits, everything but letters and digits dropped (Whisper writes the counting as "1-2-345-678910"), then equal.
"""

from __future__ import annotations

import json
import re
import subprocess

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from omni_kernel import Omni
from omni_kernel.cli import main
from omni_kernel.core.request import SEGMENTS, StageInput
from omni_speech.asr_config import ASRConfig, ASRParams
from omni_speech.asr_inputs import ASRInputs, log_mel
from omni_speech.asr_stages import ASRStages
from omni_speech.audio_in import decode, ffmpeg_exe

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
           "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]


def squash(text: str) -> str:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return "".join(str(NUMBERS.index(w)) if w in NUMBERS else w for w in words)


@pytest.fixture(scope="module")
def asr(whisper_dir):
    with Omni("asr", asr_model=str(whisper_dir), asr_device="cpu") as omni:
        yield omni


@pytest.fixture(scope="module")
def long_clip(recordings, tmp_path_factory):
    """About 52 s of speech: the three recordings, each followed by 2 s of silence, four times (an MP3)."""
    parts = []
    for _ in range(4):
        for path, _text in recordings.values():
            parts += [decode(path).samples, np.zeros(32000, np.float32)]
    path = tmp_path_factory.mktemp("long") / "long.mp3"
    command = [ffmpeg_exe(), "-nostdin", "-loglevel", "error", "-f", "f32le", "-ar", "16000", "-ac", "1", "-i",
               "pipe:0", str(path)]
    subprocess.run(command, input=np.concatenate(parts).tobytes(), check=True)
    return path


def test_recorded_speech_is_transcribed(asr, recordings):
    requests = {name: asr.request(audio=str(path)) for name, (path, _) in recordings.items()}
    finished = {e.request_id: e.result for e in asr.run(requests.values()) if type(e).__name__ == "RequestFinished"}
    for name, (path, said) in recordings.items():
        result = finished[requests[name].request_id]
        assert squash(result.text) == squash(said), (name, result.text)
        segments = result.output.data[SEGMENTS]
        assert len(segments) == 1 and segments[0].start == 0 and segments[0].end <= decode(path).seconds + 0.01
        trace = result.trace
        assert trace["asr.windows"] == 1 and trace["asr.batch_max"] == 3 and trace["asr.encoder_batch_max"] == 3
        assert result.output.usage.audio_seconds == pytest.approx(decode(path).seconds, abs=0.01)


def test_python_api_returns_the_text(asr, recordings):
    path, said = recordings["quick_brown_fox"]
    assert squash(asr.generate(audio=path.read_bytes()).text) == squash(said)


def test_batched_equals_generate_alone(whisper_dir, recordings, long_clip):
    """The three recordings, one with timestamps, a prompted one and the 52-second clip (long-form: several
    windows, transformers' seek) decoded together: each request's tokens are generate's on it alone (fp32)."""
    stages = ASRStages()
    settings = stages.engine_settings(None, ASRConfig(asr_model=str(whisper_dir), asr_device="cpu"), None)
    engine = stages.engine(settings)
    assets = stages.asset(settings)
    inputs = ASRInputs(assets)
    model = stages.models.acquire(settings.model).model
    cases = {name: (path, False, "") for name, (path, _) in recordings.items()}
    cases["timestamps"] = (recordings["quick_brown_fox"][0], True, "")
    cases["prompted"] = (recordings["counting"][0], False, "One, two, three, four.")
    cases["long"] = (long_clip, False, "")
    for rid, (path, timestamps, prompt) in cases.items():
        engine.add_request(inputs.process(StageInput(rid, prompt, audio=str(path),
                                                     params=ASRParams(timestamps=timestamps))))
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                got[out.request_id] = [t for s in out.record.segments for t in s.tokens]
    for rid, (path, timestamps, prompt) in cases.items():
        audio = decode(path)
        features = torch.from_numpy(log_mel(assets, audio))[None]
        kwargs = {"return_timestamps": True} if timestamps or audio.seconds > 30 else {}
        if prompt:
            kwargs["prompt_ids"] = torch.from_numpy(assets.tokenizer.get_prompt_ids(prompt, return_tensors="np"))
        expected = [t for t in model.generate(features, **kwargs)[0].tolist() if t != assets.eos]
        assert got[rid] == expected, rid


def _run(whisper_dir, *args):
    return CliRunner().invoke(main, ["run", "--pipeline", "asr", "--asr-model", str(whisper_dir), *args])


def test_cli_prints_the_transcript_and_segments(whisper_dir, recordings):
    path, said = recordings["hello_world"]
    result = _run(whisper_dir, "--audio", str(path))
    assert result.exit_code == 0, result.output
    assert squash(result.stdout.strip().splitlines()[0]) == squash(said)
    path, said = recordings["counting"]
    result = _run(whisper_dir, "--audio", str(path), "--json", "--timestamps")
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert squash(body["output"]["text"]) == squash(said) and body["trace"]["asr.timestamps"] is True
    segments = body["output"]["segments"]
    assert segments and 0 <= segments[0]["start"] < segments[-1]["end"] <= decode(path).seconds + 0.01
    assert squash(" ".join(s["text"] for s in segments)) == squash(said)


def test_cli_refuses_bad_input_before_loading(whisper_dir, recordings, tmp_path, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("omni_speech.ct2_whisper.load_whisper", no_load)
    (tmp_path / "empty.wav").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("not audio\n" * 10)
    path = str(recordings["hello_world"][0])
    cases = [(["--audio", str(tmp_path / "missing.wav")], "no such audio file"),
             (["--audio", str(tmp_path / "empty.wav")], "is empty"),
             (["--audio", str(tmp_path / "notes.txt")], "not audio that ffmpeg can decode"),
             (["--audio", path, "--language", "fr"], "not a language of an English-only model; valid: en"),
             (["--audio", path, "--temperature", "-1"], "invalid temperature"),
             (["--audio", path, "--prompt", "<|endoftext|>"], "the prompt cannot be Whisper's previous text")]
    for args, expected in cases:
        result = _run(whisper_dir, *args)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and expected in lines[0], (args, result.output)


def test_streamed_text_is_the_final_text(asr, recordings, long_clip):
    """Text deltas arrive as tokens decode (with timestamps: up to the last complete segment) and add up to the final
    text exactly, with and without timestamps (one segment: its text comes whole, when its window ends). The long
    clip's segments follow one another over its whole length."""
    for audio, params, least in ((recordings["quick_brown_fox"][0], {}, 5),
                                 (recordings["counting"][0], {"timestamps": True}, 1), (long_clip, {}, 2)):
        deltas, result = [], None
        for event in asr.generate_stream(audio=str(audio), **params):
            if type(event).__name__ == "TokenDelta":
                deltas.append(event.text)
            elif type(event).__name__ == "RequestFinished":
                result = event.result
        assert len(deltas) >= least and "".join(deltas) == result.text, deltas
    segments, seconds = result.output.data[SEGMENTS], decode(long_clip).seconds
    assert len(segments) >= 4 and result.trace["asr.windows"] >= 2 and result.trace["asr.timestamps"] is True
    assert all(a.end <= b.start + 0.01 for a, b in zip(segments, segments[1:]))
    assert seconds - 3 < segments[-1].end <= seconds + 0.01
    assert squash(result.text) == squash(" ".join(s.text for s in segments))
    assert squash(result.text).count("quickbrownfox") == 4
