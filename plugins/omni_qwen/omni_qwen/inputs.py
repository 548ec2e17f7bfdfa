"""ARInputProcessor: what an AR stage makes of a request's input, once, when the request arrives.

It needs the tokenizer and the model's limits, never the model: the prompt becomes token ids (as one user
message through the chat template, as raw text, or given directly), the request's token budget is fixed and
checked against the context window and the KV pool, and an unseeded sampled request gets its seed here.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

import attrs

from omni_kernel.core.ar_scheduler import ARPrompt
from omni_kernel.core.errors import InputError, InvalidParameter
from omni_kernel.core.params import check_prompt
from omni_kernel.core.request import StageInput

from .config import ARNodeSettings, QwenParams
from .structured import PrefixedPrompt, Structure

if TYPE_CHECKING:
    from .grammar import Grammars


def check_fits(prompt: ARPrompt, context_window: int, capacity_tokens: int | None) -> None:
    """Refuse a request whose prompt and budget can never fit the KV pool (it would stall the engine)."""
    needed = prompt.kv_slots(context_window)
    if capacity_tokens is not None and needed > capacity_tokens:
        raise InputError(f"the prompt ({len(prompt.token_ids)} tokens) and its token budget need {needed} KV slots but "
                         f"this stage's KV pool holds {capacity_tokens} tokens: raise ar_kv_memory or lower "
                         "max_tokens")


def check_request(item: StageInput, settings: ARNodeSettings) -> None:
    """What processing refuses without the model or its tokenizer (the node type's `check`, before any model
    loads, and the first thing `process` does): the prompt must say something unless chat messages or token ids
    stand for it; messages come alone, and only to a node that takes them; one output constraint at most.
    Whether xgrammar takes the constraint is asked at `process` (grammar.py imports torch and xgrammar, which a
    front that places the stage in a worker never imports)."""
    params = item.params if item.params is not None else QwenParams()
    messages = getattr(params, "messages", None)
    given = getattr(params, "prompt_token_ids", None)
    if messages is not None:
        if given is not None or item.prompt.strip():
            raise InvalidParameter("messages", "give either messages or a prompt (or prompt_token_ids), not both")
        if settings.render is not None or not settings.chat:
            raise InvalidParameter("messages", "this node writes its own prompt and takes no chat messages")
    elif given is None:
        check_prompt(item.prompt)
    Structure.of(params)


def longest_token(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for (its longest vocabulary entry, added and special
    tokens included; a byte-level entry's length is its byte count, at least its character count): a prompt of
    more than `context_window * longest_token` characters cannot fit, whatever its text."""
    try:
        vocab = tokenizer.get_vocab()
        return max(1, max(map(len, vocab), default=1))
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary: a generous bound
        return 256


