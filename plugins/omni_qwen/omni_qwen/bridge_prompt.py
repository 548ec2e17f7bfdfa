"""The prompt_bridge instruction and its JSON contract (docs/qwen.md, "The prompt_bridge contract").

The node asks the model for exactly one JSON object; the omni_bridge connector parses it:

    {"guidance": "<one to three sentences of extra visual detail>"}

`guidance` is required (a non-empty string). The connector ignores any other key, so the instruction asks for
nothing else: every token spent on it would come out of the node's small token budget.
"""

CONTRACT = "supplemental_guidance"

BRIDGE_INSTRUCTION = (
    "You help a video model (Wan2.2 image-to-video) render a user's video prompt. Do not repeat or rewrite "
    "the prompt. Add concrete visual detail that the prompt leaves open: motion, camera movement, lighting, "
    "atmosphere and style. Answer with one JSON object and nothing else, in exactly this form:\n"
    '{"guidance": "one to three short sentences of visual detail"}\n\n'
    "Video prompt: "
)


def bridge_prompt(user_prompt: str) -> str:
    """The text sent to the model (as one user message) for a user's video prompt."""
    return BRIDGE_INSTRUCTION + user_prompt
