"""NodeType.choices: the values a request option takes in a built model (e.g. a voice model's voices), computed from
the build's engine settings and kept on the built graph, for what lists them (omni serve's /v1/audio/voices)."""

from __future__ import annotations

import attrs

from omni_kernel import hookimpl
from omni_kernel.api import Omni
from omni_kernel.builtin.echo import ECHO_NODE, ECHO_PIPELINE, KernelPlugin
from omni_kernel.core.graph import NodeSpec, PipelinePlan
from omni_kernel.plugins import PluginHost


def voices(node, config, policy, settings) -> dict[str, tuple[str, ...]]:
    return {"voice": (f"{node.id}-first", f"batch-{settings.max_batch}")}


class ChoicesPlugin:
    @hookimpl
    def omni_register_node_types(self, register):
        register(attrs.evolve(ECHO_NODE, name="choices.echo", choices=voices))

    @hookimpl
    def omni_register_pipelines(self, register):
        register(PipelinePlan("chosen", [NodeSpec("speak", "choices.echo", final=True)]))


def test_a_built_graph_keeps_each_nodes_choices():
    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel")
    host.register(ChoicesPlugin(), "choices")
    assert Omni("chosen", host=host).graph.choices == {"speak": {"voice": ("speak-first", "batch-16")}}
    assert ECHO_NODE.choices is None and Omni(ECHO_PIPELINE.name, host=host).graph.choices == {}
