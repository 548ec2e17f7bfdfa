"""A test plugin whose scheduler raises or stalls: pipeline `fault` echoes the prompt, except that a prompt containing
"explode" makes the scheduler raise on its second step (the stage's engine is then dead), and one containing
"stall" gets one step and then no more (the stage schedules nothing) until it is aborted."""

import attrs

from omni_kernel import NodeSpec, NodeType, PipelinePlan, hookimpl
from omni_kernel.builtin.echo import EchoInputs, EchoOutputs, IdentityRunner
from omni_kernel.core.engine import Engine
from omni_kernel.core.params import ARParams
from omni_kernel.core.scheduler import SchedulerOutput, StepScheduler
from omni_kernel.core.stage import Stage


class ExplodingScheduler(StepScheduler):
    def schedule(self):
        if any("explode" in job.item.prompt and job.step >= 1 for job in self.queue):
            raise RuntimeError("injected scheduler fault")
        if any("stall" in job.item.prompt and job.step >= 1 for job in self.queue):
            return SchedulerOutput(())
        return super().schedule()


@attrs.frozen
class FaultEngineSettings:
    max_batch: int = 4


def engine_settings(node, config, policy) -> FaultEngineSettings:
    return FaultEngineSettings()


def build_engine(settings: FaultEngineSettings) -> Engine:
    scheduler = ExplodingScheduler(max_batch=settings.max_batch, num_steps=lambda i: i.processed.num_steps)
    return Engine(scheduler, IdentityRunner())


def build_stage(node, config, policy, settings, engine: Engine) -> Stage:
    return Stage(node, "ar", EchoInputs(), engine, EchoOutputs(node.id))


class FaultPlugin:
    @hookimpl
    def omni_register_node_types(self, register):
        register(NodeType("fault.echo", "ar", engine_settings=engine_settings, engine=build_engine, stage=build_stage,
                          params=ARParams, description="echo with an injected fault"))

    @hookimpl
    def omni_register_pipelines(self, register):
        register(PipelinePlan("fault", [NodeSpec("f", "fault.echo", final=True)]))
