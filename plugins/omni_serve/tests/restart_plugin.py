"""A test plugin for a worker restart under `omni serve`: pipeline `steady` echoes its prompt one word per 20 ms
step (a long stream); pipeline `flaky` echoes at once, and its engine factory waits while the file named by the
config `flaky_gate` exists, so a restarted worker's model load lasts as long as the test wants. Each engine factory
logs its pid, so the test knows which worker to kill."""

import logging
import os
import time

import attrs

from omni_kernel import NodeSpec, NodeType, PipelinePlan, hookimpl
from omni_kernel.builtin.echo import EchoInputs, EchoOutputs, IdentityRunner
from omni_kernel.core.engine import Engine
from omni_kernel.core.params import ARParams, option
from omni_kernel.core.scheduler import StepScheduler
from omni_kernel.core.stage import Stage
from omni_kernel.testing import wait_until

log = logging.getLogger("omni")


@attrs.frozen
class FlakyConfig:
    flaky_gate: str = option("", help="while this file exists, the flaky stage's engine factory waits (a model load)")


@attrs.frozen
class EchoEngineSettings:
    """What an echo engine here is built from: the node it is named after, and the flaky one's gate file."""

    node_id: str
    gate: str = ""


class SlowRunner(IdentityRunner):
    def run(self, batch):
        time.sleep(0.02)  # the slow model: 20 ms a word, on purpose
        return super().run(batch)


def _engine(settings: EchoEngineSettings, runner) -> Engine:
    log.info("loading %s (pid %d)", settings.node_id, os.getpid())
    scheduler = StepScheduler(max_batch=4, num_steps=lambda i: i.processed.num_steps)
    return Engine(scheduler, runner)


def steady_settings(node: NodeSpec, config, policy) -> EchoEngineSettings:
    return EchoEngineSettings(node.id)


def flaky_settings(node: NodeSpec, config: FlakyConfig, policy) -> EchoEngineSettings:
    return EchoEngineSettings(node.id, config.flaky_gate)


def build_steady(settings: EchoEngineSettings) -> Engine:
    return _engine(settings, SlowRunner())


def build_flaky(settings: EchoEngineSettings) -> Engine:
    if settings.gate:
        wait_until(lambda: not os.path.exists(settings.gate), 60,
                   f"the test to remove the build gate {settings.gate}", interval=0.02)
    return _engine(settings, IdentityRunner())


def echo_stage(node: NodeSpec, config, policy, settings, engine: Engine) -> Stage:
    return Stage(node, "ar", EchoInputs(), engine, EchoOutputs(node.id))


class RestartPlugin:
    @hookimpl
    def omni_register_node_types(self, register):
        register(NodeType("restart.steady", "ar", engine_settings=steady_settings, engine=build_steady,
                          stage=echo_stage, params=ARParams, description="a slow echo"))
        register(NodeType("restart.flaky", "ar", engine_settings=flaky_settings, engine=build_flaky,
                          stage=echo_stage, config=FlakyConfig, params=ARParams,
                          description="an echo whose engine build waits on a file"))

    @hookimpl
    def omni_register_pipelines(self, register):
        register(PipelinePlan("steady", [NodeSpec("steady", "restart.steady", final=True)]))
        register(PipelinePlan("flaky", [NodeSpec("flaky", "restart.flaky", final=True)]))
