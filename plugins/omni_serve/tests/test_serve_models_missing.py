"""`omni serve` with no --pipeline serves every registered pipeline whose models are there: one whose default model
was never fetched (a speech pipeline before `omni models fetch`) is left out with a log line, not the whole server
stopped; named with --pipeline, the same pipeline is refused in one line."""

from __future__ import annotations

import attrs
import pytest

from omni_kernel import NodeSpec, PipelinePlan, hookimpl
from omni_kernel.builtin.echo import ECHO_NODE, KernelPlugin
from omni_kernel.core.errors import ModelError
from omni_kernel.plugins import PluginHost
from omni_serve.async_omni import check_before_building
from omni_serve.command import plan_pipelines, with_models


def never_fetched(node, config, policy):
    raise ModelError("the default voice-x is not in omni's cache: `omni models fetch voice-x` fetches it")


class MissingPlugin:
    @hookimpl
    def omni_register_node_types(self, register):
        register(attrs.evolve(ECHO_NODE, name="missing.echo", engine_settings=never_fetched))

    @hookimpl
    def omni_register_pipelines(self, register):
        register(PipelinePlan("unfetched", [NodeSpec("speak", "missing.echo", final=True)]))


def test_a_pipeline_whose_model_is_missing_is_left_out_of_every_pipeline(caplog):
    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel")
    host.register(MissingPlugin(), "missing")
    plan = plan_pipelines(host, (), {}, ())
    assert set(plan) == {"echo", "unfetched"}
    with caplog.at_level("INFO", logger="omni"):
        assert set(with_models(host, plan)) == {"echo"}
    assert "not serving unfetched: the default voice-x is not in omni's cache" in caplog.text
    with pytest.raises(ModelError, match="voice-x"):
        check_before_building(host, "unfetched", plan_pipelines(host, ("unfetched",), {}, ())["unfetched"][1])
