"""The omni-workers plugin: registers the placements `process` and `ray` (docs/distributed.md)."""

from collections.abc import Callable
from typing import Any

import attrs

from omni_kernel import hookimpl
from omni_kernel.placement import RunSettings

from .stage_host import WorkerSpec, default_host_factory
from .process_stage import ProcessStage
from .proxy import WorkerGroup


@attrs.frozen
class Placement:
    """What the plugin registers per placement (`omni_register_placements`): the GraphBuilder calls `build` with
    the nodes placed here; every placement of one graph shares its WorkerGroup (one wait, one close)."""

    name: str

    def build(self, nodes, settings: RunSettings, host_factory: Callable[[], Any] | None, workers):
        group = workers if isinstance(workers, WorkerGroup) else WorkerGroup()
        stages = {}
        try:
            for node, kind, config in nodes:
                spec = WorkerSpec(node, kind, config, host_factory or default_host_factory(), settings.worker_threads)
                if self.name == "process":
                    stages[node.id] = ProcessStage(spec, group, settings.max_restarts)
                else:
                    from .ray_stage import RayStage

                    stages[node.id] = RayStage(spec, group, settings)
        except BaseException:
            if group is not workers:
                group.close()
            raise
        return stages, group



class WorkersPlugin:
    @hookimpl
    def omni_register_placements(self, register):
        register(Placement("process"))
        register(Placement("ray"))
