"""The omni-workers plugin: registers the placements `process` and `ray` and their settings (docs/distributed.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from omni_kernel import hookimpl
from omni_kernel.core.planner import NodeBuild

from .process_stage import ProcessStage
from .proxy import WorkerGroup
from .replicas import ReplicaStage
from .settings import WorkersSettings
from .stage_host import WorkerSpec, default_host_factory
from .worker_process import WorkerProcess


@attrs.frozen
class Placement:
    """What the plugin registers per placement (`omni_register_placements`): the GraphBuilder calls `build` with
    the nodes placed here, checked (`NodeBuild`: spec, type, config, policy, share key) and the run's `fail_fast`
    (RunSettings); the placements of one graph share one WorkerGroup (one wait, one close), the handle `build`
    returns.

    `process`: the stages of nodes with equal share keys (the kernel's `share_key`), of this graph or of another
    graph of the same plugin host with the same worker settings, are hosted by one worker, so they share its engine
    there as they would in one process. A node with `replicas` N > 1 gets N proxies, each with a worker (or actor)
    of its own, behind one ReplicaStage (replicas.py)."""

    name: str
    settings: type = WorkersSettings
    streams = True  # its stages take a streaming edge's chunks as they come (Stage.append: messages.Append)
    shared: dict = attrs.field(factory=dict, eq=False, repr=False)  # (share key, settings) -> WorkerProcess

    def check(self, settings: WorkersSettings, plan, placement_of) -> None:
        settings.check(plan, placement_of)

    def build(self, nodes: list[NodeBuild], settings: WorkersSettings, host_factory: Callable[[], Any] | None,
              handle, fail_fast: bool = False):
        group = handle if isinstance(handle, WorkerGroup) else WorkerGroup(fail_fast)
        stages = {}
        try:
            for build in nodes:
                stages[build.node.id] = self._stage(build, settings, host_factory, group)
        except BaseException:
            if group is not handle:
                group.close()
            raise
        return stages, group

    def _stage(self, build: NodeBuild, settings: WorkersSettings, host_factory, group: WorkerGroup):
        spec = WorkerSpec(build.node, build.node_type.kind, build.config, host_factory or default_host_factory(),
                          settings.worker_threads)
        count = settings.replicas_of(build.node)
        if self.name == "ray":
            from .ray_stage import ray_stages

            stages = ray_stages(spec, count, group, settings)
            return ReplicaStage(stages) if count > 1 else stages[0]
        if count > 1:  # each replica in a worker of its own
            return ReplicaStage([ProcessStage(attrs.evolve(spec, replica=i), group, settings.max_restarts)
                                 for i in range(count)])
        return ProcessStage(spec, group, settings.max_restarts, self.worker_for(build, settings, host_factory))

    def worker_for(self, build: NodeBuild, settings: WorkersSettings, host_factory) -> WorkerProcess | None:
        """The running worker of the node's share key, or a new one (kept for the next node of that key)."""
        if self.name != "process":
            return None
        key = (build.key, settings.worker_threads, settings.max_restarts, host_factory)
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
