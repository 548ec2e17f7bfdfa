"""`Served`: what every route reads, built once per app and kept on `app.state.served` (routes take it as the
`ServedDep` dependency). It knows which pipeline each served model name means, what kind each pipeline is, and the
request options its node types declare; nothing here reaches into a stage."""

from __future__ import annotations

import time
from typing import Annotated

import attrs
from fastapi import Depends, Request

from omni_kernel.core.params import OptionInfo, options_of

from .async_omni import AsyncOmni
from .metrics import Metrics
from .protocol import APIError
from .settings import ServeSettings
from .store import JobStore
from .videos import VideoJobs

ROUTES = {"text": "/v1/chat/completions or /v1/completions", "video": "/v1/videos", "speech": "/v1/audio/speech",
          "transcription": "/v1/audio/transcriptions"}


@attrs.define
class Served:
    async_omni: AsyncOmni
    settings: ServeSettings
    jobs: VideoJobs
    metrics: Metrics
    names: dict[str, str]  # served model name (a pipeline key or an alias) -> pipeline key
    kinds: dict[str, str]  # pipeline key -> "text", "video", "speech" or "transcription"
    created: int = attrs.Factory(lambda: int(time.time()))

    @classmethod
    def build(cls, async_omni: AsyncOmni, settings: ServeSettings, store: JobStore | None = None) -> Served:
        jobs = VideoJobs(async_omni, settings.output_dir, settings.video_ttl, store=store,
                         on_restart=settings.on_restart)
        jobs.metrics = Metrics(lambda: async_omni.snapshot, jobs.counts)
        names = {**{n: n for n in async_omni.omnis}, **dict(settings.aliases)}
        return cls(async_omni, settings, jobs, jobs.metrics, names, {n: _kind(async_omni, n) for n in async_omni.omnis})

    def resolve(self, model: str, kind: str) -> str:
        """The pipeline a request's `model` names, refused (404 / 400) unless it is served and of `kind`."""
        name = self.names.get(model)
        if name is None:
            raise APIError(404, f"the model {model!r} does not exist; served models: {', '.join(sorted(self.names))}",
                           "model", "model_not_found")
        if self.kinds[name] != kind:
            raise APIError(400, f"invalid model: {model!r} is a {self.kinds[name]} pipeline; use "
                                f"{ROUTES[self.kinds[name]]}", "model")
        return name

    def final(self, name: str) -> str:
        return self.async_omni.omnis[name].graph.final

    def options(self, name: str) -> dict[str, OptionInfo]:
        """The request options the pipeline's node types declare, by name."""
        graph = self.async_omni.omnis[name].graph
        return {k: info for t in graph.node_types.values() for k, info in options_of(t.params).items()}


VIDEO_KINDS = ("diffusion", "mux")  # the node kinds whose file is a video


def _kind(async_omni: AsyncOmni, name: str) -> str:
    """"video" when the final node is a diffusion node, or a mux (omni_bridge's narrated pipelines), told the path
    of the file it writes (`output`); "speech"
    when the final node speaks (kind "tts"); "transcription" when the entry node listens (kind "asr") and the final
    node is no AR stage (`voice_chat` hears, and answers as a chat: "text")."""
    graph = async_omni.omnis[name].graph
    node_type = graph.node_types.get(graph.final)
    if getattr(node_type, "kind", None) == "tts":
        return "speech"
    listens = any(getattr(graph.node_types.get(n), "kind", None) == "asr" for n in graph.entries())
    if listens and getattr(node_type, "kind", None) != "ar":
        return "transcription"
    writes = "output" in options_of(getattr(node_type, "params", None))
    return "video" if writes and getattr(node_type, "kind", None) in VIDEO_KINDS else "text"


def served(request: Request) -> Served:
    return request.app.state.served


ServedDep = Annotated[Served, Depends(served)]
