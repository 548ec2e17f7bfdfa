"""DiffusionStage (input processing once per request, events out) and the factory of `diffusion.wan22_i2v`.

The engine is the kernel's: Engine(DiffusionScheduler, WanRunner); one engine step is one phase (prepare,
one denoise step, decode, export). Finishing and newly arrived requests go first (export, decode, prepare),
then every denoising request of one batch key (size, frames, CFG on/off, dtype) shares one denoise forward,
each at its own step, up to `wan_max_batch` requests and `wan_max_batch_tokens` latent tokens. On a GPU the export
step only hands the frames to the runner's export thread; the stage reports the request when its MP4 is written,
and blocks on that in `wait`, not in `step`.
"""

from __future__ import annotations

import concurrent.futures
import secrets
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs
from omni_kernel.engine import Engine
from omni_kernel.errors import InvalidParameter
from omni_kernel.events import StageFailed, StageFinished, StageProgress
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
    concurrent_process = True  # an input's processing reads the image and the layout only: never a step's state

    def __init__(self, node: NodeSpec, engine: Engine, layout: ModelLayout, default_preset: str):
        super().__init__(node, "diffusion", engine)
        self.layout = layout
        self.default_preset = default_preset
        self.exporting: dict[str, Future] = {}  # request id -> its StageOutput, once the export thread wrote it

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

    def step(self) -> list:
        return self.postprocess(self.engine.step()) + self._exported()

    def postprocess(self, outputs: list[RequestOutput]) -> list:
        events = [StageProgress(o.request_id, self.node_id, o.result.step, o.result.total, "denoise")
                  for o in outputs if o.error is None and isinstance(o.result, Denoised)]
        for out in outputs:
            if out.finished is not None and isinstance(out.result, Future):
                self.exporting[out.request_id] = out.result
        return events + super().postprocess([o for o in outputs if o.request_id not in self.exporting])

    def _exported(self) -> list:
        """Events of the exports that ended since the last step, in the order they were handed over."""
        events = []
        for rid, future in list(self.exporting.items()):
            if not future.done():
                continue
            del self.exporting[rid]
            try:
                events.append(StageFinished(rid, self.node_id, future.result()))
            except Exception as exc:  # noqa: BLE001 - e.g. the disk is full: this request fails alone
                events.append(StageFailed.of(rid, self.node_id, exc))
        return events

    def abort(self, request_id: str) -> None:
        future = self.exporting.pop(request_id, None)
        if future is not None and not future.cancel():
            future.add_done_callback(_remove_output)  # an aborted request leaves no MP4 behind
        super().abort(request_id)

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or bool(self.exporting)

    def request_ids(self) -> set[str]:
        return super().request_ids() | set(self.exporting)

    def wait(self, timeout: float | None = None) -> bool:
        """Ready at once with engine work; with only exports running, block until one ends (or `timeout`)."""
        if self.engine.has_unfinished():
            return True
        if not self.exporting:
            return False
        done, _ = concurrent.futures.wait(list(self.exporting.values()), timeout,
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        return bool(done)


def _remove_output(future: Future) -> None:
    if not future.cancelled() and future.exception() is None:
        Path(future.result().path).unlink(missing_ok=True)


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
        placement = place(config)
        budget, why = token_budget(config, placement, layout)
        runner = WanRunner(node.id, layout, placement, label, self.pool, self.cache,
                           budget=f"batching up to {config.wan_max_batch} requests and {budget} latent tokens "
                                  f"per denoise step ({why})", video_preset=config.wan_video_preset)
        scheduler = DiffusionScheduler(
            max_batch=config.wan_max_batch, num_steps=lambda item: item.processed.settings.steps,
            batch_key=lambda item: batch_key(item.processed.settings, placement.dtype),
            cost=lambda item: latent_tokens(item.processed.settings, layout), max_cost=budget,
            phase_order=("export", "decode", "prepare", "denoise"))
        return DiffusionStage(node, Engine(scheduler, runner), layout, default_preset)


def batch_key(s: Settings, dtype: str) -> tuple:
    """Requests that can share a denoise forward: same latent shape, CFG on or off, same dtype."""
    return s.height, s.width, s.num_frames, s.guidance_scale > 1, dtype


def latent_tokens(s: Settings, layout: ModelLayout) -> int:
    """A request's rows in a denoise forward: its transformer sequence length, twice with CFG."""
    frames = (s.num_frames - 1) // layout.temporal_factor + 1
    tokens = frames * (s.height // layout.spatial_multiple) * (s.width // layout.spatial_multiple)
    return tokens * (2 if s.guidance_scale > 1 else 1)


CPU_TOKEN_BUDGET = 16384  # on a CPU a forward is compute-bound long before memory matters


def token_budget(config: WanConfig, placement, layout: ModelLayout) -> tuple[int, str]:
    """`wan_max_batch_tokens`, or a default: on a GPU, half its memory beyond 24 GiB (the weights, the VAE
    decode) at a rough 4 bytes x (ffn_dim + 8 x hidden) of activations per token (bf16, with headroom)."""
    if config.wan_max_batch_tokens is not None:
        return config.wan_max_batch_tokens, "wan_max_batch_tokens"
    if placement.device != "cuda":
        return CPU_TOKEN_BUDGET, "default for cpu"
    import json

    import torch

    t = json.loads((layout.path / "transformer" / "config.json").read_text(encoding="utf-8"))
    hidden = t.get("num_attention_heads", 24) * t.get("attention_head_dim", 128)
    per_token = 4 * (t.get("ffn_dim", 14336) + 8 * hidden)
    spare = torch.cuda.get_device_properties(0).total_memory - 24 * 2**30
    return max(1, spare // 2 // per_token), "default for cuda: half the memory beyond 24 GiB"
