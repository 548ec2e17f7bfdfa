"""DiffusionStage (input processing once per request, events out) and the factory of `diffusion.wan22_i2v`.

The engine is the kernel's: Engine(DiffusionScheduler, WanRunner); one engine step is one phase (prepare,
one denoise step, decode, export) of the request at the front of the queue.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import attrs
from omni_kernel.engine import Engine
from omni_kernel.errors import InvalidParameter
from omni_kernel.events import StageProgress
from omni_kernel.graph import NodeSpec
from omni_kernel.request import StageInput
from omni_kernel.scheduler import DiffusionScheduler, RequestOutput
from omni_kernel.stage import Stage

from .images import image_digest, image_size, open_image
from .layout import ModelLayout, read_layout
from .outputs import check_request
from .params import WanConfig, WanParams
from .presets import Settings, resolve


@attrs.frozen
class WanInput:
    """A processed request: everything the runner needs, computed once."""

    settings: Settings  # seed filled in
    image: Any = attrs.field(repr=False)  # RGB PIL image, EXIF orientation applied
    digest: str
    output: Path


@attrs.frozen
class Denoised:
    """A prepare or denoise step's result: `step` of `total` denoise steps are done."""

    step: int
    total: int


class DiffusionStage(Stage):
    def __init__(self, node: NodeSpec, engine: Engine, layout: ModelLayout, default_preset: str):
        super().__init__(node, "diffusion", engine)
        self.layout = layout
        self.default_preset = default_preset

    def check(self, item: StageInput) -> None:
        # The image header's size is enough to resolve and validate the settings; the pixels are decoded once,
        # when the connector's input is processed.
        params = _params(item)
        check_request(item.prompt, params.output, item.request_id, params.profile)
        resolve(params, self.layout, image_size(item.image), self.default_preset)

    def process(self, item: StageInput) -> StageInput:
        params = _params(item)
        output = check_request(item.prompt, params.output, item.request_id, params.profile)
        image = open_image(item.image)
        settings = resolve(params, self.layout, image.size, self.default_preset)
        if settings.seed is None:
            settings = attrs.evolve(settings, seed=secrets.randbelow(2**31))
        processed = WanInput(settings, image, image_digest(image), output.absolute())
        return attrs.evolve(item, processed=processed)

    def postprocess(self, outputs: list[RequestOutput]) -> list:
        events = [StageProgress(o.request_id, self.node_id, o.result.step, o.result.total, "denoise")
                  for o in outputs if o.error is None and isinstance(o.result, Denoised)]
        return events + super().postprocess(outputs)


def check_output(output: str | None) -> None:
    if output is None:
        return
    path = Path(output).expanduser()
    if path.suffix.lower() != ".mp4":
        raise InvalidParameter("output", f"{str(path)!r} must end in .mp4 (the stage writes H.264 MP4)")
    if path.is_dir():
        raise InvalidParameter("output", f"{str(path)!r} is a directory; name a file such as {path / 'out.mp4'}")


def output_path(output: str | None, request_id: str) -> Path:
    """The request's `output`, or ./omni_<request_id>.mp4."""
    return Path(output or f"omni_{request_id}.mp4").expanduser().absolute()


def _params(item: StageInput) -> WanParams:
    return item.params if item.params is not None else WanParams()


class WanStages:
    """Builds `diffusion.wan22_i2v` stages. Owns the loaded models and the prepare cache, so every graph a plugin
    host builds shares them: a model loads once per process and host, and stays loaded."""

    def __init__(self):
        from .loader import ModelPool
        from .prepare_cache import PrepareCache

        self.pool = ModelPool()
        self.cache = PrepareCache()

    def build(self, node: NodeSpec, config: WanConfig | None) -> DiffusionStage:
        from .demo import ensure_demo_model
        from .device import place
        from .runner import WanRunner

        config = config or WanConfig()
        if config.model:
            layout, label, default_preset = read_layout(config.model), config.model, "quality"
        else:
            layout, label, default_preset = read_layout(ensure_demo_model()), "demo (random weights)", "smoke"
        default_preset = node.policy.get("preset", default_preset)
        runner = WanRunner(node.id, layout, place(config), label, self.pool, self.cache)
        scheduler = DiffusionScheduler(max_batch=1, num_steps=lambda item: item.processed.settings.steps)
        return DiffusionStage(node, Engine(scheduler, runner), layout, default_preset)
