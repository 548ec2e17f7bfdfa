"""ARExecutor: the kernel Executor for causal LMs.

Per-request logic lives here (prompt checks, sampling, detokenization, stop conditions, trace); the model
calls go through an ARBackend (prefill / decode_step / finalize), so a different KV-cache backend can take
the place of the DynamicCache one without touching any of it.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import attrs

from omni_kernel.errors import InputError
from omni_kernel.events import StageFinished, TokenDelta
from omni_kernel.params import ARParams
from omni_kernel.request import StageInput, StageOutput
from omni_kernel.scheduler import SchedulerOutput

from .detokenize import IncrementalDetokenizer
from .sampling import Sampler


class ARBackend(Protocol):
    """Model calls over some KV cache. `kv_trace` holds the ar.kv_* trace fields that describe it."""

    kv_trace: dict[str, Any]

    def prefill(self, request_id: str, token_ids: list[int]):
        """Run a request's prompt; return its next-token logits (1-D)."""

    def decode_step(self, request_ids: list[str], token_ids: list[int]):
        """Feed each request its last token; return next-token logits, one row per request."""

    def finalize(self, request_id: str) -> None:
        """Drop everything the backend holds for the request."""


@attrs.frozen
class ARNodeSettings:
    """What the node's policy fixes for every request of one executor."""

    chat: bool = True  # the prompt goes in as one user message through the chat template
    render: Any = None  # turns the user's prompt into the text the model reads (None: unchanged)
    max_tokens: int | None = None  # the node's token budget; None: EOS or the context window
    contract: str | None = None
    prompt_label: str = ""  # prefixed to ar.prompt_mode (e.g. "bridge_")


@attrs.define
class _Sequence:
    item: StageInput
    prompt_ids: list[int]
    prompt_mode: str
    sampler: Sampler
    detok: IncrementalDetokenizer
    max_tokens: int | None
    stop: tuple[str, ...]
    start: float
    output_ids: list[int] = attrs.Factory(list)
    text: str = ""
    sent: int = 0
    prefilled: bool = False
    ttft_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    steps: int = 0
    decode_steps: int = 0
    decode_calls: int = 0


