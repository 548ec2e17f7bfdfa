"""WanOutputProcessor: a Wan engine's outputs -> events: progress after prepare and each denoise step, and the
StageOutput with its diffusion.* trace once the scheduler finishes a request (its MP4 written)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import attrs

from omni_kernel.core.request import StageOutput
from omni_kernel.core.scheduler import RequestOutput, StepJob
from omni_kernel.events import StageFailed, StageFinished, StageProgress

from .presets import DEFAULT_NEGATIVE_PROMPT


@attrs.frozen
class Progress:
    """A prepare or denoise step's result: `step` of `total` denoise steps are done."""

    step: int
    total: int


class WanOutputProcessor:
    def __init__(self, node_id: str, model_trace: Mapping[str, Any]):
        self.node_id = node_id
        self.model_trace = dict(model_trace)  # diffusion.* fields of the model and its placement

    def add(self, job: StepJob) -> None:
        pass

    def process(self, outputs: list[RequestOutput]) -> tuple[list, list[str]]:
        events: list = []
        for out in outputs:
            if out.error is not None:
                events.append(StageFailed.of(out.request_id, self.node_id, out.error))
            elif isinstance(out.result, Progress):
                events.append(StageProgress(out.request_id, self.node_id, out.result.step, out.result.total,
                                            "denoise"))
            elif out.finished is not None:
                events.append(StageFinished(out.request_id, self.node_id, self.finish(out.record)))
        return events, []

    def finish(self, job: StepJob) -> StageOutput:
        wan, params = job.state, job.item.params
        data = {"frames": wan.frames} if params.return_frames else None
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
        trace.update(wan.trace)
        sizes = wan.batch_sizes or [0]
        trace.update({"diffusion.batch_size_mean": round(sum(sizes) / len(sizes), 3),
                      "diffusion.batch_size_max": max(sizes)})
        trace.update(wan.profiler.trace(detailed=job.item.params.profile))
        trace["diffusion.elapsed_ms"] = round((time.perf_counter() - wan.start) * 1000, 3)
        return trace
