"""DiffusionStage (refuses bad requests before anything runs) and the factory of `diffusion.wan22_i2v`.

The engine is the kernel's: Engine(StepScheduler, ModelRunner(DiffusionExecutor)); one engine step is one
phase or one denoise step of the request at the front of the queue.
"""

from __future__ import annotations

from pathlib import Path

from omni_kernel.engine import Engine
from omni_kernel.errors import InvalidParameter
from omni_kernel.graph import NodeSpec
from omni_kernel.request import Request
from omni_kernel.runner import ModelRunner
from omni_kernel.scheduler import StepScheduler
from omni_kernel.stage import Stage

from .images import open_image
from .layout import ModelLayout, read_layout
from .presets import resolve


class DiffusionStage(Stage):
    def __init__(self, node: NodeSpec, engine: Engine, layout: ModelLayout, default_preset: str):
        super().__init__(node, "diffusion", engine)
        self.layout = layout
        self.default_preset = default_preset

    def check(self, request: Request) -> None:
        image = open_image(request.image)
        resolve(request.params.get("diffusion"), self.layout, image.size, self.default_preset)
        check_output(request.options.get("output"))


def check_output(output) -> None:
    if output is None:
        return
    path = Path(output).expanduser()
    if path.suffix.lower() != ".mp4":
        raise InvalidParameter("output", f"{str(path)!r} must end in .mp4 (the stage writes H.264 MP4)")
    if path.is_dir():
        raise InvalidParameter("output", f"{str(path)!r} is a directory; name a file such as {path / 'out.mp4'}")


class WanStages:
    """Builds `diffusion.wan22_i2v` stages. Owns the loaded models and the prepare cache, so every graph a plugin
    host builds shares them: a model loads once per process and host, and stays loaded."""

    def __init__(self):
        from .loader import ModelPool
        from .prepare_cache import PrepareCache

        self.pool = ModelPool()
        self.cache = PrepareCache()

    def build(self, node: NodeSpec, config) -> DiffusionStage:
        """`config`: model (a Wan2.2-TI2V-5B-Diffusers directory; default: the demo), vae_dtype,
        disable_cpu_offload."""
        from .demo import ensure_demo_model
        from .device import place
        from .executor import DiffusionExecutor

        if config.get("model"):
            layout, label, default_preset = read_layout(config["model"]), str(config["model"]), "quality"
        else:
            layout, label, default_preset = read_layout(ensure_demo_model()), "demo (random weights)", "smoke"
        default_preset = node.policy.get("preset", default_preset)
        executor = DiffusionExecutor(node.id, layout, place(config), default_preset, label, self.pool, self.cache)
        engine = Engine(StepScheduler(max_batch=1), ModelRunner(executor, node.id))
        return DiffusionStage(node, engine, layout, default_preset)
