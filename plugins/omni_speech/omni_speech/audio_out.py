"""Speech audio as files and streams: 16-bit mono PCM encoded as wav, mp3, flac, opus (Ogg), aac (ADTS) or pcm (raw
s16le), with the ffmpeg binary imageio-ffmpeg ships (encoders libmp3lame, flac, libopus, aac).

`write_audio` writes a whole file atomically (omni_kernel.util.files.atomic_path: an error or a kill leaves no
partial file). `StreamEncoder` encodes as the audio comes: `feed` a chunk, get the bytes ffmpeg has made so far;
`close` gives the rest. A wav stream's header says "length unknown" (all sizes 0xFFFFFFFF), as streamed WAV does.
`encoded_stream` turns a request's events (`Omni.generate_stream`) into the encoded file's bytes as they come.
For the CLI and the Python API; `omni serve` has its own encoder (it does not import this plugin).
"""

from __future__ import annotations

import os
import struct
import subprocess
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from omni_kernel.core.errors import RequestError
from omni_kernel.core.events import AudioDelta, RequestFailed
from omni_kernel.core.request import Audio
from omni_kernel.util.files import atomic_path

OPUS_RATE = 48000  # libopus takes 8, 12, 16, 24 or 48 kHz: other rates are resampled to this
# ffmpeg's output arguments for each encoded format
FFMPEG_FORMATS = {"mp3": ["-c:a", "libmp3lame", "-b:a", "64k", "-f", "mp3"],
                  "flac": ["-c:a", "flac", "-f", "flac"],
                  "opus": ["-c:a", "libopus", "-b:a", "32k", "-ar", str(OPUS_RATE), "-f", "ogg"],
                  "aac": ["-c:a", "aac", "-b:a", "64k", "-f", "adts"]}
UNKNOWN = 0xFFFFFFFF


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """A 44-byte PCM WAV header for 16-bit mono; None: length unknown (a stream)."""
    data = UNKNOWN if data_bytes is None else data_bytes
    riff = UNKNOWN if data_bytes is None else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate,
                                                                         sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data))


def encode(audio: Audio, fmt: str) -> bytes:
    """The whole audio in `fmt`."""
    if fmt == "pcm":
        return audio.pcm
    if fmt == "wav":
        return wav_header(audio.sample_rate, len(audio.pcm)) + audio.pcm
    if fmt not in FFMPEG_FORMATS:
        raise ValueError(f"unknown audio format {fmt!r}")
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.run(_ffmpeg_command(audio.sample_rate, fmt), input=audio.pcm, stdout=subprocess.PIPE,
                              stderr=errors, start_new_session=True)
        if proc.returncode != 0:
            errors.seek(0)
            raise RequestError(f"ffmpeg could not encode {fmt}: {_last_line(errors.read())}")
    return proc.stdout


def write_audio(path: str | Path, audio: Audio, fmt: str) -> Path:
    """Write the audio to `path` in `fmt`, atomically (no partial file on any failure)."""
    body = encode(audio, fmt)
    path = Path(path)
    with atomic_path(path, suffix=f".tmp.{fmt}") as tmp:
        with open(tmp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
    return path


class StreamEncoder:
    """Encodes audio chunk by chunk: `feed(pcm)` returns the encoded bytes ready so far, `close()` the rest."""

    def __init__(self, sample_rate: int, fmt: str):
        self.sample_rate = sample_rate
        self.format = fmt
        self.started = False
        self.proc: subprocess.Popen | None = None
        self.ready: list[bytes] = []
        self.lock = threading.Lock()
        self.reader: threading.Thread | None = None
        if fmt in FFMPEG_FORMATS:
            self.errors = tempfile.TemporaryFile()
            self.proc = subprocess.Popen(_ffmpeg_command(sample_rate, fmt), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.errors, start_new_session=True)
            self.reader = threading.Thread(target=self._read, daemon=True, name="omni-audio-encoder")
            self.reader.start()
        elif fmt not in ("wav", "pcm"):
            raise ValueError(f"unknown audio format {fmt!r}")

    def _read(self) -> None:
        while True:
            block = self.proc.stdout.read1(1 << 16)
            if not block:
                return
            with self.lock:
                self.ready.append(block)

    def _take(self) -> bytes:
        with self.lock:
            out, self.ready = b"".join(self.ready), []
        return out

    def feed(self, pcm: bytes) -> bytes:
        if self.proc is None:
            header = b"" if self.started or self.format == "pcm" else wav_header(self.sample_rate, None)
            self.started = True
            return header + pcm
        self.proc.stdin.write(pcm)
        self.proc.stdin.flush()
        return self._take()

    def close(self) -> bytes:
        if self.proc is None:
            return b"" if self.started or self.format == "pcm" else wav_header(self.sample_rate, None)
        self.proc.stdin.close()
        self.reader.join()
        code = self.proc.wait()
        self.errors.seek(0)
        message = _last_line(self.errors.read())
        self.errors.close()
        if code != 0:
            raise RequestError(f"ffmpeg could not encode {self.format}: {message}")
        return self._take()

    def abort(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def encoded_stream(events: Iterable, fmt: str) -> Iterator[bytes]:
    """The bytes of a speech request's audio in `fmt`, encoded as its AudioDeltas come (e.g.
    `encoded_stream(Omni("tts").generate_stream("Hello."), "mp3")`); a failed request raises its error."""
    encoder: StreamEncoder | None = None
    try:
        for event in events:
            if isinstance(event, AudioDelta):
                encoder = encoder or StreamEncoder(event.sample_rate, fmt)
                block = encoder.feed(event.pcm)
                if block:
                    yield block
            elif isinstance(event, RequestFailed):
                raise event.exception()
        if encoder is not None:
            yield encoder.close()
            encoder = None
    finally:
        if encoder is not None:
            encoder.abort()


def _ffmpeg_command(sample_rate: int, fmt: str) -> list[str]:
    import imageio_ffmpeg

    return [imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-v", "error", "-f", "s16le", "-ar", str(sample_rate),
            "-ac", "1", "-i", "pipe:0", *FFMPEG_FORMATS[fmt], "pipe:1"]


def _last_line(data: bytes) -> str:
    lines = data.decode("utf-8", "replace").strip().splitlines()
    return lines[-1] if lines else "no message"