class ARExecutor:
    def __init__(self, node_id: str, pipeline, settings: ARNodeSettings | None = None,
                 backend: ARBackend | None = None):
        self.node_id = node_id
        self.pipeline = pipeline  # tokenizer, chat template, context window, EOS ids
        self.backend = backend or pipeline
        self.settings = settings or ARNodeSettings()
        self.eos = pipeline.eos_token_ids
        self.context_window = pipeline.context_window
        self.sequences: dict[str, _Sequence] = {}

    def encode(self, prompt: str) -> tuple[list[int], str]:
        """The prompt's token ids and how they were built; InputError when the model cannot take it."""
        if not prompt.strip():
            raise InputError("the prompt is empty")
        text = self.settings.render(prompt) if self.settings.render else prompt
        ids, mode = self.pipeline.encode_prompt(text, chat=self.settings.chat)
        if not ids:
            raise InputError("the prompt encodes to no tokens")
        if len(ids) >= self.context_window:
            raise InputError(f"the prompt is {len(ids)} tokens but the model's context window is "
                             f"{self.context_window} tokens (room is needed for at least one new token)")
        return ids, self.settings.prompt_label + mode

    def add_request(self, item: StageInput) -> None:
        start = time.perf_counter()
        params = item.params if isinstance(item.params, ARParams) else ARParams()
        ids, mode = self.encode(item.prompt)
        budgets = [b for b in (params.max_tokens, self.settings.max_tokens) if b is not None]
        self.sequences[item.request_id] = _Sequence(
            item, ids, mode, Sampler(params), IncrementalDetokenizer(self.pipeline.decode),
            min(budgets) if budgets else None, params.stop, start)

    def execute(self, batch: SchedulerOutput) -> list:
        seqs = [self.sequences[rid] for rid in batch.request_ids]
        events: list = []
        decoding = [s for s in seqs if s.prefilled]
        if decoding:
            start = time.perf_counter()
            logits = self.backend.decode_step([s.item.request_id for s in decoding],
                                              [s.output_ids[-1] for s in decoding])
            elapsed = (time.perf_counter() - start) * 1000
            for seq, row in zip(decoding, logits):
                seq.steps += 1
                seq.decode_steps += 1
                seq.decode_calls += 1
                seq.decode_ms += elapsed
                events += self._advance(seq, row)
        for seq in seqs:
            if seq.prefilled:
                continue
            start = time.perf_counter()
            logits = self.backend.prefill(seq.item.request_id, seq.prompt_ids)
            seq.prefill_ms = (time.perf_counter() - start) * 1000
            seq.prefilled = True
            seq.steps += 1
            events += self._advance(seq, logits)
        return events

    def free(self, request_id: str) -> None:
        self.sequences.pop(request_id, None)
        self.backend.finalize(request_id)

    def _advance(self, seq: _Sequence, logits) -> list:
        token = seq.sampler.sample(logits)
        if not seq.output_ids:
            seq.ttft_ms = (time.perf_counter() - seq.start) * 1000
        seq.output_ids.append(token)
        reason = None
        if token in self.eos:
            reason = "eos"
        else:
            searched = max(0, len(seq.text) - max((len(s) for s in seq.stop), default=1) + 1)
            seq.text += seq.detok.add(token)
            hits = [i for i in (seq.text.find(s, searched) for s in seq.stop) if i >= 0]
            if hits:
                seq.text = seq.text[:min(hits)]
                reason = "stop"
        if reason is None and seq.max_tokens is not None and len(seq.output_ids) >= seq.max_tokens:
            reason = "max_tokens"
        if reason is None and len(seq.prompt_ids) + len(seq.output_ids) >= self.context_window:
            reason = "context_window"
        if reason in ("eos", "max_tokens", "context_window"):
            seq.text += seq.detok.flush()
        # Hold back what could still turn out to be the start of a stop string.
        held = 0 if reason else max((len(s) for s in seq.stop), default=1) - 1
        events: list = []
        end = max(seq.sent, len(seq.text) - held)
        if end > seq.sent:
            events.append(TokenDelta(seq.item.request_id, self.node_id, seq.text[seq.sent:end]))
            seq.sent = end
        if reason:
            events.append(StageFinished(seq.item.request_id, self.node_id, self._output(seq, reason)))
        return events

    def _output(self, seq: _Sequence, reason: str) -> StageOutput:
        generated = len(seq.output_ids)
        output_tokens = generated - (1 if reason == "eos" else 0)
        fields = {
            "input_tokens": len(seq.prompt_ids), "prefill_tokens": len(seq.prompt_ids),
            "output_tokens": output_tokens, "generated_tokens": generated,
            "prefill_ms": round(seq.prefill_ms, 3), "decode_ms": round(seq.decode_ms, 3),
            "ttft_ms": round(seq.ttft_ms, 3), "scheduler_steps": seq.steps, "prefill_steps": 1,
            "decode_model_calls": seq.decode_calls, "decode_scheduler_steps": seq.decode_steps,
            "decode_step_mean_ms": round(seq.decode_ms / seq.decode_calls, 3) if seq.decode_calls else 0.0,
            "stop_reason": reason, "streaming": bool(seq.item.options.get("stream")),
            **self.backend.kv_trace, "prompt_mode": seq.prompt_mode,
            "model": str(getattr(self.pipeline, "path", "")), "dtype": getattr(self.pipeline, "dtype", ""),
            "load_ms": round(getattr(self.pipeline, "load_ms", 0.0), 3), "context_window": self.context_window,
            "token_budget": seq.max_tokens,
            "sampling": "greedy" if seq.sampler.seed is None else "sample", "seed": seq.sampler.seed,
        }
        trace = {f"ar.{k}": v for k, v in fields.items()}
        return StageOutput(seq.item.request_id, self.node_id, text=seq.text, stop_reason=reason,
                           contract=self.settings.contract,
                           data={"token_ids": list(seq.output_ids), "prompt_token_ids": list(seq.prompt_ids)},
                           trace=trace)
