"""The plugin's entry point: hooks that register its node type, connector and pipeline.

Import nothing heavy here: `omni --help` imports every installed plugin.
"""

from __future__ import annotations

import attrs

from omni_kernel import EdgeSpec, InputError, NodeSpec, NodeType, PipelinePlan, StageInput, hookimpl

from .upper import UpperConfig, UpperParams, UpperPolicy, build_upper_engine, build_upper_stage, upper_engine_settings

UPPER_NODE = NodeType("text.upper", "text", engine_settings=upper_engine_settings, engine=build_upper_engine,
                      stage=build_upper_stage, config=UpperConfig, params=UpperParams, policy=UpperPolicy,
                      description="upper-cases text a few characters per step (no model)")


@attrs.frozen
class ARToTextConnector:
    """Hands an AR stage's finished text to a text stage."""

    name: str = "ar_to_text"
    source_kind: str = "ar"
    target_kind: str = "text"

    def convert(self, output, request) -> StageInput:
        if output.text is None:
            raise InputError(f"{self.name}: node {output.node_id} produced no text")
        return StageInput(request.request_id, output.text, trace={"ar_to_text.chars": len(output.text)})


ECHO_UPPER = PipelinePlan(
    "echo_upper",
    [NodeSpec("echo", "kernel.echo"), NodeSpec("upper", "text.upper", policy={"chunk": 4}, final=True,
                                                 plugin_hint="omni-plugin-example")],
    [EdgeSpec("echo", "upper", "ar_to_text")],
    description="the kernel's echo, then upper-cased by the example plugin")


class ExamplePlugin:
    @hookimpl
    def omni_register_node_types(self, register):
        register(UPPER_NODE)

    @hookimpl
    def omni_register_connectors(self, register):
        register(ARToTextConnector())

    @hookimpl
    def omni_register_pipelines(self, register):
        register(ECHO_UPPER)
