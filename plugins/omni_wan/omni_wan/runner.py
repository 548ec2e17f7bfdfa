"""WanRunner: per-request Wan2.2 state, advanced one phase per engine step.

The DiffusionScheduler owns each request's phase and step index: prepare -> denoise (one step per engine
step) -> decode -> export. The runner only runs what it is given; a request can be aborted between any two
steps (the engine calls `free`), and nothing is written before export, which writes the MP4 atomically.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import attrs
from omni_kernel.request import StageInput, StageOutput
from omni_kernel.scheduler import DiffusionSchedulerOutput

from . import prepare_cache
from .device import Placement
from .layout import ModelLayout
from .loader import ModelPool
from .presets import DEFAULT_NEGATIVE_PROMPT
from .profiler import Profiler, profile_path
from .stage import Denoised, WanInput
from .video import write_mp4

log = logging.getLogger("omni")


@attrs.define
class Job:
    item: StageInput
    profiler: Profiler
    start: float = attrs.Factory(time.perf_counter)
    model: Any = None
    state: Any = None
    frames: Any = None
    trace: dict = attrs.Factory(dict)

    @property
    def input(self) -> WanInput:
        return self.item.processed


class WanRunner:
    def __init__(self, node_id: str, layout: ModelLayout, placement: Placement, model_label: str, pool: ModelPool,
                 cache: prepare_cache.PrepareCache):
        self.node_id = node_id
        self.layout = layout
        self.placement = placement
        self.model_label = model_label
        self.pool = pool
        self.cache = cache
        self.jobs: dict[str, Job] = {}
        self.phases = {"prepare": self.prepare, "denoise": self.denoise, "decode": self.decode,
                       "export": self.export}

    def add_request(self, item: StageInput) -> None:
        self.jobs[item.request_id] = Job(item, Profiler(sync=self._sync()))

    def run(self, batch: DiffusionSchedulerOutput) -> dict[str, Any]:
        phase = self.phases[batch.phase]
        return {rid: phase(self.jobs[rid]) for rid in batch.request_ids}

    def free(self, request_id: str) -> None:
        self.jobs.pop(request_id, None)

    def prepare(self, job: Job) -> Denoised:
        s, image = job.input.settings, job.input.image
        loaded = self.pool.acquire(self.layout.path, self.placement)
        if loaded.cold:
            job.profiler.add("load", loaded.load_ms / 1000)
        model = job.model = loaded.model
        guidance = s.guidance_scale > 1
        with job.profiler.span("text_encode"):
            text, text_hit = self.cache.get_or_compute(
                prepare_cache.text_key(loaded.key, job.item.prompt, s.negative_prompt, guidance),
                lambda: model.encode_text(job.item.prompt, s.negative_prompt, s.guidance_scale))
        with job.profiler.span("image_prepare"):
            condition, image_hit = self.cache.get_or_compute(
                prepare_cache.image_key(loaded.key, job.input.digest, s.height, s.width),
                lambda: model.encode_image(image, s.height, s.width))
        with job.profiler.span("latents"):
            import torch

            generator = torch.Generator("cpu").manual_seed(s.seed)
            job.state = model.prepare(text, condition, s.height, s.width, s.num_frames, s.steps, s.guidance_scale,
                                      generator)
        if job.state.total != s.steps:  # the scheduler counts s.steps denoise steps; they must be the timesteps
            raise RuntimeError(f"the noise scheduler made {job.state.total} timesteps for {s.steps} steps")
        job.trace.update({"diffusion.load_was_cold": loaded.cold, "diffusion.load_ms": round(loaded.load_ms, 3),
                          "diffusion.text_cache": "hit" if text_hit else "miss",
                          "diffusion.image_cache": "hit" if image_hit else "miss",
                          "diffusion.prepare_cache_hit": text_hit and image_hit})
        return Denoised(0, job.state.total)

    def denoise(self, job: Job) -> Denoised:
        step = job.state.step
        with job.profiler.span(f"denoise:{step}", timestep=float(job.state.timesteps[step])):
            job.model.denoise_step(job.state)
        return Denoised(job.state.step, job.state.total)

    def decode(self, job: Job) -> None:
        with job.profiler.span("vae_decode"):
            job.frames = job.model.decode(job.state)
        job.state = None

    def export(self, job: Job) -> StageOutput:
        params, output = job.item.params, job.input.output
        with job.profiler.span("export", frames=len(job.frames)):
            write_mp4(job.frames, output, fps=self.layout.fps)
        trace = self._trace(job, params.profile)
        if params.profile:
            log.info("profile of request %s (%s):\n%s", job.item.request_id, self.node_id, job.profiler.table())
            chrome = job.profiler.write_chrome_trace(profile_path(output), job.item.request_id)
            trace["diffusion.profile_trace"] = str(chrome)
        data = {"frames": job.frames} if params.return_frames else None
        return StageOutput(job.item.request_id, self.node_id, path=str(output), data=data, contract="video/mp4",
                           trace=trace)

    def _trace(self, job: Job, profile: bool) -> dict:
        s = job.input.settings
        negative = "wan default" if s.negative_prompt == DEFAULT_NEGATIVE_PROMPT else s.negative_prompt
        trace = {"diffusion.model": self.model_label, "diffusion.prompt": job.item.prompt,
                 "diffusion.negative_prompt": negative, "diffusion.seed": s.seed, "diffusion.fps": self.layout.fps,
                 "diffusion.output": str(job.input.output)}
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
