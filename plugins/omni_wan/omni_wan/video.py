"""H.264 MP4 export through imageio-ffmpeg, written atomically.

The video goes to a temporary file in the output's own directory and is renamed over the target only when
ffmpeg has finished, so an error, an abort or Ctrl-C never leaves a partial MP4 behind.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from omni_kernel.files import atomic_path


def to_uint8(frames: np.ndarray) -> np.ndarray:
    return (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)


def write_mp4(frames: np.ndarray, path: str | Path, fps: int, quality: int = 8) -> Path:
    """frames: (num_frames, height, width, 3), float in [0, 1] or uint8."""
    import imageio_ffmpeg

    path = Path(path)
    pixels = frames if frames.dtype == np.uint8 else to_uint8(frames)
    num_frames, height, width, channels = pixels.shape
    if channels != 3:
        raise ValueError(f"expected RGB frames, got {channels} channels")
    with atomic_path(path, suffix=".tmp.mp4") as tmp:
        writer = imageio_ffmpeg.write_frames(
            str(tmp), (width, height), fps=fps, codec="libx264", pix_fmt_in="rgb24", pix_fmt_out="yuv420p",
            quality=quality, macro_block_size=2, ffmpeg_log_level="error",
            output_params=["-movflags", "+faststart"])
        writer.send(None)
        try:
            for frame in pixels:
                writer.send(np.ascontiguousarray(frame))
        finally:
            writer.close()
    return path

