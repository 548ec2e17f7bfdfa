"""What `diffusion.wan22_i2v` declares: its config (model-level, one per stage), its node policy (set by a pipeline
plan, validated when the plan is built) and its request parameters.

Request values left as None are filled from the preset when the request is processed (`resolve`).
Config keys share one flat namespace with the other nodes of a pipeline (the Qwen node's are `ar_`-prefixed).
"""

from __future__ import annotations

import os

import attrs

from omni_kernel.core.errors import InvalidParameter
from omni_kernel.core.params import MAX_SEED, boolean, integer, number, option, text

from .layout import ModelLayout
from .presets import DEFAULT_NEGATIVE_PROMPT, MAX_GUIDANCE, PRESETS, Settings, frames_for, validate
from .step_cache import DEFAULT_THRESHOLDS, METHODS

VAE_DTYPES = ("fp32", "bf16", "fp16")
X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow")
DEVICES = ("auto", "cpu", "cuda")
# Whether a request brings an image (inputs.check_image_policy): `required` (image-to-video), `none` (text-to-video:
# TI2V's prompt-only path) or `optional` (either, per request).
IMAGE_POLICIES = ("required", "none", "optional")


def _path(value):
    """A pathlib.Path is as good as its text; anything else is left for the `text` validator to refuse."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _preset(instance, attribute, value) -> None:
    if value is not None and value not in PRESETS:
        raise InvalidParameter("preset", f"{value!r} is not a preset; choose one of {', '.join(PRESETS)}")


@attrs.frozen
class WanConfig:
    model: str | None = option(None, help="local diffusion model directory (default: a tiny demo model)",
                               flag="--model", converter=_path, validator=text)
    vae_dtype: str | None = option(None, help="VAE dtype (default: fp32 on a CPU or a GPU of 40 GiB or more, "
                                              "else bf16)", flag="--vae-dtype", choices=VAE_DTYPES)
    disable_cpu_offload: bool = option(False, help="keep the whole diffusion model on the GPU", type=bool,
                                       flag="--disable-cpu-offload", validator=boolean)
    device: str = option("auto", help="where the diffusion model runs (auto: CUDA when available)",
                         choices=DEVICES)
    wan_max_batch: int = option(16, help="most video requests in one denoise forward (1: one at a time)", type=int,
                                validator=integer(1))
    wan_max_batch_tokens: int | None = option(
        None, help="latent-token budget of one denoise forward, CFG rows counted twice (default: sized from the "
                   "device's memory; a request over it runs alone)", type=int, validator=integer(1))
    wan_cfg_parallel: int = option(
        1, help="ranks that split classifier-free guidance, one branch each (1 or 2; 2 needs guidance_scale > 1)",
        type=int, validator=integer(1, 2))
    wan_ulysses: int = option(
        1, help="ranks that split each forward's latent tokens (Ulysses sequence parallelism; divides the "
                "transformer's attention heads)", type=int, validator=integer(1))
    wan_rank_restart_wait: float = option(
        600.0, help="seconds a request waits for a parallel stage's rank group that restarts after a rank died "
                    "(the new ranks load the transformer); past that it is refused as stage unavailable",
        type=float, validator=number(minimum=0))
    wan_video_preset: str = option(
        "veryfast", help="x264 preset of the MP4 export: faster presets use less CPU for larger files at the same "
                         "quality (medium is ffmpeg's default)", choices=X264_PRESETS)


@attrs.frozen
class WanPolicy:
    image: str = option("required", help="whether a request brings an image: required (image-to-video), none "
                                         "(text-to-video) or optional (either)", choices=IMAGE_POLICIES)
    preset: str | None = option(None, help="the preset of a request that names none (default: quality; smoke with "
                                           "the demo model)", choices=tuple(PRESETS))


@attrs.frozen
class WanParams:
    preset: str | None = option(None, help=f"diffusion preset ({', '.join(PRESETS)})", flag="--preset",
                                validator=_preset)
    height: int | None = option(None, help="video height in pixels (overrides the preset)", type=int,
                                flag="--height", validator=integer(1))
    width: int | None = option(None, help="video width in pixels (overrides the preset)", type=int,
                               flag="--width", validator=integer(1))
    num_frames: int | None = option(None, help="number of frames (overrides the preset)", type=int,
                                    flag="--num-frames", validator=integer(1))
    # The OpenAI Videos API asks for a duration; the frame count it means depends on the model's fps (resolve).
    seconds: float | None = option(None, help="video length in seconds, as frames at the model's fps (num_frames "
                                              "wins)", type=float, validator=number(above=0, maximum=60))
    num_inference_steps: int | None = option(None, help="denoise steps (overrides the preset)", type=int,
                                             flag="--steps", validator=integer(1))
    guidance_scale: float | None = option(None, help="classifier-free guidance scale (overrides the preset)",
                                          type=float, flag="--guidance-scale",
                                          validator=number(minimum=0, maximum=MAX_GUIDANCE))
    # The AR params declare the same field and flag: one --seed reaches both stages of qwen_to_wan_i2v.
    seed: int | None = option(None, help="random seed for sampling and noise", type=int, flag="--seed",
                              validator=integer(0, MAX_SEED))
    negative_prompt: str | None = option(None, help="negative prompt (default: Wan2.2's own)", validator=text)
    output: str | None = option(None, help="output file (e.g. out.mp4; default: ./omni_<request id>.mp4)",
                                flag="--output", converter=_path, validator=text)
    profile: bool = option(False, help="record per-phase times and a Chrome trace", type=bool, flag="--profile",
                           validator=boolean)
    step_cache: str | None = option(
        None, help="skip the transformer's blocks on steps whose input barely changed: none (default), first_block "
                   "(FirstBlockCache) or mag (MagCache; needs `omni wan-calibrate` for the checkpoint first)",
        flag="--step-cache", choices=METHODS)
    step_cache_threshold: float | None = option(
        None, help="how much change the step cache lets pass before it runs every block again (0: never skip; "
                   f"default {DEFAULT_THRESHOLDS['first_block']:g} for first_block, {DEFAULT_THRESHOLDS['mag']:g} "
                   "for mag): higher skips more, and past some value quality falls off a cliff", type=float,
        flag="--step-cache-threshold", validator=number(minimum=0))
    return_frames: bool = option(False, help="also return the frames as an array (StageOutput.data)", type=bool,
                                 validator=boolean)


def resolve(params: WanParams, layout: ModelLayout, image_size: tuple[int, int] | None,
            default_preset: str) -> Settings:
    """Fill what the request left open from its preset, orient the preset to the image (none: landscape), and
    validate."""
    name = params.preset or default_preset
    preset = PRESETS.get(name)
    if preset is None:
        raise InvalidParameter("preset", f"{name!r} is not a preset; choose one of {', '.join(PRESETS)}")
    height, width = preset.height, preset.width
    # (width, height): a portrait image gets a portrait video; no image, the preset's landscape size
    if image_size is not None and image_size[1] > image_size[0]:
        height, width = width, height
    settings = Settings(
        preset=name,
        height=_given(params.height, height),
        width=_given(params.width, width),
        num_frames=_given(params.num_frames, preset.num_frames if params.seconds is None
                          else frames_for(params.seconds, layout)),
        steps=_given(params.num_inference_steps, preset.steps),
        guidance_scale=float(_given(params.guidance_scale, preset.guidance_scale)),
        negative_prompt=_given(params.negative_prompt, DEFAULT_NEGATIVE_PROMPT),
        seed=params.seed,
        **step_cache(params.step_cache, params.step_cache_threshold))
    validate(settings, layout)
    return settings


def step_cache(method: str | None, threshold: float | None) -> dict:
    """The request's step cache and its threshold (the method's default when it names none)."""
    method = method or "none"
    if method == "none":
        if threshold is not None:
            raise InvalidParameter("step_cache_threshold", f"{threshold:g} has no step cache to act on: set "
                                                           f"step_cache to {' or '.join(DEFAULT_THRESHOLDS)}")
        return {"step_cache": "none", "step_cache_threshold": 0.0}
    return {"step_cache": method,
            "step_cache_threshold": float(DEFAULT_THRESHOLDS[method] if threshold is None else threshold)}


def _given(value, default):
    return default if value is None else value
