"""One request's state inside ARExecutor: its prompt, sampler, detokenizer and output so far, and the counters
behind its ar.* trace fields."""

from __future__ import annotations

from typing import Any

import attrs

from omni_kernel.ar_scheduler import ScheduledChunk
from omni_kernel.request import StageInput

from .detokenize import IncrementalDetokenizer
from .sampling import Sampler


@attrs.frozen
class ARNodeSettings:
    """What the node's policy fixes for every request of one executor."""

    chat: bool = True  # the prompt goes in as one user message through the chat template
    render: Any = None  # turns the user's prompt into the text the model reads (None: unchanged)
    max_tokens: int | None = None  # the node's token budget; None: EOS or the context window
    contract: str | None = None
    prompt_label: str = ""  # prefixed to ar.prompt_mode (e.g. "bridge_")


@attrs.define
class ARSequenceState:
    item: StageInput
    prompt_ids: list[int]
    prompt_mode: str
    sampler: Sampler
    detok: IncrementalDetokenizer
    max_tokens: int | None  # the smaller of the request's and the node's budget; None: none
    stop: tuple[str, ...]
    ignore_eos: bool
    start: float
    output_ids: list[int] = attrs.Factory(list)
    text: str = ""
    sent: int = 0  # characters of text already streamed
    ttft_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    prefill_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    steps: int = 0
    batch_seqs: int = 0
    batch_seqs_max: int = 0
    batch_tokens: int = 0
    blocks: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0

    def record(self, chunk: ScheduledChunk, step_ms: float, step_seqs: int, step_tokens: int) -> None:
        """Count one engine step this request took part in with `chunk`."""
        decode = (chunk.num_tokens == 1 and bool(self.output_ids)
                  and chunk.start == len(self.prompt_ids) + len(self.output_ids) - 1)
        if decode:
            self.decode_steps += 1
            self.decode_ms += step_ms
        else:  # a prompt chunk, or recompute after preemption
            self.prefill_steps += 1
            self.prefill_tokens += chunk.num_tokens
            self.prefill_ms += step_ms
        self.steps += 1
        self.batch_seqs += step_seqs
        self.batch_seqs_max = max(self.batch_seqs_max, step_seqs)
        self.batch_tokens += step_tokens
        self.blocks = max(self.blocks, len(chunk.block_table))
        self.prefix_hit_tokens += chunk.cached_tokens

    def trace(self, reason: str) -> dict[str, Any]:
        generated = len(self.output_ids)
        steps = max(self.steps, 1)
        return {
            "input_tokens": len(self.prompt_ids), "prefill_tokens": self.prefill_tokens,
            "output_tokens": generated - (1 if reason == "eos" else 0), "generated_tokens": generated,
            "prefill_ms": round(self.prefill_ms, 3), "decode_ms": round(self.decode_ms, 3),
            "ttft_ms": round(self.ttft_ms, 3), "scheduler_steps": self.steps, "prefill_steps": self.prefill_steps,
            "decode_model_calls": self.decode_steps, "decode_scheduler_steps": self.decode_steps,
            "decode_step_mean_ms": round(self.decode_ms / self.decode_steps, 3) if self.decode_steps else 0.0,
            "stop_reason": reason, "streaming": bool(self.item.options.get("stream")),
            "prompt_mode": self.prompt_mode, "token_budget": self.max_tokens,
            "sampling": "greedy" if self.sampler.seed is None else "sample", "seed": self.sampler.seed,
            "kv_blocks_used": self.blocks, "prefix_cache_hit_tokens": self.prefix_hit_tokens,
            "preemptions": self.preemptions, "batch_size_mean": round(self.batch_seqs / steps, 2),
            "batch_size_max": self.batch_seqs_max, "batch_tokens_mean": round(self.batch_tokens / steps, 2),
        }
