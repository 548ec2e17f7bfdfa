"""A speech answer's bytes as the sound comes: 16-bit mono PCM chunks (a TTS stage's AudioDelta events) in the
format the request asked for, each chunk encoded as soon as it arrives, so the first bytes leave before the whole
text is spoken.

wav is a header whose sizes say "unknown length" (0xFFFFFFFF, as a stream cannot know its end) followed by the
PCM as it is, at the voice's own rate. pcm is OpenAI's: raw 16-bit little-endian mono at 24 kHz (the rate its
clients assume), resampled from the voice's. mp3, opus (in Ogg), aac (ADTS) and flac come from a streaming ffmpeg
process (imageio-ffmpeg's binary) that reads the PCM on its stdin and writes each packet to its stdout at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
PCM_RATE = 24000
OPUS_RATE = 24000  # libopus takes 48, 24, 16, 12 or 8 kHz
MEDIA_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac", "wav": "audio/wav",
               "pcm": "audio/pcm"}
# ffmpeg's encoder and stream-friendly container of each format; pcm only resamples.
ENCODERS = {"mp3": ["-c:a", "libmp3lame", "-b:a", "64k", "-f", "mp3"],
            "opus": ["-c:a", "libopus", "-b:a", "32k", "-ar", str(OPUS_RATE), "-f", "ogg"],
            "aac": ["-c:a", "aac", "-b:a", "64k", "-f", "adts"],
            "flac": ["-c:a", "flac", "-f", "flac"],
            "pcm": ["-c:a", "pcm_s16le", "-ar", str(PCM_RATE), "-f", "s16le"]}
READ_SIZE = 1 << 16
EXIT_S = 5.0  # an encoder whose output ended exits within this, else it is killed
UNKNOWN = 0xFFFFFFFF


def wav_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header of unknown length."""
    return (b"RIFF" + struct.pack("<I", UNKNOWN) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate,
                                                                              sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", UNKNOWN))


def ffmpeg_exe() -> str:
    import imageio_ffmpeg

    return imageio_ffmpeg.get_ffmpeg_exe()


class Encoder:
    """Feed PCM with `write`, end it with `end`; `read` gives the encoded bytes as they come, b"" at the end."""

    def __init__(self, fmt: str, sample_rate: int):
        self.fmt, self.sample_rate = fmt, sample_rate
        self.proc: asyncio.subprocess.Process | None = None
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()  # wav: what `read` hands out
        self.drained = False  # ffmpeg's output ended: it exits by itself

    async def start(self) -> Encoder:
        if self.fmt == "wav":
            self.queue.put_nowait(wav_header(self.sample_rate))
            return self
        args = [ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-f", "s16le", "-ar", str(self.sample_rate),
                "-ac", "1", "-i", "pipe:0", *ENCODERS[self.fmt], "-flush_packets", "1", "pipe:1"]
        self.proc = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.PIPE,
                                                         stdout=asyncio.subprocess.PIPE,
                                                         stderr=asyncio.subprocess.DEVNULL)
        return self

    async def write(self, pcm: bytes) -> None:
        if self.proc is None:
            self.queue.put_nowait(pcm)
            return
        self.proc.stdin.write(pcm)
        await self.proc.stdin.drain()

    async def end(self) -> None:
        if self.proc is None:
            self.queue.put_nowait(b"")
            return
        self.proc.stdin.close()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            await self.proc.stdin.wait_closed()

    async def read(self) -> bytes:
        if self.proc is None:
            return await self.queue.get()
        data = await self.proc.stdout.read(READ_SIZE)
        self.drained = not data
        return data

    async def close(self) -> None:
        """Stop the encoder (at the end, or when the client went away or the request failed). One that wrote its
        last byte is left to exit and be reaped by asyncio's watcher: killing it would reap it first (Popen.kill
        polls), and the watcher would log an unknown child."""
        if self.proc is None:
            return
        if not self.drained:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        try:
            await asyncio.wait_for(self.proc.wait(), EXIT_S)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()
