"""The prompt_bridge instruction and its JSON contract (docs/qwen.md, "The prompt_bridge contract").

The node asks the model for exactly one JSON object; the omni_bridge connector parses it:

    {"guidance": "<one or two sentences of extra visual detail>"}

`guidance` is required (a non-empty string). The connector ignores any other key, so the instruction asks for
nothing else: every token spent on it would come out of the node's small token budget.

Small models follow a format far better from worked turns than from a description (benchmarks/bridge_rate.py
measures it, docs/bridge.md has the figures), so the chat is: the instruction as the system message, a few
example prompts each answered by its JSON object, then the user's prompt; and the answer is started for the
model with ANSWER_PREFIX, so it writes the guidance text and closes the object. The stage's output text
begins with that prefix, so the connector reads one whole object.
"""

from __future__ import annotations

import json

CONTRACT = "supplemental_guidance"

BRIDGE_INSTRUCTION = (
    "You help a video model render a user's video prompt. Do not repeat or rewrite the prompt. Add concrete "
    "visual detail that the prompt leaves open: camera movement, lighting, atmosphere and style, in one or two "
    'short sentences. Answer with one JSON object and nothing else: {"guidance": "..."}'
)
USER_LABEL = "Video prompt: "
# Worked turns, each one whole sentence (a 135M model given comma lists loops on them); none is about a subject
# a user is likely to send verbatim.
EXAMPLES = (
    ("A sailboat on a calm lake",
     "The camera slowly circles the boat as morning mist drifts over the still water, lit by a warm sunrise."),
    ("A street musician playing violin in the rain",
     "A handheld close-up pulls back to a wide shot, with warm shop windows glowing through the rain."),
    ("A dog running along the beach",
     "A low tracking shot follows the dog through the surf in bright afternoon sun."),
)
ANSWER_PREFIX = '{"guidance": "'


def answer(guidance: str) -> str:
    return json.dumps({"guidance": guidance}, ensure_ascii=False)


def bridge_messages(user_prompt: str) -> list[tuple[str, str]]:
    """The chat sent to a model with a chat template, before ANSWER_PREFIX starts its answer."""
    messages = [("system", BRIDGE_INSTRUCTION)]
    for prompt, guidance in EXAMPLES:
        messages += [("user", USER_LABEL + prompt), ("assistant", answer(guidance))]
    return messages + [("user", USER_LABEL + user_prompt)]


def bridge_prompt(user_prompt: str) -> str:
    """The same as one plain text, for a model without a chat template (or a node with chat off)."""
    shots = "".join(f"{USER_LABEL}{prompt}\n{answer(guidance)}\n\n" for prompt, guidance in EXAMPLES)
    return f"{BRIDGE_INSTRUCTION}\n\n{shots}{USER_LABEL}{user_prompt}\n"
