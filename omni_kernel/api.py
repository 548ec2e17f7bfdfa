"""The Python API: one pipeline, many requests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .planner import GraphBuilder, Planner
from .plugins import PluginHost, load_host
from .request import Request, RequestResult
from .stage_scheduler import StageScheduler


class Omni:
    """Build a pipeline's StageGraph once (models stay loaded) and run requests through it.

    `config` holds the model-level settings the pipeline's node types declare (e.g. ar_model, model,
    vae_dtype); request parameters (max_tokens, steps, output, ...) go to `request`/`generate` as keywords.
    Unknown keys are refused with the valid ones listed: `omni run --help` and docs/plugins.md list them.
    """

    def __init__(self, pipeline: str, host: PluginHost | None = None, **config: Any):
        self.host = host or load_host()
        self.plan = Planner(self.host.registry).plan(pipeline)
        self.graph = GraphBuilder(self.host.registry).build(self.plan, config)
        self.scheduler = StageScheduler(self.graph)

    def request(self, prompt: str, image: str | None = None, request_id: str | None = None,
                **params: Any) -> Request:
        extra = {"request_id": request_id} if request_id else {}
        return Request(self.plan.name, prompt, image=image, params=params, **extra)

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
