"""The Python API: one pipeline, many requests."""

from __future__ import annotations

from typing import Any

from omni_kernel.core.graph import PipelinePlan
from omni_kernel.core.placement import RunSettings
from omni_kernel.core.planner import GraphBuilder, Planner
from omni_kernel.core.stage_scheduler import StageScheduler
from omni_kernel.plugins import PluginHost, load_host


class Omni(StageScheduler):
    """Build a pipeline's StageGraph once (models stay loaded) and run requests through it: the StageScheduler of
    that graph.

    `config` holds the model-level settings the pipeline's node types declare (e.g. ar_model, model,
    vae_dtype); request parameters (max_tokens, steps, output, ...) go to `request`/`generate` as keywords.
    Unknown keys are refused with the valid ones listed: `omni run --help` and docs/plugins.md list them.

    Run settings (the kernel's, not a node type's; docs/distributed.md): `placement` ("inproc", "process",
    "ray", or per node "video=process,bridge=inproc"), `max_restarts` (of a stage worker that died, default 1),
    `worker_threads` (torch threads per worker, or "shared": the workers lend each other their cores),
    `ray_address`. With stage workers, call `close()` (or use `with Omni(...) as omni:`) to stop them; they also
    stop when this process exits or dies. A worker rebuilds the plugin host with `host.rebuild()` when the host
    has one, else with `load_host()`.
    """

    def __init__(self, pipeline: str | PipelinePlan, host: PluginHost | None = None, **config: Any):
        self.host = host or load_host()
        self.settings = RunSettings.pop(config)
        self.plan = pipeline if isinstance(pipeline, PipelinePlan) else Planner(self.host.registry).plan(pipeline)
        super().__init__(GraphBuilder(self.host.registry).build(self.plan, config, self.settings,
                                                                getattr(self.host, "rebuild", None)))

    @property
    def scheduler(self) -> StageScheduler:
        """The same object (an Omni is its graph's StageScheduler); kept for callers written before."""
        return self

    def close(self) -> None:
        """Stop the stage workers (nothing to do for in-process stages)."""
        self.graph.close()

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
