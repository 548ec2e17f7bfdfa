"""PagedARExecutor: the kernel Executor over PagedQwen2 + KVPool, driven by an ARScheduler.

It owns per-request sampling state and output tokens; the scheduler owns token ids, positions and blocks.
Prompts are token ids (`options["prompt_token_ids"]`) or text encoded with the given tokenizer.
"""

from __future__ import annotations

import time

import attrs

from omni_kernel.ar_scheduler import ARSchedulerOutput
from omni_kernel.errors import InvalidParameter
from omni_kernel.events import StageFinished, TokenDelta
from omni_kernel.request import StageInput, StageOutput
from omni_kernel.runner import RunnerOutput

from .batch import build_step
from .pool import KVPool
from .qwen2 import PagedQwen2
from .sample import choose, make_generator


@attrs.define
class _Request:
    item: StageInput
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    generator: object
    start: float
    output_ids: list[int] = attrs.Factory(list)
    text: str = ""
    first_token_ms: float | None = None
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    batch_tokens: int = 0
    batch_seqs: int = 0
    blocks: int = 0


class PagedARExecutor:
    def __init__(self, node_id: str, model: PagedQwen2, pool: KVPool, tokenizer=None,
                 eos_token_ids: tuple[int, ...] = (), default_max_tokens: int = 256):
        self.node_id, self.model, self.pool, self.tokenizer = node_id, model, pool, tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.default_max_tokens = default_max_tokens
        self.requests: dict[str, _Request] = {}
        self.step_log: list[tuple[int, int]] = []  # (sequences, tokens) per step

    def add_request(self, item: StageInput) -> None:
        ids = item.options.get("prompt_token_ids")
        if ids is None:
            if self.tokenizer is None:
                raise InvalidParameter("prompt", "this executor needs prompt_token_ids or a tokenizer")
            ids = self.tokenizer.encode(item.prompt)
        ids = [int(i) for i in ids]
        if not ids:
            raise InvalidParameter("prompt", "must not be empty")
        params = item.params
        max_tokens = getattr(params, "max_tokens", None) or self.default_max_tokens
        limit = min(self.pool.capacity_tokens, self.model.max_positions)
        if len(ids) + max_tokens > limit:
            raise InvalidParameter("max_tokens", f"prompt ({len(ids)}) + max_tokens ({max_tokens}) exceeds the "
                                                 f"{limit} tokens this engine can hold for one request")
        self.requests[item.request_id] = _Request(item, ids, max_tokens, bool(item.options.get("ignore_eos")),
                                                  make_generator(getattr(params, "seed", None)),
                                                  time.perf_counter())

    def prompt_ids(self, item: StageInput) -> list[int]:
        return self.requests[item.request_id].prompt_ids

    def execute(self, batch: ARSchedulerOutput) -> RunnerOutput:
        step = build_step(batch.chunks, batch.block_size, self.model.dtype)
        logits = self.model.forward(step, self.pool)
        self.step_log.append((len(batch.chunks), step.num_tokens))
        for rid in batch.preempted:
            if rid in self.requests:
                self.requests[rid].preemptions += 1
        for chunk in batch.chunks:
            req = self.requests[chunk.request_id]
            req.steps += 1
            req.batch_seqs += len(batch.chunks)
            req.batch_tokens += step.num_tokens
            req.prefix_hit_tokens += chunk.cached_tokens
            req.blocks = len(chunk.block_table)
        events, results = [], {}
        greedy = logits.argmax(-1).tolist()
        for row, rid in enumerate(step.sample_ids):
            req = self.requests[rid]
            params = req.item.params
            token = greedy[row] if params is None or params.temperature == 0 else \
                choose(logits[row].float(), params, req.generator)
            req.output_ids.append(token)
            results[rid] = token
            if req.first_token_ms is None:
                req.first_token_ms = (time.perf_counter() - req.start) * 1000
            delta = self._delta(req)
            if delta:
                events.append(TokenDelta(rid, self.node_id, delta))
            stop = self._stop(req, token)
            if stop:
                events.append(StageFinished(rid, self.node_id, self._output(req, stop)))
        return RunnerOutput(events, results)

    def free(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def _stop(self, req: _Request, token: int) -> str | None:
        if token in self.eos_token_ids and not req.ignore_eos:
            return "eos"
        return "max_tokens" if len(req.output_ids) >= req.max_tokens else None

    def _delta(self, req: _Request) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the rest
        delta, req.text = text[len(req.text):], text
        return delta

    def _output(self, req: _Request, stop: str) -> StageOutput:
        steps = max(req.steps, 1)
        trace = {"ar.input_tokens": len(req.prompt_ids), "ar.output_tokens": len(req.output_ids),
                 "ar.generated_tokens": len(req.output_ids), "ar.ttft_ms": round(req.first_token_ms or 0.0, 3),
                 "ar.stop_reason": stop, "ar.kv_cache": True, "ar.kv_cache_backend": "paged",
                 "ar.runtime_kv_manager": True, "ar.kv_blocks_used": req.blocks,
                 "ar.prefix_cache_hit_tokens": req.prefix_hit_tokens, "ar.preemptions": req.preemptions,
                 "ar.batch_size_mean": round(req.batch_seqs / steps, 2),
                 "ar.batch_tokens_mean": round(req.batch_tokens / steps, 2)}
        if self.tokenizer is not None:
            req.text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        return StageOutput(req.item.request_id, self.node_id, text=req.text, data=list(req.output_ids),
                           stop_reason=stop, trace=trace)
