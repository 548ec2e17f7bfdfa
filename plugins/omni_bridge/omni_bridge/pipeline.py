"""The qwen_to_wan_i2v and qwen_to_wan_t2v pipelines. They name the other plugins' node types by string: omni_bridge
imports neither."""

from omni_kernel import EdgeSpec, NodeSpec, PipelinePlan

from .connector import ARToDiffusionConnector
from .guidance import ANSWER_PREFIX, CONTRACT, GUIDANCE_MAX_TOKENS, GUIDANCE_SCHEMA

AR_TO_DIFFUSION = ARToDiffusionConnector()
# The bridge node writes its guidance under the contract: its answer started with the contract's prefix, constrained
# to its schema (omni_qwen's structured output), with a budget that the schema's bounded guidance always fits, and
# its output named by the contract (checked against the connector's source_contract when the plan is built).
BRIDGE_POLICY = {"json_schema": GUIDANCE_SCHEMA, "max_tokens": GUIDANCE_MAX_TOKENS, "answer_prefix": ANSWER_PREFIX,
                 "output_contract": CONTRACT}

QWEN_TO_WAN_I2V = PipelinePlan(
    "qwen_to_wan_i2v",
    nodes=[NodeSpec("bridge", "ar.prompt_bridge", policy=BRIDGE_POLICY, plugin_hint="omni-qwen"),
           NodeSpec("video", "diffusion.wan22_i2v", final=True, plugin_hint="omni-wan")],
    edges=[EdgeSpec("bridge", "video", AR_TO_DIFFUSION.name)],
    description="Qwen writes supplemental guidance for the prompt; Wan2.2 renders the image into a video",
)

# The same graph with Wan's text-to-video half: the Wan node's policy refuses an image (omni_wan's inputs.py).
QWEN_TO_WAN_T2V = PipelinePlan(
    "qwen_to_wan_t2v",
    nodes=[NodeSpec("bridge", "ar.prompt_bridge", policy=BRIDGE_POLICY, plugin_hint="omni-qwen"),
           NodeSpec("video", "diffusion.wan22_i2v", final=True, plugin_hint="omni-wan", policy={"image": "none"})],
    edges=[EdgeSpec("bridge", "video", AR_TO_DIFFUSION.name)],
    description="Qwen writes supplemental guidance for the prompt; Wan2.2 renders a video from the merged prompt",
)
