"""Presets, the concrete settings a request resolves to (params.resolve) and their validation against the model."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import attrs

from omni_kernel.core.errors import InvalidParameter

from .layout import ModelLayout

# Wan2.2's own default negative prompt (its sample_neg_prompt), as the model card's examples pass it.
DEFAULT_NEGATIVE_PROMPT = (
    "色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，"
    "最差质量，低质量，JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，"
    "畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走")
MAX_SIDE = 4096
MAX_FRAMES = 1025
MAX_STEPS = 1000
# Classifier-free guidance past this gives no usable video (Wan2.2 uses 5; diffusers' pipelines stay under 20),
# and at 1e30 the prediction overflows: every latent becomes NaN and the "video" is noise.
MAX_GUIDANCE = 100.0
SAFE_STEPS = 100  # below this no scheduler config is read (every Wan2.2 scheduler gives distinct timesteps)


@attrs.frozen
class Preset:
    """Sizes are landscape (height < width); a portrait image swaps them."""

    name: str
    height: int
    width: int
    num_frames: int
    steps: int
    guidance_scale: float
    description: str


PRESETS = {p.name: p for p in (
    # The model card's recommended TI2V-5B settings: 720p (1280x704), 121 frames (5 s at 24 fps), 50 steps, cfg 5.
    Preset("quality", 704, 1280, 121, 50, 5.0, "model card: 1280x704, 121 frames, 50 steps, guidance 5.0"),
    Preset("balanced", 480, 832, 81, 30, 5.0, "480p, 81 frames, 30 steps"),
    Preset("fast", 352, 640, 49, 20, 5.0, "352x640, 49 frames, 20 steps"),
    Preset("smoke", 128, 128, 9, 4, 5.0, "128x128, 9 frames, 4 steps: seconds on a CPU with the demo model"),
)}


@attrs.frozen
class Settings:
    preset: str
    height: int
    width: int
    num_frames: int
    steps: int
    guidance_scale: float
    negative_prompt: str
    seed: int | None
    step_cache: str = "none"
    step_cache_threshold: float = 0.0

    def trace(self) -> dict:
        return {"diffusion.preset": self.preset, "diffusion.height": self.height, "diffusion.width": self.width,
                "diffusion.num_frames": self.num_frames, "diffusion.steps": self.steps,
                "diffusion.guidance": self.guidance_scale, "diffusion.step_cache": self.step_cache,
                "diffusion.step_cache_threshold": self.step_cache_threshold}


def frames_for(seconds: float, layout: ModelLayout) -> int:
    """The frame count of the valid form (temporal_factor * k + 1) nearest to `seconds` at the model's fps."""
    t = layout.temporal_factor
    return max(1, round(seconds * layout.fps / t)) * t + 1


def validate(settings: Settings, layout: ModelLayout) -> None:
    m, t = layout.spatial_multiple, layout.temporal_factor
    for field in ("height", "width"):
        value = getattr(settings, field)
        if value % m or not m <= value <= MAX_SIDE:
            raise InvalidParameter(field, f"{value} must be a multiple of {m} between {m} and {MAX_SIDE}; "
                                          f"nearest valid: {_nearest(value, m, 0, m, MAX_SIDE)}")
    frames = settings.num_frames
    if (frames - 1) % t or not 1 <= frames <= MAX_FRAMES:
        raise InvalidParameter("num_frames", f"{frames} must be {t}k+1 (1, {t + 1}, {2 * t + 1}, ...) and at most "
                                             f"{MAX_FRAMES}; nearest valid: {_nearest(frames, t, 1, 1, MAX_FRAMES)}")
    if not 0 <= settings.guidance_scale <= MAX_GUIDANCE:
        raise InvalidParameter("guidance_scale", f"{settings.guidance_scale:g} is outside 0..{MAX_GUIDANCE:g} (Wan2.2 "
                                                 "uses 5; above 1 turns classifier-free guidance on)")
    if settings.steps > MAX_STEPS:
        raise InvalidParameter("num_inference_steps", f"{settings.steps} is over the limit of {MAX_STEPS}")
    if settings.steps > SAFE_STEPS and layout.path is not None and settings.steps > (limit := max_steps(layout.path)):
        raise InvalidParameter("num_inference_steps", f"{settings.steps} is more than this checkpoint's noise "
                                                       f"scheduler can take: past {limit} steps it rounds two "
                                                       "timesteps to the same one")


@functools.lru_cache(maxsize=8)
def max_steps(path: Path) -> int:
    """The most denoise steps the checkpoint's scheduler gives distinct timesteps for (UniPC fails mid-run on a
    repeated one: Wan2.2's, with flow_shift 5, from 201 steps)."""
    import diffusers

    try:
        config = json.loads((Path(path) / "scheduler" / "scheduler_config.json").read_text(encoding="utf-8"))
        scheduler = getattr(diffusers, config["_class_name"]).from_config(config)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return MAX_STEPS  # loading the model reports a broken scheduler config, with its path
    for steps in range(SAFE_STEPS, MAX_STEPS + 1):
        scheduler.set_timesteps(steps)
        if len(set(scheduler.timesteps.tolist())) < steps:
            return steps - 1
    return MAX_STEPS


def _nearest(value: int, step: int, offset: int, low: int, high: int) -> str:
    """The valid values (offset + k*step within [low, high]) nearest to value, e.g. "96 or 128"."""
    below = max(low, min(high, offset + (value - offset) // step * step))
    above = min(high, max(low, below + step if below < value else below))
    return str(below) if below == above else f"{below} or {above}"
