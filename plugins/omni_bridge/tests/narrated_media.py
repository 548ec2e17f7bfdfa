"""Reading a narrated MP4 back with the ffmpeg binary imageio-ffmpeg ships: its streams, frames and audio."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np


def ffmpeg() -> str:
    import imageio_ffmpeg

    return imageio_ffmpeg.get_ffmpeg_exe()


def streams(path: str | Path) -> list[tuple[str, str]]:
    """(kind, codec) of each stream, as `ffmpeg -i` lists them: ("Video", "h264"), ("Audio", "aac")."""
    info = subprocess.run([ffmpeg(), "-hide_banner", "-i", str(path)], capture_output=True, text=True).stderr
    return re.findall(r"Stream #\d+:\d+.*?: (Video|Audio): (\w+)", info)


def frames(path: str | Path) -> np.ndarray:
    import imageio.v3 as iio

    return iio.imread(path)


def audio_pcm(path: str | Path, sample_rate: int) -> bytes:
    """The file's audio decoded to 16-bit mono PCM at `sample_rate`."""
    proc = subprocess.run([ffmpeg(), "-v", "error", "-i", str(path), "-map", "0:a:0", "-f", "s16le", "-ac", "1", "-ar",
                           str(sample_rate), "pipe:1"], capture_output=True, check=True)
    return proc.stdout


def wav(pcm: bytes, sample_rate: int) -> bytes:
    import io
    import wave

    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm)
    return out.getvalue()
