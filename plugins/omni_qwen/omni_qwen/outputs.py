"""AROutputProcessor: sampled tokens -> streamed text and the final StageOutput with its ar.* trace.

Per request it keeps, in the scheduler's record (`ARSequence.output`), the detokenizer, the text so far and how much
of it was streamed; the tokens are the record's own. Token-level stops (EOS, token budget, context window) are the
scheduler's; stop strings need text, so they are found here and the stage then stops the request. Text that could
still be the start of a stop string is held back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from omni_kernel.core.ar_scheduler import ARSequence
from omni_kernel.core.request import StageOutput
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
        self.extra_trace: Callable[[ARSequence], Mapping[str, Any]] | None = None  # grammar.Grammars.trace

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
        """The request's StageOutput, with the scheduler's trace counters of it."""
        req, stats = seq.output, seq.stats()
        params, prompt = seq.item.params, seq.item.processed
        greedy = params is None or params.greedy
        fields = {**stats, "output_tokens": stats["generated_tokens"] - (1 if reason == "eos" else 0),
                  "ttft_ms": round(req.ttft_ms, 3), "stop_reason": reason,
                  "streaming": bool(params is not None and params.stream), "prompt_mode": prompt.mode,
                  "sampling": "greedy" if greedy else "sample", "seed": None if greedy else params.seed,
                  **self.model_trace, **(self.extra_trace(seq) if self.extra_trace else {})}
        return StageOutput(seq.request_id, self.node_id, text=req.text, stop_reason=reason,
                           contract=self.settings.contract,
                           data={"token_ids": seq.output_ids, "prompt_token_ids": list(prompt.token_ids),
                                 **LogprobsOutput.data(req.logprobs)},
                           trace=prefixed("ar", fields))
