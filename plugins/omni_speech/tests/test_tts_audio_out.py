"""audio_out.py: every format encodes to audio ffmpeg reads back with the same length (within a codec frame of padding),
files are written atomically (a failure leaves none), and the stream encoder gives bytes chunk by chunk."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from omni_kernel.core.request import Audio
from omni_speech.audio_out import FFMPEG_FORMATS, StreamEncoder, encode, write_audio

RATE = 22050
SIGNATURES = {"wav": b"RIFF", "mp3": None, "flac": b"fLaC", "opus": b"OggS", "aac": b"\xff", "pcm": None}


def _tone(seconds: float = 0.5) -> Audio:
    t = np.arange(int(RATE * seconds)) / RATE
    return Audio((np.sin(2 * np.pi * 440 * t) * 8000).astype("<i2").tobytes(), RATE)


def _decoded_seconds(body: bytes, fmt: str) -> float:
    import imageio_ffmpeg

    source = ["-f", "s16le", "-ar", str(RATE), "-ac", "1"] if fmt == "pcm" else []
    out = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", *source, "-i", "pipe:0", "-f", "s16le",
                          "-ac", "1", "-ar", "16000", "pipe:1"], input=body, capture_output=True, check=True).stdout
    return len(out) / 2 / 16000


@pytest.mark.parametrize("fmt", list(SIGNATURES))
def test_every_format_reads_back_as_the_same_audio(fmt):
    audio = _tone()
    body = encode(audio, fmt)
    if SIGNATURES[fmt]:
        assert body.startswith(SIGNATURES[fmt])
    assert _decoded_seconds(body, fmt) == pytest.approx(audio.seconds, abs=0.1)


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    import omni_speech.audio_out as audio_out

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(audio_out.os, "fsync", broken)
    with pytest.raises(OSError):
        write_audio(tmp_path / "a.mp3", _tone(), "mp3")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_the_stream_encoder_gives_bytes_as_chunks_come(fmt):
    audio = _tone(1.0)
    encoder = StreamEncoder(RATE, fmt)
    half = len(audio.pcm) // 2
    body = encoder.feed(audio.pcm[:half])
    if fmt == "wav":
        assert body.startswith(b"RIFF") and len(body) == 44 + half
    body += encoder.feed(audio.pcm[half:]) + encoder.close()
    assert _decoded_seconds(body, fmt) == pytest.approx(audio.seconds, abs=0.1)
    assert set(FFMPEG_FORMATS) == {"mp3", "flac", "opus", "aac"}
