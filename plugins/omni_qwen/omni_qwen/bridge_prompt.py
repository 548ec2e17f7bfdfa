"""The prompt_bridge instruction and its worked examples (docs/qwen.md, "The prompt_bridge contract").

The node asks the model for supplemental guidance: one or two sentences of extra visual detail for a video prompt.
Its answer's format is not this plugin's: the node's policy gives it (omni_bridge's pipelines give the guidance
contract's). With an `answer_prefix` (a JSON object opened at its string field, as `{"guidance": "`), the node asks
for exactly one JSON object, whose field is required (a non-empty string) and whose other keys the connector
ignores, so the instruction asks for nothing else: every token spent on one would come out of the node's small
token budget. Without one, the answer is the guidance text alone.

Small models follow a format far better from worked turns than from a description (benchmarks/bridge_rate.py
measures it, docs/bridge.md has the figures), so the chat is: the instruction as the system message, a few
example prompts each answered in the format, then the user's prompt; and the answer is started for the model
with the prefix, so it writes the guidance text and closes the object. The stage's output text begins with that
prefix, so the connector reads one whole object.
"""

from __future__ import annotations

import json

BRIDGE_TASK = (
    "You help a video model render a user's video prompt. Do not repeat or rewrite the prompt. Add concrete "
    "visual detail that the prompt leaves open: camera movement, lighting, atmosphere and style, in one or two "
    "short sentences."
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


def instruction(answer_prefix: str | None) -> str:
    """The system message: the task, and with an answer prefix, the one JSON object to answer with."""
    if answer_prefix is None:
        return BRIDGE_TASK
    return f'{BRIDGE_TASK} Answer with one JSON object and nothing else: {answer_prefix}..."}}'


def answer(guidance: str, answer_prefix: str | None) -> str:
    """A worked answer: the guidance alone, or the answer prefix, the guidance as the rest of the JSON string it
    opened, and the object closed."""
    if answer_prefix is None:
        return guidance
    return answer_prefix + json.dumps(guidance, ensure_ascii=False)[1:] + "}"


def bridge_messages(user_prompt: str, answer_prefix: str | None = None) -> list[tuple[str, str]]:
    """The chat sent to a model with a chat template, before the answer prefix starts its answer."""
    messages = [("system", instruction(answer_prefix))]
    for prompt, guidance in EXAMPLES:
        messages += [("user", USER_LABEL + prompt), ("assistant", answer(guidance, answer_prefix))]
    return messages + [("user", USER_LABEL + user_prompt)]


def bridge_prompt(user_prompt: str, answer_prefix: str | None = None) -> str:
    """The same as one plain text, for a model without a chat template (or a node with chat off)."""
    shots = "".join(f"{USER_LABEL}{prompt}\n{answer(guidance, answer_prefix)}\n\n" for prompt, guidance in EXAMPLES)
    return f"{instruction(answer_prefix)}\n\n{shots}{USER_LABEL}{user_prompt}\n"
