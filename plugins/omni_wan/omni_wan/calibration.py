"""MagCache calibration: the magnitude ratios of a local checkpoint, recorded once into the omni cache and read by
every later `step_cache=mag` request of that checkpoint.

`calibrate` runs one request through the model with the step cache in calibration mode (every block runs, and
each forward of the cond branch records the mean ratio of its residual's magnitude to the last one's, as
diffusers' `MagCacheConfig(calibrate=True)` does), and `record` writes them. A checkpoint is known by its
resolved path and its transformer's files (name, size, modification time): rebuilt weights need a new
calibration. `omni wan-calibrate` (calibrate_cli.py) is the command.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from omni_kernel.core.errors import InvalidParameter
from omni_kernel.util.files import cache_dir, write_json

from .presets import DEFAULT_NEGATIVE_PROMPT

COMMAND = "omni wan-calibrate --model PATH"


def checkpoint_key(path: str | Path) -> str:
    root = Path(path).expanduser().resolve()
    files = sorted((root / "transformer").glob("*"))
    facts = [str(root)] + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files if f.is_file()]
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:32]


def ratios_path(path: str | Path) -> Path:
    return cache_dir() / "step_cache" / f"mag_{checkpoint_key(path)}.json"


def load_ratios(path: str | Path | None) -> list[float] | None:
    """The checkpoint's recorded ratios; None when it has none (or its record is unreadable)."""
    if path is None:
        return None
    try:
        ratios = json.loads(ratios_path(path).read_text(encoding="utf-8"))["ratios"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(ratios, list) or not ratios or not all(isinstance(r, (int, float)) for r in ratios):
        return None
    return [float(r) for r in ratios]


def require_ratios(path: str | Path | None) -> list[float]:
    """The ratios `step_cache=mag` needs, or the one line that says which command records them."""
    ratios = load_ratios(path)
    if ratios is None:
        raise InvalidParameter("step_cache", f"mag needs this checkpoint's magnitude ratios and none are recorded for "
                                             f"{path}: run `{COMMAND}` once first, or use first_block")
    return ratios


def record(path: str | Path, ratios: list[float], about: dict) -> Path:
    target = ratios_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    return write_json(target, {"model": os.fspath(Path(path).resolve()), **about, "ratios": ratios})


def calibrate(model, prompt: str, height: int, width: int, num_frames: int, steps: int, guidance_scale: float,
              seed: int) -> list[float]:
    """The cond branch's magnitude ratio of each denoise step of one text-to-video request through `model` (a
    Wan22I2VPipeline), every block running."""
    import torch

    from .model import TextEmbeds
    from .step_cache import CachePolicy

    text = TextEmbeds(model.encode_text(prompt),
                      model.encode_text(DEFAULT_NEGATIVE_PROMPT) if guidance_scale > 1 else None)
    policy = CachePolicy("mag", threshold=0.0, steps=steps, calibrate=True)
    state = model.prepare(text, None, height, width, num_frames, steps, guidance_scale,
                          torch.Generator("cpu").manual_seed(seed), policy)
    for step in range(steps):
        model.denoise_batch([state], [step])
    return list(state.step_cache.branch("cond").ratios)

