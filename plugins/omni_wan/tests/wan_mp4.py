"""Reading back what the Wan stage wrote, to check it."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def read_mp4(path: str | Path) -> tuple[dict, np.ndarray]:
    """(metadata, frames as uint8 (n, h, w, 3))."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = reader.__next__()
    width, height = meta["size"]
    frames = [np.frombuffer(buf, dtype=np.uint8).reshape(height, width, 3) for buf in reader]
    return meta, np.stack(frames) if frames else np.zeros((0, height, width, 3), np.uint8)
