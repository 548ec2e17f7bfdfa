"""`omni run --pipeline tts`: bad input is one line, exit 2, before any model work, and no file; a good request
writes the format its --output names; the real voice speaks a sentence."""

from __future__ import annotations

import wave

import pytest
from click.testing import CliRunner
from tts_tiny import SAMPLE_RATE, make_tiny_voice

from omni_kernel.cli import main


@pytest.fixture(scope="module")
def tiny_voice(tmp_path_factory):
    return make_tiny_voice(tmp_path_factory.mktemp("tiny_voice"))


def _run(voice, *args):
    return CliRunner().invoke(main, ["run", "--pipeline", "tts", "--tts-model", str(voice), *args])


BAD = [
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", " \n\t "], "the prompt is empty"),
    (["--prompt", "a" * 4097], "4,097 characters; at most 4,096"),
    (["--prompt", "hi", "--voice", "nobody"], "invalid voice: 'nobody' is not a voice of this model; its voices: tiny"),
    (["--prompt", "hi", "--speed", "5"], "invalid speed: 5.0 is not a finite number >= 0.25 <= 4.0"),
    (["--prompt", "hi", "--speed", "0.1"], "invalid speed"),
    (["--prompt", "hi", "-o", "noise_scale=nan"], "invalid noise_scale: nan is not a finite number"),
    (["--prompt", "hi", "-o", "noise_w=inf"], "invalid noise_w: inf is not a finite number"),
    (["--prompt", "hi", "-o", "response_format=ogg"], "invalid response_format: 'ogg' is not one of"),
    (["--prompt", "hi", "--output", "{tmp}/a.ogg"], "must end in one of .wav, .mp3, .flac, .opus, .aac, .pcm"),
    (["--prompt", "hi", "--output", "{tmp}/a.wav", "-o", "response_format=mp3"], "'mp3' does not match the output"),
    (["--prompt", "¡¿", "--output", "{tmp}/a.wav"], "nothing the voice can speak"),
]


@pytest.fixture(scope="module")
def voice_without_weights(tiny_voice, tmp_path_factory):
    """The tiny voice's config and voice file, no weights: a request that reached model work would fail otherwise."""
    import shutil

    path = tmp_path_factory.mktemp("no_weights")
    for name in ("config.json", "omni_voice.json"):
        shutil.copy(tiny_voice / name, path / name)
    return path


@pytest.mark.parametrize("args,expected", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_is_one_line_exit_2_before_model_work_and_no_file(voice_without_weights, tmp_path, args, expected):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "--output" not in args:
        args += ["--output", str(tmp_path / "out.wav")]
    result = _run(voice_without_weights, *args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.output
    assert list(tmp_path.iterdir()) == []


def test_a_good_request_writes_its_extensions_format(tiny_voice, tmp_path):
    out = tmp_path / "speech.wav"
    result = _run(tiny_voice, "--prompt", "Hello there. General test.", "--output", str(out), "--seed", "1",
                  "--speed", "1.25")
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output
    with wave.open(str(out)) as f:
        assert f.getframerate() == SAMPLE_RATE and f.getnchannels() == 1 and f.getsampwidth() == 2
        assert f.getnframes() > 0
    assert [p.name for p in tmp_path.iterdir()] == ["speech.wav"]


def test_the_real_voice_speaks_a_sentence(voice_dir, tmp_path):
    out = tmp_path / "hello.mp3"
    result = CliRunner().invoke(main, ["run", "--pipeline", "tts", "--tts-model", str(voice_dir), "--prompt",
                                       "The quick brown fox jumps over the lazy dog.", "--output", str(out),
                                       "--seed", "0"])
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 1000 and "tts.voice" in result.output and '"joe"' in result.output
    assert "tts.audio_seconds" in result.output


@pytest.mark.cli_subprocess
def test_the_plugin_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, omni_speech.plugin; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"
