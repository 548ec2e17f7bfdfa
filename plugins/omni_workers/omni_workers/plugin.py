"""The omni-workers plugin: registers the placements `process` and `ray` (docs/distributed.md)."""

from collections.abc import Callable
from typing import Any

import attrs

from omni_kernel import hookimpl
from omni_kernel.placement import RunSettings

from .stage_host import WorkerSpec, default_host_factory
from .process_stage import ProcessStage
from .proxy import WorkerGroup
from .worker_process import WorkerProcess


@attrs.frozen
class Placement:
    """What the plugin registers per placement (`omni_register_placements`): the GraphBuilder calls `build` with
    the nodes placed here; every placement of one graph shares its WorkerGroup (one wait, one close).

    `process`: the stages of nodes whose type gives equal share keys (`NodeType.share_key`), of this graph or of
    another graph of the same plugin host with the same worker settings, are hosted by one worker (`shared`), so
    they share its engine there as they would in one process."""

    name: str
    shared: dict = attrs.field(factory=dict, eq=False, repr=False)  # (share key, settings) -> WorkerProcess

    def build(self, nodes, settings: RunSettings, host_factory: Callable[[], Any] | None, workers):
        group = workers if isinstance(workers, WorkerGroup) else WorkerGroup()
        stages = {}
        try:
            for node, node_type, config in nodes:
                spec = WorkerSpec(node, node_type.kind, config, host_factory or default_host_factory(),
                                  settings.worker_threads)
                if self.name == "process":
                    worker = self.worker_for(node_type, node, config, settings, host_factory)
                    stages[node.id] = ProcessStage(spec, group, settings.max_restarts, worker)
                else:
                    from .ray_stage import RayStage

                    stages[node.id] = RayStage(spec, group, settings)
        except BaseException:
            if group is not workers:
                group.close()
            raise
        return stages, group

    def worker_for(self, node_type, node, config, settings: RunSettings, host_factory) -> WorkerProcess:
        """The running worker of the node's share key, or a new one (kept for the next node of that key)."""
        if node_type.share_key is None:
            return WorkerProcess(settings.worker_threads)
        key = (node_type.share_key(node, config), settings.worker_threads, settings.max_restarts, host_factory)
        worker = self.shared.get(key)
        if worker is None or worker.stopped:
            worker = self.shared[key] = WorkerProcess(settings.worker_threads,
                                                      on_stop=lambda w: self._forget(key, w))
        return worker

    def _forget(self, key, worker: WorkerProcess) -> None:
        if self.shared.get(key) is worker:
            del self.shared[key]


class WorkersPlugin:
    @hookimpl
    def omni_register_placements(self, register):
        register(Placement("process"))
        register(Placement("ray"))
