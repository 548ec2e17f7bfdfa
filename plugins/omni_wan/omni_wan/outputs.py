"""WanOutputProcessor: a Wan engine's outputs -> events: progress after prepare and each denoise step, and the
StageOutput with its diffusion.* trace once the scheduler finishes a request (its MP4 written). The trace is
built here only: from the request's settings, the model's fields, and what the runner measured (its WanJob)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from omni_kernel.core.request import VIDEO, StageOutput, VideoInfo
from omni_kernel.core.scheduler import RequestOutput, StepJob
from omni_kernel.events import StageFailed, StageFinished, StageProgress

from .job import Progress, WanJob
from .presets import DEFAULT_NEGATIVE_PROMPT


class WanOutputProcessor:
    def __init__(self, node_id: str, model_trace: Mapping[str, Any]):
        self.node_id = node_id
        self.model_trace = dict(model_trace)  # diffusion.* fields of the model and its device

    def add(self, job: StepJob) -> None:
        pass

    def process(self, outputs: list[RequestOutput]) -> tuple[list, list[str]]:
        events: list = []
        for out in outputs:
            if out.error is not None:
                events.append(StageFailed.of(out.request_id, self.node_id, out.error))
            elif isinstance(out.result, Progress):
                events.append(StageProgress(out.request_id, self.node_id, out.result.step, out.result.total,
                                            "denoise", out.result.from_cache))
            elif out.finished is not None:
                events.append(StageFinished(out.request_id, self.node_id, self.finish(out.record)))
        return events, []

    def finish(self, job: StepJob) -> StageOutput:
        """The request's StageOutput: its MP4's path, the video as written (a VideoInfo under VIDEO in its data),
        its frames where the request asked, and its diffusion.* trace."""
        wan, params, s = job.state, job.item.params, job.item.processed.settings
        data: dict[str, Any] = {VIDEO: VideoInfo(s.width, s.height, s.num_frames, self.model_trace["diffusion.fps"])}
        if params.return_frames:
            data["frames"] = wan.frames
        return StageOutput(job.request_id, self.node_id, path=str(job.item.processed.output), data=data,
                           contract="video/mp4", trace=self._trace(job))

    def _trace(self, job: StepJob) -> dict:
        wan, s, processed = job.state, job.item.processed.settings, job.item.processed
        negative = "wan default" if s.negative_prompt == DEFAULT_NEGATIVE_PROMPT else s.negative_prompt
        trace = {"diffusion.model": self.model_trace["diffusion.model"], "diffusion.prompt": job.item.prompt,
                 "diffusion.negative_prompt": negative, "diffusion.seed": s.seed,
                 "diffusion.fps": self.model_trace["diffusion.fps"], "diffusion.output": str(processed.output)}
        trace.update(s.trace())
        trace.update({k: v for k, v in self.model_trace.items() if k not in trace})
        trace.update(measured_trace(wan))
        trace.update(wan.profiler.trace(detailed=job.item.params.profile))
        trace["diffusion.elapsed_ms"] = round((time.perf_counter() - wan.start) * 1000, 3)
        return trace


def measured_trace(wan: WanJob) -> dict:
    """The trace fields of what the runner measured of one request (its WanJob): the load, the prepare cache,
    batching, and the profile trace's path."""
    image = wan.input.image is not None
    image_hit = True if wan.image_hit is None else wan.image_hit
    trace = {"diffusion.load_was_cold": wan.load_ms is not None,
             "diffusion.load_ms": round(wan.load_ms or 0.0, 3),
             "diffusion.text_cache": "hit" if wan.text_hit else "miss",
             "diffusion.task": "image_to_video" if image else "text_to_video",
             "diffusion.image_cache": ("hit" if image_hit else "miss") if image else "none",
             "diffusion.prepare_cache_hit": wan.text_hit and image_hit,
             "diffusion.cfg_batched": wan.cfg_batched}
    if wan.profile_trace is not None:
        trace["diffusion.profile_trace"] = str(wan.profile_trace)
    trace.update(step_cache_trace(wan))
    sizes = wan.batch_sizes or [0]
    trace["diffusion.batch_size_mean"] = round(sum(sizes) / len(sizes), 3)
    trace["diffusion.batch_size_max"] = max(sizes)
    return trace


def step_cache_trace(wan: WanJob) -> dict:
    """What the request's step cache did: the transformer forwards whose blocks (after the first, first_block;
    all, mag) it skipped, cond and uncond counted apart, their share of its block computations, and how close
    its closest decision came to the threshold."""
    cache = wan.step_cache
    if cache is None:
        return {"diffusion.step_cache_skipped_forwards": 0, "diffusion.step_cache_skipped_share": 0.0}
    num_blocks, skipped_blocks = wan.num_blocks, wan.num_blocks - (1 if cache.policy.method == "first_block" else 0)
    share = cache.num_skipped * skipped_blocks / max(1, cache.num_forwards * num_blocks)
    margin = cache.margin
    return {"diffusion.step_cache_skipped_forwards": cache.num_skipped,
            "diffusion.step_cache_forwards": cache.num_forwards,
            "diffusion.step_cache_skipped_share": round(share, 4),
            "diffusion.step_cache_margin": None if margin == float("inf") else round(margin, 6)}
