"""The Python API: one pipeline, many requests, on its plugin host's one scheduler."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from omni_kernel.core.events import RequestFailed, RequestFinished
from omni_kernel.core.graph import PipelinePlan
from omni_kernel.core.placement import RunSettings
from omni_kernel.core.planner import Planner
from omni_kernel.core.request import Request, RequestResult
from omni_kernel.core.stage_scheduler import StageScheduler
from omni_kernel.plugins import PluginHost, load_host


class Omni:
    """Build a pipeline's StageGraph once (models stay loaded) and run requests through it.

    `config` holds the model-level settings the pipeline's node types declare (e.g. ar_model, model, vae_dtype)
    and the run settings: `placement` ("inproc", or a placement a plugin registers, run-wide or per node as
    "video=process,bridge=inproc"), `fail_fast` (a call to a placed stage whose worker restarts raises
    StageUnavailable at once instead of waiting) and the settings that placement declares (omni-workers: replicas,
    max_restarts, worker_threads, ray_address; docs/distributed.md). Request parameters (max_tokens, steps,
    output, ...) go to `request`/`generate` as keywords. Unknown keys are refused with the valid ones listed.

    Every Omni of one plugin host runs on the host's one StageScheduler, so pipelines that share an engine share
    its batches; `step()` returns this Omni's events and leaves the others' for their own Omni. With placed stages,
    call `close()` (or use `with Omni(...) as omni:`) to stop them; they also stop when this process exits.
    """

    def __init__(self, pipeline: str | PipelinePlan, host: PluginHost | None = None, **config: Any):
        self.host = host or load_host()
        self.settings = RunSettings.pop(config, self.host.builder.placements())
        if isinstance(pipeline, PipelinePlan):
            self.plan = pipeline
        else:
            self.plan = Planner(self.host.registry).plan(pipeline)
        self.graph = self.host.builder.build(self.plan, config, self.settings, self.host.rebuild)
        self.scheduler: StageScheduler = self.host.scheduler

    # Requests.

    def request(self, prompt: str = "", image: str | None = None, request_id: str | None = None,
                audio: str | bytes | None = None, **params: Any) -> Request:
        """A request of this pipeline. `audio` is an audio input's path or its file's bytes; the prompt may be ""
        where the pipeline reads another input (speech to text: `request(audio="a.wav")`)."""
        extra = {"request_id": request_id} if request_id else {}
        return Request(self.graph.name, prompt, image=image, audio=audio, params=params, **extra)

    def submit(self, request: Request) -> str:
        """Process the request's inputs now (a user mistake raises here), then queue it."""
        return self.scheduler.submit(request, self.graph)

    def step(self) -> list:
        """One round of the host's scheduler; this Omni's events."""
        return self.scheduler.step(self.graph)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished(self.graph)

    # Thin helpers over submit + step.

    def run(self, requests: Iterable[Request]) -> Iterator:
        """Submit every request, then yield all their events until nothing of this Omni is in flight."""
        for request in requests:
            self.submit(request)
        while self.has_unfinished():
            yield from self.step()

    def generate_stream(self, prompt: str | Request = "", **kwargs: Any) -> Iterator:
        """Yield the events of one request (a Request, or a prompt and `request`'s keywords); closing the iterator
        early aborts the request."""
        request = prompt if isinstance(prompt, Request) else self.request(prompt, **kwargs)
        rid = self.submit(request)
        done = False
        try:
            while not done:
                for event in self.step():
                    if event.request_id != rid:
                        self.scheduler.hold(self.graph, event)  # another request of this Omni: its next step
                        continue
                    done = done or isinstance(event, (RequestFinished, RequestFailed))
                    yield event
        finally:
            if not done:
                self.scheduler.forget(self.graph, rid)

    def generate(self, prompt: str | Request = "", **kwargs: Any) -> RequestResult:
        """Run one request to the end (a Request, or a prompt and `request`'s keywords); raise its error (typed,
        as the stage raised it) if it fails."""
        with contextlib.closing(self.generate_stream(prompt, **kwargs)) as events:
            for event in events:
                if isinstance(event, RequestFinished):
                    return event.result
                if isinstance(event, RequestFailed):
                    raise event.exception()
        raise AssertionError("a request's events ended without its RequestFinished or RequestFailed")

    # Lifecycle.

    def close(self) -> None:
        """Stop its placed stages (nothing to stop for in-process ones): the requests they held fail, naming the
        stage, at the next step."""
        self.graph.close()

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
