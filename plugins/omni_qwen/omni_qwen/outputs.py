"""AROutputProcessor: sampled tokens -> streamed text and the final StageOutput with its usage and ar.* trace.

Per request it keeps, in the scheduler's record (`ARSequence.output`), the detokenizer, the text so far and how much
of it was streamed; the tokens are the record's own, and so are the step counters, the grammar state and the
logprobs the runner computed (`ARSequence.state`), which it reads from the record of each output. Token-level stops
(EOS, token budget, context window, a complete grammar) are the scheduler's; stop strings need text, so they are
found here and the stage then stops the request. Text that could still be the start of a stop string is held back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from omni_kernel.core.ar_scheduler import ARSequence
from omni_kernel.core.request import StageOutput, Structured, Usage
from omni_kernel.core.scheduler import RequestOutput
from omni_kernel.core.trace import prefixed
from omni_kernel.events import StageFailed, StageFinished, TokenDelta

from .config import ARNodeSettings
from .detokenize import IncrementalDetokenizer
from .logprobs import LogprobsOutput, RequestLogprobs


@attrs.define
class RequestText:
    detok: IncrementalDetokenizer
    start: float
    text: str = ""
    sent: int = 0  # characters of text already streamed
    ttft_ms: float = 0.0
    logprobs: RequestLogprobs | None = None  # only for a request that asked


class AROutputProcessor:
    def __init__(self, node_id: str, decode: Callable[[list[int]], str], settings: ARNodeSettings,
                 model_trace: Mapping[str, Any], logprobs: LogprobsOutput | None = None):
        self.node_id = node_id
        self.logprobs = logprobs
        self.decode = decode
        self.settings = settings
        self.model_trace = dict(model_trace)  # ar.* fields of the model and KV backend, without the prefix

    def add(self, seq: ARSequence) -> None:
        """A new request; its text starts with the node's answer prefix (written for the model, streamed first)
        unless its prompt came as token ids."""
        prompt = seq.item.processed
        prefix = "" if prompt is not None and prompt.mode.endswith("token_ids") else self.settings.answer_prefix
        seq.output = RequestText(IncrementalDetokenizer(self.decode), time.perf_counter(), text=prefix,
                                 logprobs=self.logprobs.start(seq) if self.logprobs else None)

    def process(self, outputs: list[RequestOutput]) -> tuple[list, list[str]]:
        """Token deltas and StageFinished/StageFailed events; the ids of requests stopped on a stop string."""
        events: list = []
        stops: list[str] = []
        for out in outputs:
            if out.error is not None:
                events.append(StageFailed.of(out.request_id, self.node_id, out.error))
                continue
            delta, reason = self.add_token(out.record, out.result, out.finished)
            if delta is not None:
                events.append(delta)
            if reason is None:
                continue
            if out.finished is None:  # a stop string: the scheduler still holds the request
                stops.append(out.request_id)
            events.append(StageFinished(out.request_id, self.node_id, self.finish(out.record, reason)))
        return events, stops

    def add_token(self, seq: ARSequence, token: int, finished: str | None) -> tuple[TokenDelta | None, str | None]:
        """The new text to stream (if any) and the stop reason: the scheduler's `finished`, or "stop" when the
        text now holds a stop string (which beats a token budget or the context window, not EOS)."""
        req = seq.output
        if req.logprobs is not None:
            self.logprobs.take(req.logprobs, seq)
        if seq.num_output == 1:
            req.ttft_ms = (time.perf_counter() - req.start) * 1000
        stop = seq.item.params.stop if seq.item.params is not None else ()
        reason = finished
        if finished != "eos":
            searched = max(0, len(req.text) - max((len(s) for s in stop), default=1) + 1)
            req.text += req.detok.add(token)
            if finished:  # the last token: text held back for a partial character is final, and searched too
                req.text += req.detok.flush()
            hits = [i for i in (req.text.find(s, searched) for s in stop) if i >= 0]
            if hits:
                req.text = req.text[:min(hits)]
                reason = "stop"
        else:
            req.text += req.detok.flush()
        held = 0 if reason else max((len(s) for s in stop), default=1) - 1
        end = max(req.sent, len(req.text) - held)
        delta = None
        if end > req.sent:
            text = req.text[req.sent:end]
            delta = TokenDelta(seq.request_id, self.node_id, text) if req.logprobs is None else \
                self.logprobs.delta(req.logprobs, seq.request_id, self.node_id, text, finished == "eos")
            req.sent = end
        return delta, reason

    def finish(self, seq: ARSequence, reason: str) -> StageOutput:
        """The request's StageOutput, with its usage, its constraint and its ar.* trace."""
        req, params, prompt = seq.output, seq.item.params, seq.item.processed
        greedy = params is None or params.greedy
        fields = {**step_trace(seq), "output_tokens": seq.num_output - (1 if reason == "eos" else 0),
                  "ttft_ms": round(req.ttft_ms, 3), "stop_reason": reason,
                  "streaming": bool(params is not None and params.stream), "prompt_mode": prompt.mode,
                  "sampling": "greedy" if greedy else "sample", "seed": None if greedy else params.seed,
                  **self.model_trace, **structure_trace(seq)}
        usage = Usage(input_tokens=fields["input_tokens"], output_tokens=fields["output_tokens"],
                      cached_tokens=fields["prefix_cache_hit_tokens"])
        kind = fields["structured_output"]
        structured = None if kind is None else Structured(kind, fields["grammar_compile_ms"])
        return StageOutput(seq.request_id, self.node_id, text=req.text, stop_reason=reason,
                           contract=self.settings.contract,
                           data={"token_ids": seq.output_ids, "prompt_token_ids": list(prompt.token_ids),
                                 **LogprobsOutput.data(req.logprobs)},
                           trace=prefixed("ar", fields), usage=usage, structured=structured)


def step_trace(seq: ARSequence) -> dict[str, Any]:
    """The ar.* trace fields (without the prefix) of the scheduler's counters of the request's steps."""
    steps = max(seq.num_steps, 1)
    decode_mean = round(seq.decode_ms / seq.num_decode_steps, 3) if seq.num_decode_steps else 0.0
    return {"input_tokens": seq.num_prompt, "generated_tokens": seq.num_output,
            "prefill_tokens": seq.num_prefill_tokens, "prefill_ms": round(seq.prefill_ms, 3),
            "decode_ms": round(seq.decode_ms, 3), "scheduler_steps": seq.num_steps,
            "prefill_steps": seq.num_prefill_steps,
            # One model call per decode step on both backends, so the two documented keys are one counter.
            "decode_model_calls": seq.num_decode_steps, "decode_scheduler_steps": seq.num_decode_steps,
            "decode_step_mean_ms": decode_mean, "token_budget": seq.max_tokens, "kv_blocks_used": seq.num_blocks_max,
            "prefix_cache_hit_tokens": max(seq.prefix_hit_tokens, 0), "preemptions": seq.num_preemptions,
            "batch_size_mean": round(seq.batch_seqs / steps, 2), "batch_size_max": seq.batch_seqs_max,
            "batch_tokens_mean": round(seq.batch_tokens / steps, 2)}


def structure_trace(seq: ARSequence) -> dict[str, Any]:
    """The ar.* trace fields of structured output (grammar.Constrained.trace; None for an unconstrained request)."""
    constrained = seq.state.constrained
    if constrained is None:
        return {"structured_output": None, "grammar_compile_ms": None}
    return constrained.trace(seq.request_id)
