"""A test plugin for a worker restart under `omni serve`: pipeline `steady` echoes its prompt one word per 20 ms
step (a long stream); pipeline `flaky` echoes at once, and its factory waits while the file named by the config
`flaky_gate` exists, so a restarted worker's model load lasts as long as the test wants. Each factory logs its
pid, so the test knows which worker to kill."""

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
    flaky_gate: str = option("", help="while this file exists, the flaky stage's factory waits (a model load)")


class SlowRunner(IdentityRunner):
    def run(self, batch):
        time.sleep(0.02)  # the slow model: 20 ms a word, on purpose
        return super().run(batch)


def _echo(node: NodeSpec, runner) -> Stage:
    log.info("loading %s (pid %d)", node.id, os.getpid())
    scheduler = StepScheduler(max_batch=4, num_steps=lambda i: i.processed.num_steps)
    return Stage(node, "ar", EchoInputs(), Engine(scheduler, runner), EchoOutputs(node.id))


def build_steady(node, config):
    return _echo(node, SlowRunner())


def build_flaky(node, config: FlakyConfig):
    if config.flaky_gate:
        wait_until(lambda: not os.path.exists(config.flaky_gate), 60,
                   f"the test to remove the build gate {config.flaky_gate}", interval=0.02)
    return _echo(node, IdentityRunner())


class RestartPlugin:
    @hookimpl
    def omni_register_node_types(self, register):
        register(NodeType("restart.steady", "ar", build_steady, params=ARParams, description="a slow echo"))
        register(NodeType("restart.flaky", "ar", build_flaky, config=FlakyConfig, params=ARParams,
                          description="an echo whose build waits on a file"))

    @hookimpl
    def omni_register_pipelines(self, register):
        register(PipelinePlan("steady", [NodeSpec("steady", "restart.steady", final=True)]))
        register(PipelinePlan("flaky", [NodeSpec("flaky", "restart.flaky", final=True)]))
