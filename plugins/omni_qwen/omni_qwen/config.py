"""What the AR node types declare (no torch): the run's config keys, the request parameters and node policies.

QwenConfig holds the model-level keys of every AR node of a run (one flat namespace with the other plugins',
hence the `ar_` prefix); QwenParams are one request's; TextGenerationPolicy and PromptBridgePolicy are a node's
policy (`NodeSpec.policy`, validated by the kernel when the plan is built), which fixes its ARNodeSettings.
"""

from __future__ import annotations

import numbers
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from omni_hf import DTYPE_NAMES

from omni_kernel.core.errors import InvalidParameter
from omni_kernel.core.params import FALSE, TRUE, ARParams, boolean, integer, option, text

from . import structured

KV_BACKENDS = ("paged", "dynamic_cache")
DEFAULT_KV_TOKENS = 32768
DEFAULT_MAX_NUM_SEQS = 64
COMPILE_ENV = "OMNI_AR_COMPILE"  # ar_compile's default where none is given (docs/qwen.md)
BLOCK_SIZE = 16
MAX_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI's chat allows 20, its completions 5
UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
         "g": 10**9, "gb": 10**9, "gib": 2**30}


def parse_bytes(value: Any, field: str = "ar_kv_memory") -> int:
    """An int of bytes, or text: a number and an optional unit (B, KB, KiB, MB, MiB, GB, GiB; case-insensitive)."""
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
        if match and match.group(2).lower() in UNITS:
            number = int(float(match.group(1)) * UNITS[match.group(2).lower()])
    if number is None or number < 1:
        raise InvalidParameter(field, f"{value!r} is not a positive size in bytes (e.g. 268435456 or \"256MiB\")")
    return number


def _path(instance, attribute, value) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise InvalidParameter(attribute.name, f"{value!r} is not a path")


@attrs.frozen
class QwenConfig:
    """Model-level settings of the AR stages of one run (docs/qwen.md, "Serving engine")."""

    ar_model: str | os.PathLike | None = option(
        None, help="Local causal-LM directory (default: SmolLM2-135M-Instruct from `omni models fetch`, else a tiny "
                   "demo model)", flag="--ar-model", validator=_path)
    ar_dtype: str = option("auto", help="weights dtype; auto: the checkpoint's on a GPU, on a CPU bf16 where its bf16 "
                                        "matmuls are faster (AMX-BF16, or measured), else fp32", choices=DTYPE_NAMES)
    ar_device: str | None = option(None, help="torch device, e.g. cpu or cuda:0 (default: cuda if available)",
                                   validator=text)
    ar_trust_remote_code: bool = option(False, help="allow the model directory's own Python code", type=bool,
                                        validator=boolean)
    ar_kv_backend: str | None = option(None, help="KV cache backend (default: paged when the model supports it)",
                                       choices=KV_BACKENDS)
    ar_kv_memory: int | None = option(None, help="KV budget: bytes or text like 256MiB (default: room for "
                                                 f"max(context window, {DEFAULT_KV_TOKENS}) tokens)",
                                      converter=lambda v: None if v is None else parse_bytes(v))
    ar_max_num_seqs: int | None = option(None, help="sequences per engine step (default: node policy, else "
                                                    f"{DEFAULT_MAX_NUM_SEQS})", type=int, validator=integer(1))
    ar_max_num_batched_tokens: int = option(512, help="tokens per engine step; longer prompts prefill in chunks",
                                            type=int, validator=integer(1))
    ar_prefix_caching: bool = option(True, help="reuse the K/V of shared prompt prefixes (paged backend only)",
                                     type=bool, validator=boolean)
    ar_compile: bool | None = option(
        None, help="compile the decode step with torch.compile, and on a CPU build its C++ attention kernel (paged "
                   "backend; needs a C++ compiler on a CPU; a minute or more at the first load, less once cached); "
                   "default: where the machine can, else eager, saying why (omni run: eager; $OMNI_AR_COMPILE)",
        type=bool, validator=boolean, run_default=False)

    def compile_mode(self) -> bool | None:
        """ar_compile as given, else OMNI_AR_COMPILE's (a test session sets false), else None: compiled where the
        machine can."""
        if self.ar_compile is not None:
            return self.ar_compile
        text = os.environ.get(COMPILE_ENV, "").strip().lower()
        if text in ("", "auto"):
            return None
        if text not in TRUE | FALSE:
            raise InvalidParameter(COMPILE_ENV, f"{text!r} is not true, false or auto")
        return text in TRUE

    def kv_memory_for(self, bytes_per_token: int, context_window: int) -> int:
        return self.ar_kv_memory or bytes_per_token * max(context_window, DEFAULT_KV_TOKENS)

    def max_num_seqs_for(self, policy_max_num_seqs: int | None) -> int:
        """The engine's sequences per step: the run's ar_max_num_seqs, else the node policy's, else the default."""
        return self.ar_max_num_seqs or policy_max_num_seqs or DEFAULT_MAX_NUM_SEQS


