"""The omni-workers plugin: registers the placements `process` and `ray` (docs/distributed.md)."""

from collections.abc import Callable
from typing import Any

import attrs

from omni_kernel import hookimpl
from omni_kernel.core.placement import RunSettings

from .process_stage import ProcessStage
from .proxy import WorkerGroup
from .replicas import ReplicaStage
from .stage_host import WorkerSpec, default_host_factory
from .worker_process import WorkerProcess


@attrs.frozen
class Placement:
    """What the plugin registers per placement (`omni_register_placements`): the GraphBuilder calls `build` with
    the nodes placed here; every placement of one graph shares its WorkerGroup (one wait, one close).

    `process`: the stages of nodes whose type gives equal share keys (`NodeType.share_key`), of this graph or of
    another graph of the same plugin host with the same worker settings, are hosted by one worker (`shared`), so
    they share its engine there as they would in one process. A node with `replicas` N > 1 gets N proxies, each
    with a worker (or actor) of its own, behind one ReplicaStage (replicas.py)."""

    name: str
    shared: dict = attrs.field(factory=dict, eq=False, repr=False)  # (share key, settings) -> WorkerProcess

    def build(self, nodes, settings: RunSettings, host_factory: Callable[[], Any] | None, workers):
        group = workers if isinstance(workers, WorkerGroup) else WorkerGroup()
        stages = {}
        try:
            for node, node_type, config in nodes:
                spec = WorkerSpec(node, node_type.kind, config, host_factory or default_host_factory(),
                                  settings.worker_threads)
                count = settings.replicas_of(node)
                if count == 1:
                    stages[node.id] = self.proxy(spec, group, settings, self.worker_for(node_type, node, config,
                                                                                        settings, host_factory))
                else:  # each replica in a worker of its own
                    stages[node.id] = ReplicaStage([self.proxy(attrs.evolve(spec, replica=i), group, settings)
                                                    for i in range(count)])
        except BaseException:
            if group is not workers:
                group.close()
            raise
        return stages, group

    def proxy(self, spec: WorkerSpec, group: WorkerGroup, settings: RunSettings, worker=None):
        if self.name == "process":
            return ProcessStage(spec, group, settings.max_restarts, worker)
        from .ray_stage import RayStage

        return RayStage(spec, group, settings)

    def worker_for(self, node_type, node, config, settings: RunSettings, host_factory) -> WorkerProcess | None:
        """The running worker of the node's share key, or a new one (kept for the next node of that key)."""
        if self.name != "process" or node_type.share_key is None:
            return None
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
