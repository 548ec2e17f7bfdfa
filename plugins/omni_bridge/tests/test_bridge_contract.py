"""The guidance contract has one owner, omni_bridge: its name, field, schema and answer prefix are spelled in
guidance.py only, and reach omni_qwen's bridge node through the node policy (pipeline.BRIDGE_POLICY). The plan's
contract check reads the policy's output contract. Model-free."""

from __future__ import annotations

import json

import pytest

from omni_bridge.guidance import ANSWER_PREFIX, CONTRACT, GUIDANCE_FIELD, GUIDANCE_SCHEMA, parse_guidance
from omni_bridge.pipeline import BRIDGE_POLICY, QWEN_TO_WAN_I2V, QWEN_TO_WAN_T2V
from omni_kernel import EdgeSpec, GraphError, NodeSpec, PipelinePlan
from omni_kernel.core.planner import GraphBuilder
from omni_kernel.plugins import load_host


@pytest.fixture(scope="module")
def builder():
    return GraphBuilder(load_host().registry)


def test_the_answer_prefix_opens_the_schemas_field():
    answer = ANSWER_PREFIX + 'a slow pan"}'
    assert json.loads(answer) == {GUIDANCE_FIELD: "a slow pan"} and GUIDANCE_SCHEMA["required"] == [GUIDANCE_FIELD]
    assert parse_guidance(answer, "stop", CONTRACT).text == "a slow pan"


def test_the_pipelines_give_the_bridge_node_the_whole_format():
    assert BRIDGE_POLICY == {"json_schema": GUIDANCE_SCHEMA, "max_tokens": BRIDGE_POLICY["max_tokens"],
                             "answer_prefix": ANSWER_PREFIX, "output_contract": CONTRACT}
    assert QWEN_TO_WAN_I2V.nodes[0].policy == QWEN_TO_WAN_T2V.nodes[0].policy == BRIDGE_POLICY


def test_the_contract_check_reads_the_bridge_nodes_policy(builder):
    assert builder.validate(QWEN_TO_WAN_I2V) == ["bridge", "video"]

    def plan(policy):
        return PipelinePlan("p", [NodeSpec("bridge", "ar.prompt_bridge", policy=policy),
                                  NodeSpec("video", "diffusion.wan22_i2v", final=True)],
                            edges=[EdgeSpec("bridge", "video", "ar_to_diffusion")])

    for policy, outputs in (({**BRIDGE_POLICY, "output_contract": "text"}, "'text'"), ({}, "None")):
        with pytest.raises(GraphError, match=f"reads 'supplemental_guidance' but node bridge .* outputs {outputs}"):
            builder.validate(plan(policy))