def _token_ids(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        ids = None if isinstance(value, (str, bytes)) else tuple(value)
    except TypeError:
        ids = None
    if ids is None or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
        raise InvalidParameter("prompt_token_ids", "must be a list of token ids")
    if not ids:
        raise InvalidParameter("prompt_token_ids", "is empty")
    return tuple(int(i) for i in ids)


CHAT_ROLES = ("system", "user", "assistant")


def _messages(value: Any) -> tuple[tuple[str, str], ...] | None:
    """Chat messages as ((role, content), ...): from pairs, from dicts {"role", "content"} (content a string or
    a list of text parts {"type": "text", "text": ...}), or from "role: content" strings (`-o messages=...`)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)):
        value = (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise InvalidParameter("messages", f"{value!r} is not a list of messages") from None
    out = [_message(i, item) for i, item in enumerate(items)]
    if not out:
        raise InvalidParameter("messages", "is empty")
    return tuple(out)


def _message(i: int, item: Any) -> tuple[str, str]:
    """Message i as (role, content), from any of the forms `_messages` takes."""
    if isinstance(item, str):
        role, sep, content = item.partition(":")
        if not sep:
            raise InvalidParameter(f"messages[{i}]", f"{item!r} is not 'role: content'")
        role, content = role.strip(), content.strip()
    elif isinstance(item, Mapping):
        role, content = item.get("role"), _content(i, item.get("content"))
        extra = sorted(set(item) - {"role", "content", "name"})
        if extra:
            raise InvalidParameter(f"messages[{i}].{extra[0]}", "is not supported")
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        role, content = item[0], _content(i, item[1])
    else:
        raise InvalidParameter(f"messages[{i}]", f"{item!r} is not a message (role and content)")
    if role not in CHAT_ROLES:
        raise InvalidParameter(f"messages[{i}].role", f"{role!r} is not one of {', '.join(CHAT_ROLES)}")
    if not isinstance(content, str):
        raise InvalidParameter(f"messages[{i}].content", "must be text")
    if not _utf8(content):  # a lone surrogate (JSON's "\ud800"): no tokenizer takes it
        raise InvalidParameter(f"messages[{i}].content", "is not valid UTF-8 text (it holds a lone surrogate)")
    return role, content


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _content(index: int, content: Any) -> Any:
    """A message's content: a string, or a list of text parts joined."""
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise InvalidParameter(f"messages[{index}].content[{j}]", "only text parts "
                                       '({"type": "text", "text": ...}) are supported')
            texts.append(part["text"])
        return "".join(texts)
    return content


@attrs.frozen
class QwenParams(ARParams):
    """ARParams plus the prompt given as token ids (then the prompt text, chat template and instruction are
    not used), or as chat messages rendered with the model's chat template, or read as raw text."""

    prompt_token_ids: tuple[int, ...] | None = option(None, help="the prompt as token ids (repeatable)",
                                                      type=int, multiple=True, converter=_token_ids)
    messages: tuple[tuple[str, str], ...] | None = option(
        None, help="chat messages, 'role: content' (system, user, assistant; repeatable), rendered with the "
                   "model's chat template instead of the prompt", multiple=True, converter=_messages)
    raw_prompt: bool = option(False, help="the prompt is raw text to continue: no chat template around it "
                                          "(OpenAI's /v1/completions)", type=bool, validator=boolean)
    # Structured output (structured.py, grammar.py): at most one of these constrains the request's tokens.
    json_schema: str | None = option(None, help="constrain the output to JSON valid under this JSON schema (JSON "
                                                "text or a mapping)", converter=structured.json_schema)
    json_object: bool = option(False, help="constrain the output to one JSON object", type=bool, validator=boolean)
    regex: str | None = option(None, help="constrain the output to match this regular expression",
                               converter=structured.regex)
    choice: tuple[str, ...] | None = option(None, help="constrain the output to exactly one of these strings "
                                                       "(repeatable)", multiple=True, converter=structured.choice)

    # Logprobs (docs/qwen.md, "Logprobs"): log-softmax of the raw logits, before temperature, top-k and top-p.
    logprobs: int | None = option(None, help=f"logprobs of each generated token and of its {MAX_LOGPROBS} best "
                                             "alternatives at most (0: the chosen token's only)", type=int,
                                  validator=integer(0, MAX_LOGPROBS))
    prompt_logprobs: int | None = option(None, help="logprobs of each prompt token and its best alternatives "
                                                    f"(0-{MAX_LOGPROBS}); the whole prompt is computed (no prefix "
                                                    "cache)", type=int, validator=integer(0, MAX_LOGPROBS))

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        structured.Structure.of(self)  # refuses two constraints at once


@attrs.frozen
class ARNodeSettings:
    """What a node's policy fixes for every request of its stage."""

    chat: bool = True  # the prompt goes in as one user message through the chat template
    render: Callable[[str], str] | None = None  # the text the model reads for a user's prompt (None: unchanged)
    # The chat the model reads for a user's prompt where it has a chat template (None: render's text as one
    # user message), and the start of its answer, written for it (the output text begins with it).
    messages: Callable[[str], Sequence[tuple[str, str]]] | None = None
    answer_prefix: str = ""
    max_tokens: int | None = None  # the node's token budget; None: EOS or the context window
    contract: str | None = None
    prompt_label: str = ""  # prefixed to ar.prompt_mode (e.g. "bridge_")
    json_schema: str | None = None  # the node's own output constraint, for requests that give none (canonical JSON)


@attrs.frozen
class TextGenerationPolicy:
    """The policy of an ar.text_generation node."""

    chat: bool = option(True, help="the prompt goes in as one user message through the chat template", type=bool,
                        validator=boolean)
    max_tokens: int | None = option(None, help="the node's token budget (default: EOS or the context window)",
                                    type=int, validator=integer(1))
    max_num_seqs: int | None = option(None, help=f"sequences per engine step unless the run sets ar_max_num_seqs "
                                                 f"(default {DEFAULT_MAX_NUM_SEQS})", type=int, validator=integer(1))


def _grammar_schema(instance, attribute, value) -> None:
    """A policy's json_schema must be one xgrammar can take (checked when the plan is built)."""
    if value is not None:
        from .grammar import grammar_of  # xgrammar: imported only for a node that has a schema

        grammar_of(structured.Structure("json_schema", value))


@attrs.frozen
class PromptBridgePolicy:
    """The policy of an ar.prompt_bridge node. Its answer's format is its consumer's, which omni_bridge's pipelines
    give: json_schema (the node's output is constrained to it), answer_prefix (the start of the answer, written
    for the model) and output_contract (what the output holds, for the connector that reads it)."""

    chat: bool = option(True, help="the bridge's chat goes through the chat template", type=bool, validator=boolean)
    max_tokens: int | None = option(128, help="the node's token budget", type=int, validator=integer(1))
    max_num_seqs: int | None = option(None, help=f"sequences per engine step unless the run sets ar_max_num_seqs "
                                                 f"(default {DEFAULT_MAX_NUM_SEQS})", type=int, validator=integer(1))
    json_schema: str | None = option(None, help="constrain the node's output to JSON valid under this JSON schema "
                                                "(JSON text or a mapping)", converter=structured.json_schema,
                                     validator=_grammar_schema)
    answer_prefix: str | None = option(None, help="the start of the node's answer, written for the model (its output "
                                                  "text begins with it): a JSON object opened at its string field, "
                                                  "which the instruction and worked answers show too; default: the "
                                                  "guidance text alone", validator=text)
    output_contract: str | None = option(None, help="the contract the node's output holds (StageOutput.contract), "
                                                    "checked against the connector that reads it", validator=text)
