"""WanInputProcessor: what a Wan stage makes of a request's input, once, before its engine sees it.

The prompt must say something, the MP4 (and with `profile` its Chrome trace) must be creatable, the image is
decoded (EXIF orientation applied) and the preset and overrides are resolved against the model's layout; an
unseeded request gets its seed here. `check` reads only the image header: it is the node type's `check` too
(build.check_request), which the kernel runs before any model loads, and a downstream node's at submit.

Whether a request must bring an image is the node's policy `image` (params.IMAGE_POLICIES): `required` (wan_i2v,
the default), `none` (wan_t2v: the prompt alone; TI2V's text-to-video path) or `optional` (either, per request).
A request against it fails in `check`, naming the field `image` (the CLI's --image, the Videos API's
input_reference).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import attrs

from omni_kernel.core.errors import InvalidParameter
from omni_kernel.core.params import check_prompt
from omni_kernel.core.request import StageInput
from omni_kernel.util.files import check_output_path

from .calibration import require_ratios
from .images import image_digest, image_size, open_image
from .layout import ModelLayout
from .params import IMAGE_POLICIES, WanParams, resolve
from .presets import Settings
from .profiler import profile_path


@attrs.frozen
class WanInput:
    """A processed request: everything the runner needs, computed once."""

    settings: Settings  # seed filled in
    image: Any = attrs.field(repr=False)  # RGB PIL image, EXIF orientation applied; None: text-to-video
    digest: str | None
    output: Path


def check_request(prompt: str, output: str | None, request_id: str, profile: bool = False) -> Path:
    """The request's output path; InputError for an empty prompt (the kernel's check_prompt),
    InvalidParameter("output") for a path that cannot be written (see omni_kernel.util.files.check_output_path)."""
    check_prompt(prompt)
    if output is not None and not output.strip():
        raise InvalidParameter("output", "is empty; name a file such as out.mp4, or leave it out for "
                                         f"omni_{request_id}.mp4")
    path = Path(output or f"omni_{request_id}.mp4").expanduser()
    if path.suffix.lower() != ".mp4":
        raise InvalidParameter("output", f"{str(path)!r} must end in .mp4 (the stage writes H.264 MP4)")
    if os.path.isdir(path):  # (never raises, e.g. for a name too long)
        raise InvalidParameter("output", f"{str(path)!r} is a directory; name a file such as {path / 'out.mp4'}")
    target = check_output_path(path, "output")
    if profile:
        check_output_path(profile_path(target), "output")
    return target


def check_image_policy(policy: str, image: str | None) -> bool:
    """Whether the request brings an image, or InvalidParameter("image") when the node's policy refuses that."""
    given = image is not None and str(image) != ""
    if given and policy == "none":
        raise InvalidParameter("image", "this pipeline renders video from the prompt alone and takes no image: "
                                        "drop --image, or use an image-to-video pipeline (wan_i2v, qwen_to_wan_i2v)")
    if not given and policy == "required":
        raise InvalidParameter("image", "this pipeline needs an input image: pass --image PATH (PNG, JPEG, WebP, "
                                        "...), or use a text-to-video pipeline (wan_t2v, qwen_to_wan_t2v)")
    return given


def check_guidance(guidance_scale: float, cfg_parallel: int) -> None:
    """Guidance-parallel runs the uncond branch on a rank of its own: a request without guidance has none."""
    if cfg_parallel > 1 and guidance_scale <= 1:
        raise InvalidParameter("guidance_scale", f"{guidance_scale:g} turns classifier-free guidance off, but "
                                                 f"wan_cfg_parallel={cfg_parallel} runs the uncond branch on ranks "
                                                 "of its own: use a guidance_scale above 1, or wan_cfg_parallel=1")


class WanInputProcessor:
    concurrent = True  # processing reads the image and the layout only: never a step's state

    def __init__(self, layout: ModelLayout, default_preset: str, image: str = "required", cfg_parallel: int = 1):
        if image not in IMAGE_POLICIES:
            raise ValueError(f"image policy {image!r} is not one of {', '.join(IMAGE_POLICIES)}")
        self.layout = layout
        self.default_preset = default_preset
        self.image_policy = image
        self.cfg_parallel = cfg_parallel

    def check(self, item: StageInput) -> None:
        # The image header's size is enough to resolve and validate the settings; the pixels are decoded once,
        # when the input is processed.
        _, given = self._inputs(item)
        self._settings(item, image_size(item.image) if given else None)

    def process(self, item: StageInput) -> StageInput:
        # Not `check` and then the rest: the settings are resolved once, from the decoded image, whose EXIF
        # orientation (which the header's size does not apply) can make a landscape file a portrait video.
        output, given = self._inputs(item)
        image = open_image(item.image) if given else None
        settings = self._settings(item, None if image is None else image.size)
        if settings.seed is None:
            settings = attrs.evolve(settings, seed=secrets.randbelow(2**31))
        digest = None if image is None else image_digest(image)
        return attrs.evolve(item, processed=WanInput(settings, image, digest, output.absolute()))

    def _inputs(self, item: StageInput) -> tuple[Path, bool]:
        """The prompt, the output path (returned) and whether the request brings an image, against the policy."""
        params = _params(item)
        output = check_request(item.prompt, params.output, item.request_id, params.profile)
        return output, check_image_policy(self.image_policy, item.image)

    def _settings(self, item: StageInput, image_size: tuple[int, int] | None) -> Settings:
        """The request's settings, resolved against the model and checked against the stage."""
        settings = resolve(_params(item), self.layout, image_size, self.default_preset)
        check_guidance(settings.guidance_scale, self.cfg_parallel)
        self._check_step_cache(settings)
        return settings

    def _check_step_cache(self, settings: Settings) -> None:
        """`mag` needs the checkpoint's calibrated ratios (calibration.py): refused before any work without them."""
        if settings.step_cache == "mag":
            require_ratios(self.layout.path)


def _params(item: StageInput) -> WanParams:
    return item.params if item.params is not None else WanParams()
