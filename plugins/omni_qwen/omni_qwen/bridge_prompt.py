"""The prompt_bridge instruction and its JSON contract (docs/qwen.md, "The prompt_bridge contract").

The node asks the model for exactly one JSON object; the omni_bridge connector parses it:

    {"guidance": "<one to three sentences of extra visual detail>", "negative_prompt": "<things to avoid>"}

`guidance` is required (a non-empty string); `negative_prompt` is optional (a string, may be empty).
"""

CONTRACT = "supplemental_guidance"
REQUIRED_FIELDS = ("guidance",)
OPTIONAL_FIELDS = ("negative_prompt",)

BRIDGE_INSTRUCTION = (
    "You help a video model (Wan2.2 image-to-video) render a user's video prompt. Do not repeat or rewrite "
    "the prompt. Add concrete visual detail that the prompt leaves open: motion, camera movement, lighting, "
    "atmosphere and style. Answer with one JSON object and nothing else, in exactly this form:\n"
    '{"guidance": "one to three short sentences of visual detail", '
    '"negative_prompt": "comma-separated things to avoid, or an empty string"}\n\n'
    "Video prompt: "
)


def bridge_prompt(user_prompt: str) -> str:
    """The text sent to the model (as one user message) for a user's video prompt."""
    return BRIDGE_INSTRUCTION + user_prompt
