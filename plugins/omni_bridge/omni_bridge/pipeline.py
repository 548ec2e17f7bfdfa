"""The qwen_to_wan_i2v and qwen_to_wan_t2v pipelines. They name the other plugins' node types by string: omni_bridge
imports neither."""

from omni_kernel import EdgeSpec, NodeSpec, PipelinePlan

from .connector import ARToDiffusionConnector
from .guidance import GUIDANCE_MAX_TOKENS, GUIDANCE_SCHEMA

AR_TO_DIFFUSION = ARToDiffusionConnector()
# The bridge node writes its guidance under the contract's schema (omni_qwen's structured output), with a budget
# that the schema's bounded guidance always fits.
BRIDGE_POLICY = {"json_schema": GUIDANCE_SCHEMA, "max_tokens": GUIDANCE_MAX_TOKENS}

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
