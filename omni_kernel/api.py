"""The Python API: one pipeline, many requests."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from .params import ARParams, DiffusionParams
from .planner import PipelineRegistry, Planner
from .plugins import PluginHost, load_host
from .request import Request, RequestResult
from .stage_scheduler import StageScheduler


class Omni:
    """Build a pipeline's StageGraph once (models stay loaded) and run requests through it.

    `config` holds model-level settings such as ar_model, model, vae_dtype, disable_cpu_offload.
    """

    def __init__(self, pipeline: str, host: PluginHost | None = None, **config: Any):
        self.host = host or load_host()
        self.plan = Planner(self.host.registry).plan(pipeline)
        self.graph = PipelineRegistry(self.host.registry).build(self.plan, config)
        self.scheduler = StageScheduler(self.graph)

    def request(self, prompt: str, image: str | None = None, ar: ARParams | None = None,
                diffusion: DiffusionParams | None = None, request_id: str | None = None,
                **options: Any) -> Request:
        params: Mapping[str, Any] = {k: v for k, v in (("ar", ar), ("diffusion", diffusion)) if v is not None}
        extra = {"request_id": request_id} if request_id else {}
        return Request(self.plan.name, prompt, image=image, params=params, options=options, **extra)

    def generate(self, prompt: str, **kwargs: Any) -> RequestResult:
        return self.scheduler.generate(self.request(prompt, **kwargs))

    def generate_stream(self, prompt: str, **kwargs: Any) -> Iterator:
        return self.scheduler.generate_stream(self.request(prompt, **kwargs))

    def submit(self, request: Request) -> str:
        return self.scheduler.submit(request)

    def step(self) -> list:
        return self.scheduler.step()

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()
