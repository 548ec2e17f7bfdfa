"""Audio input: any file ffmpeg decodes (WAV incl. IEEE float, MP3, FLAC, OGG/Opus, WebM from a browser's
MediaRecorder, M4A), as 16 kHz mono float32 samples, or one line saying why not. No model, no torch.

The ffmpeg binary is imageio-ffmpeg's (the one omni ships). A request's audio is a file's path or its bytes (an
upload); bytes are written to a temporary file first, since some containers (M4A with its index at the end) cannot
be read from a pipe. What is refused, before any model work:
- a missing path, or one that is not a file;
- an empty input, or one that decodes to no samples;
- what ffmpeg cannot decode (not audio), or decodes with an error (a truncated or corrupt file);
- silence: a peak below SILENCE_DBFS (-60 dBFS, i.e. |sample| < 0.001 of full scale) over the whole file;
- audio longer than MAX_SECONDS (30 minutes): decoding stops a second past the limit, so a long file costs little.
"""

from __future__ import annotations

import math
import os
import re
import struct
import subprocess
import tempfile
from pathlib import Path

import attrs
import numpy as np

from omni_kernel.core.errors import InputError

SAMPLE_RATE = 16000
MAX_SECONDS = 30 * 60
SILENCE_DBFS = -60.0
SILENCE_PEAK = 10 ** (SILENCE_DBFS / 20)  # 0.001 of full scale


@attrs.frozen
class DecodedAudio:
    """A request's audio as the model hears it: mono float32 samples at SAMPLE_RATE."""

    samples: np.ndarray = attrs.field(eq=False, repr=False)
    sample_rate: int = SAMPLE_RATE

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate


def ffmpeg_exe() -> str:
    import imageio_ffmpeg

    return imageio_ffmpeg.get_ffmpeg_exe()


def decode(audio: str | os.PathLike | bytes) -> DecodedAudio:
    """The audio (a path, or a file's bytes) decoded, resampled and checked; an InputError in one line if not."""
    if isinstance(audio, (bytes, bytearray, memoryview)):
        data = bytes(audio)
        if not data:
            raise InputError("the audio is empty (0 bytes)")
        return _decode_bytes(data, "the uploaded audio")
    path = Path(audio).expanduser()
    if not path.exists():
        raise InputError(f"no such audio file: {str(path)!r}")
    if not path.is_file():
        raise InputError(f"the audio {str(path)!r} is not a file")
    if path.stat().st_size == 0:
        raise InputError(f"the audio file {str(path)!r} is empty (0 bytes)")
    with path.open("rb") as file:
        head = file.read(WAV_HEAD)
    if _streamed_wav(head):
        return _decode_bytes(path.read_bytes(), f"the audio file {str(path)!r}")
    return _checked(_run_ffmpeg(str(path), f"the audio file {str(path)!r}"))


def _decode_bytes(data: bytes, what: str) -> DecodedAudio:
    with tempfile.NamedTemporaryFile(prefix="omni-audio-", suffix=".bin") as file:
        file.write(_sized(data) if _streamed_wav(data) else data)
        file.flush()
        return _checked(_run_ffmpeg(file.name, what))


# A WAV written as it streamed (omni's own /v1/audio/speech) cannot know its length: its RIFF and data sizes say
# 0xFFFFFFFF, which ffmpeg reads as data past the file's end (an error under -xerror). Its sizes are written in.
UNKNOWN_SIZE = 0xFFFFFFFF
WAV_HEAD = 12


def _streamed_wav(data: bytes) -> bool:
    return (len(data) >= WAV_HEAD and data[:4] == b"RIFF" and data[8:12] == b"WAVE"
            and struct.unpack_from("<I", data, 4)[0] == UNKNOWN_SIZE)


def _sized(data: bytes) -> bytes:
    """The WAV with its real RIFF size, and the real size of a data chunk of unknown length."""
    sized = bytearray(data)
    struct.pack_into("<I", sized, 4, len(data) - 8)
    at = WAV_HEAD
    while at + 8 <= len(data):
        chunk, size = data[at:at + 4], struct.unpack_from("<I", data, at + 4)[0]
        if chunk == b"data":
            if size == UNKNOWN_SIZE:
                struct.pack_into("<I", sized, at + 4, len(data) - at - 8)
            break
        at += 8 + size + size % 2
    return bytes(sized)


def _run_ffmpeg(path: str, what: str) -> np.ndarray:
    command = [ffmpeg_exe(), "-nostdin", "-hide_banner", "-loglevel", "error", "-xerror", "-i", path,
               "-t", str(MAX_SECONDS + 1), "-vn", "-f", "f32le", "-ac", "1", "-ar", str(SAMPLE_RATE), "pipe:1"]
    done = subprocess.run(command, capture_output=True, check=False)
    reason = _reason(done.stderr)
    if done.returncode != 0 and not done.stdout:
        raise InputError(f"{what} is not audio that ffmpeg can decode ({reason or 'no audio stream'})")
    if done.returncode != 0 or reason:
        raise InputError(f"{what} is truncated or corrupt: ffmpeg stopped with an error ({reason or 'no reason'})")
    return np.frombuffer(done.stdout, dtype="<f4")


def _reason(stderr: bytes) -> str:
    """ffmpeg's last error line, without its "[demuxer @ 0x...]" tags, the path it repeats or its exit code."""
    lines = [line.strip() for line in stderr.decode("utf-8", "replace").splitlines() if line.strip()]
    if not lines:
        return ""
    line = re.sub(r"^(\[[^\]]*\]\s*)+", "", lines[-1])
    inner = re.search(r"return code -?\d+ \((.*)\)$", line)
    if inner:
        return inner.group(1)
    return line.rsplit(": ", 1)[-1]


def _checked(samples: np.ndarray) -> DecodedAudio:
    if samples.size == 0:
        raise InputError("the audio is empty: it decodes to no samples")
    seconds = samples.size / SAMPLE_RATE
    if seconds > MAX_SECONDS:
        raise InputError(f"the audio is longer than the limit of {MAX_SECONDS / 60:g} minutes")
    if not np.isfinite(samples).all():
        raise InputError("the audio holds samples that are not finite numbers")
    peak = float(np.abs(samples).max())
    if peak < SILENCE_PEAK:
        level = "-inf" if peak == 0 else f"{20 * math.log10(peak):.0f}"
        raise InputError(f"the audio is silent: its peak is {level} dBFS, below {SILENCE_DBFS:.0f} dBFS")
    return DecodedAudio(samples.astype(np.float32, copy=False))