class ARInputProcessor:
    """`grammars`: the engine's compile cache, which checks a request's structured output and starts compiling it.
    `concurrent`: whether `process` may run beside a step (build.py gives True when the tokenizer is a copy of its
    own, not the one the output side decodes with)."""

    def __init__(self, tokenizer, settings: ARNodeSettings, context_window: int, vocab_size: int,
                 capacity_tokens: int | None = None, grammars: Grammars | None = None, concurrent: bool = False):
        self.tokenizer = tokenizer
        self.settings = settings
        self.context_window = context_window
        self.vocab_size = vocab_size
        self.capacity_tokens = capacity_tokens
        self.grammars = grammars
        self.concurrent = concurrent
        self._longest: int | None = None

    @property
    def max_chars(self) -> int:
        """The most characters a prompt (or the chat messages together) can have and still fit the context window;
        longer text is refused before the tokenizer sees any of it (tokenizing megabytes holds the stage, and the
        memory, for seconds)."""
        if self._longest is None:
            self._longest = longest_token(self.tokenizer)
        return self.context_window * self._longest

    def check_length(self, field: str, chars: int) -> None:
        if chars > self.max_chars:
            raise InvalidParameter(field, f"is {chars} characters, more than any prompt that fits the model's "
                                          f"context window of {self.context_window} tokens can have "
                                          f"({self.max_chars} characters at most)")

    def check(self, item: StageInput) -> None:
        check_request(item, self.settings)

    def process(self, item: StageInput) -> StageInput:
        """The input with `processed` set to its ARPrompt and `params.seed` fixed; InputError when it cannot run."""
        self.check(item)
        params = item.params if item.params is not None else QwenParams()
        messages = getattr(params, "messages", None)
        if messages is not None:
            ids, mode = self.encode_messages(messages)
        else:
            ids, mode = self.encode(item.prompt, getattr(params, "prompt_token_ids", None),
                                    getattr(params, "raw_prompt", False))
        if self.settings.json_schema is not None and Structure.of(params) is None:
            params = attrs.evolve(params, json_schema=self.settings.json_schema)
        budgets = [b for b in (params.max_tokens, self.settings.max_tokens) if b is not None]
        prompt = ARPrompt(ids, min(budgets) if budgets else None, params.ignore_eos, mode,
                          prefix_cache=getattr(params, "prompt_logprobs", None) is None)  # logits of every position
        structure = Structure.of(params)
        if structure is not None and self.settings.answer_prefix and not mode.endswith("token_ids"):
            prompt = PrefixedPrompt(ids, prompt.max_tokens, prompt.ignore_eos, mode, prompt.prefix_cache,
                                    self.settings.answer_prefix)
        check_fits(prompt, self.context_window, self.capacity_tokens)
        if self.grammars is not None:
            self.grammars.check(item.request_id, structure)
        if not params.greedy and params.seed is None:  # drawn once, so the trace can report it
            params = attrs.evolve(params, seed=secrets.randbits(63))
        return attrs.evolve(item, params=params, processed=prompt)

    def encode(self, prompt: str, given: tuple[int, ...] | None = None, raw: bool = False) -> tuple[list[int], str]:
        """The prompt's token ids and how they were built (ar.prompt_mode); `raw`: the text as it is, without the
        chat template."""
        if given is not None:
            ids, mode = list(given), "token_ids"
            if any(i < 0 or i >= self.vocab_size for i in ids):
                raise InvalidParameter("prompt_token_ids",
                                       f"holds ids outside the vocabulary (0..{self.vocab_size - 1})")
        else:
            self.check_length("prompt", len(prompt))
            ids, mode = self.tokenize(prompt, raw)
            if not ids:
                raise InputError("the prompt encodes to no tokens")
        if len(ids) >= self.context_window:
            raise InputError(f"the prompt is {len(ids)} tokens but the model's context window is "
                             f"{self.context_window} tokens (room is needed for at least one new token)")
        return ids, self.settings.prompt_label + mode

    def encode_messages(self, messages) -> tuple[list[int], str]:
        """Chat messages through the model's chat template (multi-turn, with a system message or not), once
        `check_request` has let them through."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InputError("the model has no chat template, so it cannot take chat messages; send a prompt")
        self.check_length("messages", sum(len(c) for _, c in messages))
        ids = self.tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = list(ids)
        if len(ids) >= self.context_window:
            raise InputError(f"the prompt is {len(ids)} tokens but the model's context window is "
                             f"{self.context_window} tokens (room is needed for at least one new token)")
        return ids, self.settings.prompt_label + "chat_messages"

    def tokenize(self, prompt: str, raw: bool = False) -> tuple[list[int], str]:
        """The user's prompt as the node renders it: through the chat template (one user message, or the node's
        own chat) or as raw text when there is none (or `raw`: a completion continues the text as it is); then
        the node's answer prefix, if any."""
        settings, tokenizer = self.settings, self.tokenizer
        if raw:
            return list(tokenizer.encode(prompt)), "raw"
        text = settings.render(prompt) if settings.render else prompt
        if settings.chat and getattr(tokenizer, "chat_template", None):
            turns = settings.messages(prompt) if settings.messages else [("user", text)]
            messages = [{"role": role, "content": content} for role, content in turns]
            if not settings.answer_prefix:
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
                return list(ids), "chat_template"
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(tokenizer.encode(rendered + settings.answer_prefix, add_special_tokens=False)), "chat_template"
        return list(tokenizer.encode(text + settings.answer_prefix)), "raw"
