"""H.264 MP4 export through the ffmpeg binary that imageio-ffmpeg ships, written atomically and checked.

The video goes to a temporary file in the output's own directory and is renamed over the target only when
ffmpeg exited 0, the file is flushed to disk and its MP4 boxes account for every byte of it; so an error, a
full disk, an abort, Ctrl-C or SIGTERM never leaves a partial MP4 behind, and a special file at the target
(/dev/null) is never replaced. ffmpeg's own messages go to the "omni" log at debug level.
"""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from omni_kernel.core.errors import RequestError
from omni_kernel.util.files import atomic_path

log = logging.getLogger("omni")


def sync_file(path: str | Path) -> None:
    """Flush a written file to its disk: a full or failing disk shows up here, not after the rename."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def to_uint8(frames: np.ndarray) -> np.ndarray:
    return (np.clip(np.nan_to_num(frames, nan=0.0), 0.0, 1.0) * 255).round().astype(np.uint8)


def write_mp4(frames: np.ndarray, path: str | Path, fps: int, quality: int = 8, preset: str = "veryfast") -> Path:
    """frames: (num_frames, height, width, 3), float in [0, 1] or uint8. The x264 `preset` trades CPU for file
    size, not quality (that is the CRF, from `quality`): veryfast took 1.4-4x less CPU than ffmpeg's medium on the
    runtime's videos (docs/wan.md)."""
    path = Path(path)
    pixels = frames if frames.dtype == np.uint8 else to_uint8(frames)
    num_frames, height, width, channels = pixels.shape
    if channels != 3:
        raise ValueError(f"expected RGB frames, got {channels} channels")
    with atomic_path(path, suffix=".tmp.mp4") as tmp:
        _ffmpeg(pixels, tmp, path, width, height, fps, quality, preset)
        sync_file(tmp)
        problem = mp4_problem(tmp)
        if problem:
            raise RequestError(f"cannot write {path}: the MP4 is incomplete ({problem})")
    return path


def _ffmpeg(pixels: np.ndarray, out: Path, target: Path, width: int, height: int, fps: int, quality: int,
            preset: str) -> None:
    import imageio_ffmpeg

    crf = int((1 - quality / 10.0) * 51)  # imageio-ffmpeg's mapping of quality 0..10 for libx264
    cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-f", "rawvideo", "-vcodec", "rawvideo", "-s", f"{width}x{height}",
           "-pix_fmt", "rgb24", "-r", str(fps), "-i", "-", "-an", "-vcodec", "libx264", "-pix_fmt", "yuv420p",
           "-crf", str(crf), "-preset", preset]
    if width % 2 or height % 2:
        cmd += ["-vf", f"scale={width + width % 2}:{height + height % 2}"]
    cmd += ["-v", "error", "-movflags", "+faststart", "-f", "mp4", str(out)]  # `out` may have no extension
    with tempfile.TemporaryFile() as errors:
        # its own session: a terminal's Ctrl-C reaches omni, which stops ffmpeg and removes the file
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=errors,
                                start_new_session=True)
        try:
            try:
                for frame in pixels:
                    proc.stdin.write(np.ascontiguousarray(frame).tobytes())
            except BrokenPipeError:
                pass  # ffmpeg gave up (e.g. the disk is full): its exit status and message say why
            finally:
                try:
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
            code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        errors.seek(0)
        text = errors.read().decode("utf-8", "replace")
    for line in text.splitlines():
        log.debug("ffmpeg: %s", line)
    if code != 0:
        last = next((line for line in reversed(text.splitlines()) if line.strip()), f"exit status {code}")
        reason = last.split("] ", 1)[-1].strip()
        raise RequestError(f"cannot write {target}: ffmpeg failed ({reason})")


def mp4_problem(path: Path) -> str | None:
    """None when the file's top-level MP4 boxes cover exactly its size and include moov and mdat."""
    size, seen, offset = path.stat().st_size, set(), 0
    with open(path, "rb") as f:
        while offset < size:
            f.seek(offset)
            header = f.read(16)
            if len(header) < 8:
                return f"a truncated box at byte {offset}"
            box, kind = struct.unpack(">I", header[:4])[0], header[4:8]
            if box == 1 and len(header) == 16:
                box = struct.unpack(">Q", header[8:16])[0]
            elif box == 0:
                box = size - offset
            if box < 8 or offset + box > size:
                return f"box {kind!r} at byte {offset} runs past the end of the file ({size} bytes)"
            seen.add(kind)
            offset += box
    missing = {b"ftyp", b"moov", b"mdat"} - seen
    return f"no {', '.join(sorted(m.decode() for m in missing))} box" if missing else None
