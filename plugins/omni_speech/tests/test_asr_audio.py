"""Audio input for speech to text: every container a browser or a phone writes decodes to 16 kHz mono float32 of the
same length, from a path or from the file's bytes; what is not usable audio is refused in one line."""

from __future__ import annotations

import struct
import subprocess
import wave

import numpy as np
import pytest

from omni_kernel.core.errors import InputError
from omni_speech import audio_in
from omni_speech.audio_in import SAMPLE_RATE, decode, ffmpeg_exe

SECONDS = 1.5
FORMATS = {"wav": ["-c:a", "pcm_f32le"], "mp3": [], "flac": [], "ogg": ["-c:a", "libopus"],
           "webm": ["-c:a", "libopus"], "m4a": ["-c:a", "aac"]}


def encode(samples: np.ndarray, path, rate: int = 22050, channels: int = 1, codec=()) -> None:
    """Float samples written by ffmpeg in the container the path's extension names."""
    command = [ffmpeg_exe(), "-nostdin", "-loglevel", "error", "-y", "-f", "f32le", "-ar", str(rate), "-ac",
               str(channels), "-i", "pipe:0", *codec, str(path)]
    subprocess.run(command, input=samples.astype("<f4").tobytes(), check=True)


def tone(seconds: float = SECONDS, rate: int = 22050, level: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (level * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("audio")
    out = {}
    for ext, codec in FORMATS.items():
        out[ext] = root / f"tone.{ext}"
        encode(tone(), out[ext], codec=codec)
    return out


@pytest.mark.parametrize("ext", sorted(FORMATS))
def test_every_container_decodes_to_16k_mono(files, ext):
    audio = decode(files[ext])
    assert audio.sample_rate == SAMPLE_RATE and audio.samples.dtype == np.float32
    assert audio.seconds == pytest.approx(SECONDS, abs=0.05)  # codecs pad a few ms
    assert 0.2 < float(np.abs(audio.samples).max()) < 0.4


def test_bytes_decode_as_the_file(files):
    from_path, from_bytes = decode(files["m4a"]), decode(files["m4a"].read_bytes())
    assert np.array_equal(from_path.samples, from_bytes.samples)


def test_a_streamed_wav_of_unknown_length_decodes(tmp_path):
    """omni serve's streamed WAV (audio_encode.wav_header: both sizes 0xFFFFFFFF) decodes whole, as a file and
    as bytes, to the same samples as the WAV with its sizes."""
    pcm = (tone(rate=24000) * 32767).astype("<i2").tobytes()
    header = (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, 24000,
                                                                                   48000, 2, 16)
              + b"data" + struct.pack("<I", 0xFFFFFFFF))
    streamed, sized = tmp_path / "streamed.wav", tmp_path / "sized.wav"
    streamed.write_bytes(header + pcm)
    with wave.open(str(sized), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(pcm)
    expected = decode(sized).samples
    assert decode(streamed).seconds == pytest.approx(SECONDS, abs=0.01)
    assert np.array_equal(decode(streamed).samples, expected)
    assert np.array_equal(decode(streamed.read_bytes()).samples, expected)


def test_stereo_is_mixed_down(tmp_path):
    path = tmp_path / "stereo.wav"
    encode(np.repeat(tone(rate=48000), 2), path, rate=48000, channels=2, codec=["-c:a", "pcm_s16le"])
    audio = decode(path)
    assert audio.seconds == pytest.approx(SECONDS, abs=0.01)


def refusal(audio) -> str:
    with pytest.raises(InputError) as caught:
        decode(audio)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_bad_audio_is_refused_in_one_line(files, tmp_path):
    assert "no such audio file" in refusal(tmp_path / "missing.wav")
    assert "is not a file" in refusal(tmp_path)
    (tmp_path / "empty.wav").write_bytes(b"")
    assert "empty" in refusal(tmp_path / "empty.wav")
    assert "empty" in refusal(b"")
    (tmp_path / "notes.txt").write_text("not audio at all\n" * 20)
    assert "not audio that ffmpeg can decode" in refusal(tmp_path / "notes.txt")
    assert "not audio that ffmpeg can decode" in refusal(b"\x89PNG\r\n\x1a\n" + bytes(200))
    data = files["flac"].read_bytes()
    assert "truncated or corrupt" in refusal(data[: len(data) // 3])
    data = files["wav"].read_bytes()
    assert "truncated or corrupt" in refusal(data[: len(data) // 2])


def test_silence_is_refused_and_quiet_speech_is_not(tmp_path):
    encode(np.zeros(22050, np.float32), tmp_path / "zero.wav", codec=["-c:a", "pcm_f32le"])
    assert "silent" in refusal(tmp_path / "zero.wav") and "-inf dBFS" in refusal(tmp_path / "zero.wav")
    encode(tone(level=0.0005), tmp_path / "hiss.wav", codec=["-c:a", "pcm_f32le"])
    assert "below -60 dBFS" in refusal(tmp_path / "hiss.wav")
    encode(tone(level=0.01), tmp_path / "quiet.wav", codec=["-c:a", "pcm_f32le"])  # -40 dBFS: heard
    assert decode(tmp_path / "quiet.wav").seconds == pytest.approx(SECONDS, abs=0.01)


def test_audio_over_the_limit_is_refused(monkeypatch, files):
    monkeypatch.setattr(audio_in, "MAX_SECONDS", 1)
    assert "longer than the limit" in refusal(files["wav"])
