"""DiffusionExecutor: per-request Wan2.2 state advanced one phase per engine step.

A request moves prepare -> denoise (one step per engine step) -> vae_decode -> export; it can be aborted
between any two (the engine calls `free`), and nothing is written before the export phase, which writes the
MP4 atomically.
"""

from __future__ import annotations

import logging
import secrets
import time
from pathlib import Path
from typing import Any

import attrs
from omni_kernel.events import StageFinished, StageProgress
from omni_kernel.request import StageInput, StageOutput
from omni_kernel.scheduler import SchedulerOutput

from . import prepare_cache
from .device import Placement
from .images import image_digest, open_image
from .layout import ModelLayout
from .loader import ModelPool
from .presets import DEFAULT_NEGATIVE_PROMPT, Settings, resolve
from .profiler import Profiler, profile_path
from .video import write_mp4

log = logging.getLogger("omni")
BRIDGE_FIELDS = ("bridge", "source_node", "source_request_id", "bridge_strategy", "bridge_parse_success",
                 "bridge_fallback", "bridge_fallback_reason", "ar_guidance_prompt")


@attrs.define
class Job:
    item: StageInput
    settings: Settings
    image: Any
    digest: str
    output: Path
    profiler: Profiler
    start: float = attrs.Factory(time.perf_counter)
    phase: str = "prepare"
    model: Any = None
    state: Any = None
    frames: Any = None
    trace: dict = attrs.Factory(dict)


def output_path(item_options, request_id: str) -> Path:
    """The request's `output` option, or ./omni_<request_id>.mp4."""
    return Path(item_options.get("output") or f"omni_{request_id}.mp4").expanduser().absolute()


class DiffusionExecutor:
    def __init__(self, node_id: str, layout: ModelLayout, placement: Placement, default_preset: str,
                 model_label: str, pool: ModelPool, cache: prepare_cache.PrepareCache):
        self.node_id = node_id
        self.layout = layout
        self.placement = placement
        self.default_preset = default_preset
        self.model_label = model_label
        self.pool = pool
        self.cache = cache
        self.jobs: dict[str, Job] = {}

    def add_request(self, item: StageInput) -> None:
        image = open_image(item.image)
        settings = resolve(item.params, self.layout, image.size, self.default_preset)
        if settings.seed is None:
            settings = attrs.evolve(settings, seed=secrets.randbelow(2**31))
        self.jobs[item.request_id] = Job(item, settings, image, image_digest(image),
                                         output_path(item.options, item.request_id), Profiler(sync=self._sync()))

    def execute(self, batch: SchedulerOutput) -> list:
        events: list = []
        for rid in batch.request_ids:
            job = self.jobs[rid]
            events += getattr(self, f"_{job.phase}")(job)
        return events

    def free(self, request_id: str) -> None:
        self.jobs.pop(request_id, None)

    # Phases: each returns the events of one engine step.

    def _prepare(self, job: Job) -> list:
        s, model_key = job.settings, (str(self.layout.path), self.placement)
        loaded = self.pool.acquire(self.layout.path, self.placement)
        if loaded.cold:
            job.profiler.add("load", loaded.load_ms / 1000)
        model = job.model = loaded.model
        guidance = s.guidance_scale > 1
        with job.profiler.span("text_encode"):
            text, text_hit = self.cache.get_or_compute(
                prepare_cache.text_key(model_key, job.item.prompt, s.negative_prompt, guidance),
                lambda: model.encode_text(job.item.prompt, s.negative_prompt, s.guidance_scale))
        with job.profiler.span("image_prepare"):
            condition, image_hit = self.cache.get_or_compute(
                prepare_cache.image_key(model_key, job.digest, s.height, s.width),
                lambda: model.encode_image(job.image, s.height, s.width))
        with job.profiler.span("latents"):
            import torch

            generator = torch.Generator("cpu").manual_seed(s.seed)
            job.state = model.prepare(text, condition, s.height, s.width, s.num_frames, s.steps, s.guidance_scale,
                                      generator)
        job.image = None
        job.trace.update({"diffusion.load_was_cold": loaded.cold, "diffusion.load_ms": round(loaded.load_ms, 3),
                          "diffusion.text_cache": "hit" if text_hit else "miss",
                          "diffusion.image_cache": "hit" if image_hit else "miss",
                          "diffusion.prepare_cache_hit": text_hit and image_hit})
        job.phase = "denoise" if job.state.total else "vae_decode"
        return [StageProgress(job.item.request_id, self.node_id, 0, job.state.total, "denoise")]

    def _denoise(self, job: Job) -> list:
        step = job.state.step
        with job.profiler.span(f"denoise:{step}", timestep=float(job.state.timesteps[step])):
            job.model.denoise_step(job.state)
        if job.state.done:
            job.phase = "vae_decode"
        return [StageProgress(job.item.request_id, self.node_id, job.state.step, job.state.total, "denoise")]

    def _vae_decode(self, job: Job) -> list:
        with job.profiler.span("vae_decode"):
            job.frames = job.model.decode(job.state)
        job.state = None
        job.phase = "export"
        return []

    def _export(self, job: Job) -> list:
        profile = bool(job.item.options.get("profile"))
        with job.profiler.span("export", frames=len(job.frames)):
            write_mp4(job.frames, job.output, fps=self.layout.fps)
        trace = self._trace(job, profile)
        if profile:
            log.info("profile of request %s (%s):\n%s", job.item.request_id, self.node_id, job.profiler.table())
            chrome = job.profiler.write_chrome_trace(profile_path(job.output), job.item.request_id)
            trace["diffusion.profile_trace"] = str(chrome)
        data = {"frames": job.frames} if job.item.options.get("return_frames") else None
        output = StageOutput(job.item.request_id, self.node_id, path=str(job.output), data=data,
                             contract="video/mp4", trace=trace)
        return [StageFinished(job.item.request_id, self.node_id, output)]

    def _trace(self, job: Job, profile: bool) -> dict:
        s = job.settings
        trace = {f"diffusion.{name}": "none" for name in BRIDGE_FIELDS}
        trace.update({"diffusion.model": self.model_label, "diffusion.prompt": job.item.prompt,
                      "diffusion.negative_prompt": "wan default" if s.negative_prompt == DEFAULT_NEGATIVE_PROMPT
                      else s.negative_prompt, "diffusion.seed": s.seed, "diffusion.fps": self.layout.fps,
                      "diffusion.output": str(job.output)})
        trace.update(s.trace())
        trace.update(self.placement.trace())
        trace.update(job.trace)
        trace.update(job.profiler.trace(detailed=profile))
        trace["diffusion.elapsed_ms"] = round((time.perf_counter() - job.start) * 1000, 3)
        return trace

    def _sync(self):
        if self.placement.device != "cuda":
            return None
        import torch

        return torch.cuda.synchronize
