"""ARExecutor: the kernel Executor for causal LMs, driven by an ARScheduler.

Per-request logic lives here and only here (prompt encoding and checks, sampling, detokenization, stop
conditions, trace); the model calls go through an ARBackend (backends.py) that computes all of a step's
chunks, so the paged and the DynamicCache backends share every line of it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from omni_kernel.ar_scheduler import ARSchedulerOutput
from omni_kernel.errors import InputError
from omni_kernel.events import StageFinished, TokenDelta
from omni_kernel.params import ARParams
from omni_kernel.request import StageInput, StageOutput
from omni_kernel.runner import RunnerOutput

from .backends import ARBackend
from .detokenize import IncrementalDetokenizer
from .sampling import Sampler
from .sequence import ARNodeSettings, ARSequenceState

STEP_LOG_SIZE = 10_000


class ARExecutor:
    def __init__(self, node_id: str, pipeline, backend: ARBackend, settings: ARNodeSettings | None = None,
                 capacity_tokens: int | None = None):
        self.node_id = node_id
        self.pipeline = pipeline  # tokenizer, chat template, context window, EOS ids
        self.backend = backend
        self.settings = settings or ARNodeSettings()
        self.capacity_tokens = capacity_tokens  # what the KV pool can hold for one request
        self.eos = pipeline.eos_token_ids
        self.context_window = pipeline.context_window
        self.sequences: dict[str, ARSequenceState] = {}
        # (sequences, tokens, forward ms) of recent steps; bounded so a long-lived server does not grow
        self.step_log: deque[tuple[int, int, float]] = deque(maxlen=STEP_LOG_SIZE)
        self.summary = ""  # the engine's KV pool and limits in one line (engine.build_ar_engine)

    # Admission.

    def encode(self, prompt: str, options: Mapping[str, Any] | None = None) -> tuple[list[int], str]:
        """The prompt's token ids and how they were built; InputError when the model cannot take it.
        `options["prompt_token_ids"]` gives the ids directly (no chat template, no instruction)."""
        given = (options or {}).get("prompt_token_ids")
        if given is not None:
            ids, mode = self._given_ids(given), "token_ids"
        else:
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

    def check(self, prompt: str, options: Mapping[str, Any], params: Any) -> tuple[list[int], str, int | None]:
        """Everything add_request refuses, without side effects: the ids, prompt mode and token budget."""
        ids, mode = self.encode(prompt, options)
        params = params if isinstance(params, ARParams) else ARParams()
        budgets = [b for b in (params.max_tokens, self.settings.max_tokens) if b is not None]
        budget = min(budgets) if budgets else None
        needed = len(ids) + min(budget or self.context_window, self.context_window - len(ids))
        if self.capacity_tokens is not None and needed > self.capacity_tokens:
            raise InputError(f"the prompt ({len(ids)} tokens) and its token budget need {needed} KV slots but "
                             f"this stage's KV pool holds {self.capacity_tokens} tokens: raise ar_kv_memory "
                             "or lower max_tokens")
        return ids, mode, budget

    def add_request(self, item: StageInput) -> None:
        start = time.perf_counter()
        ids, mode, budget = self.check(item.prompt, item.options, item.params)
        params = item.params if isinstance(item.params, ARParams) else ARParams()
        self.sequences[item.request_id] = ARSequenceState(
            item, ids, mode, Sampler(params), IncrementalDetokenizer(self.pipeline.decode), budget, params.stop,
            bool(item.options.get("ignore_eos")), start)

    def prompt_ids(self, item: StageInput) -> list[int]:
        """The ARScheduler's view of a request's prompt."""
        return self.sequences[item.request_id].prompt_ids

    # Steps.

    def execute(self, batch: ARSchedulerOutput) -> RunnerOutput:
        for rid in batch.preempted:  # they recompute from scratch later: drop what the backend holds now
            self.backend.finalize(rid)
            if rid in self.sequences:
                self.sequences[rid].preemptions += 1
        start = time.perf_counter()
        request_ids, logits = self.backend.forward(batch)
        elapsed = (time.perf_counter() - start) * 1000
        num_tokens = batch.num_tokens
        self.step_log.append((len(batch.chunks), num_tokens, elapsed))
        for chunk in batch.chunks:
            self.sequences[chunk.request_id].record(chunk, elapsed, len(batch.chunks), num_tokens)
        events: list = []
        results: dict[str, int] = {}
        for rid, row in zip(request_ids, logits):
            seq = self.sequences[rid]
            token = seq.sampler.sample(row)
            results[rid] = token
            events += self._advance(seq, token)
        return RunnerOutput(events, results)

    def free(self, request_id: str) -> None:
        self.sequences.pop(request_id, None)
        self.backend.finalize(request_id)

    def _advance(self, seq: ARSequenceState, token: int) -> list:
        if not seq.output_ids:
            seq.ttft_ms = (time.perf_counter() - seq.start) * 1000
        seq.output_ids.append(token)
        reason = None
        if token in self.eos and not seq.ignore_eos:
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

    def _output(self, seq: ARSequenceState, reason: str) -> StageOutput:
        fields = {**seq.trace(reason), **self.backend.kv_trace,
                  "model": str(getattr(self.pipeline, "path", "")), "dtype": getattr(self.pipeline, "dtype", ""),
                  "load_ms": round(getattr(self.pipeline, "load_ms", 0.0), 3),
                  "context_window": self.context_window}
        return StageOutput(seq.item.request_id, self.node_id, text=seq.text, stop_reason=reason,
                           contract=self.settings.contract,
                           data={"token_ids": list(seq.output_ids), "prompt_token_ids": list(seq.prompt_ids)},
                           trace={f"ar.{k}": v for k, v in fields.items()})

    def _given_ids(self, given) -> list[int]:
        vocab = self.pipeline.vocab_size
        try:
            ids = [int(i) for i in given]
        except (TypeError, ValueError):
            raise InputError("prompt_token_ids must be a list of token ids") from None
        if not ids:
            raise InputError("prompt_token_ids is empty")
        if any(i < 0 or i >= vocab for i in ids):
            raise InputError(f"prompt_token_ids holds ids outside the vocabulary (0..{vocab - 1})")
        return ids
