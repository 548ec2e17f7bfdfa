"""Text routes' streaming: token deltas into SSE chunks (or one collected text), and the latency metrics."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from omni_kernel.events import STOP_REASONS, TRUNCATED_STOP_REASONS, RequestFailed, RequestFinished, TokenDelta

from .logprobs import chat_content, chat_entries
from .metrics import Metrics
from .protocol import APIError

FINISH = {reason: "length" if reason in TRUNCATED_STOP_REASONS else "stop" for reason in STOP_REASONS}


def usage_of(trace) -> dict:
    """OpenAI's `usage` of one finished request; `cached_tokens`: its prompt tokens the prefix cache served."""
    prompt = int(trace.get("ar.input_tokens", 0) or 0)
    completion = int(trace.get("ar.output_tokens", 0) or 0)
    cached = int(trace.get("ar.prefix_cache_hit_tokens", 0) or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def add_usage(total: dict | None, usage: dict) -> dict:
    """Two usages summed (several prompts of one completions request)."""
    if total is None:
        return usage
    out = {k: total[k] + usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    out["prompt_tokens_details"] = {"cached_tokens": total["prompt_tokens_details"]["cached_tokens"]
                                    + usage["prompt_tokens_details"]["cached_tokens"]}
    return out


class Watch:
    """Latency and token figures of one text request, into the metrics."""

    def __init__(self, metrics: Metrics, model: str, arrival: float):
        self.metrics, self.model, self.arrival = metrics, model, arrival
        self.last: float | None = None

    def delta(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.labels(self.model).observe(now - self.arrival)
        else:
            self.metrics.itl.labels(self.model).observe(now - self.last)
        self.last = now

    def usage(self, result) -> dict:
        return usage_of(result.trace)

    def done(self, result, route: str) -> None:
        usage = self.usage(result)
        self.metrics.generated.labels(self.model).inc(usage["completion_tokens"])
        self.metrics.prompt.labels(self.model).inc(usage["prompt_tokens"])
        self.metrics.e2e.labels(self.model, route).observe(time.perf_counter() - self.arrival)
        structured, compile_ms = result.trace.get("ar.structured_output"), result.trace.get("ar.grammar_compile_ms")
        if structured:
            self.metrics.structured.labels(self.model, structured).inc()
        if compile_ms is not None:
            self.metrics.grammar_compile.labels(self.model).observe(compile_ms / 1000)


async def collect(stream, final: str, watch: Watch):
    parts: list[str] = []
    async with stream:
        async for event in stream:
            if isinstance(event, TokenDelta) and event.node_id == final:
                watch.delta()
                parts.append(event.text)
            elif isinstance(event, (RequestFinished, RequestFailed)):
                return "".join(parts), event
    return "".join(parts), RequestFailed(stream.request_id, None, "aborted", "aborted")


async def sse(stream, final: str, watch: Watch, rid: str, model: str, chat: bool, include_usage: bool
              ) -> AsyncIterator[str]:
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    sent = 0  # logprobs entries streamed (omni_serve.logprobs)

    def chunk(delta: str | None, finish: str | None = None, first: bool = False, logprobs=None) -> str:
        if chat:
            body = {"role": "assistant", "content": delta or ""} if first else (
                {} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": body, "finish_reason": finish,
                      "logprobs": None if logprobs is None else chat_content(logprobs)}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        return "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": model,
                                      "choices": [choice]}, ensure_ascii=False) + "\n\n"

    async with stream:
        if chat:
            yield chunk("", first=True)
        async for event in stream:
            if isinstance(event, TokenDelta) and event.node_id == final:
                watch.delta()
                entries = getattr(event, "logprobs", None)  # a stage's ARTokenDelta, when the request asked
                sent += len(entries or ())
                yield chunk(event.text, logprobs=entries or None)
            elif isinstance(event, RequestFinished):
                out = event.result
                watch.done(out, "chat" if chat else "completions")
                rest = chat_entries(out.output)[sent:] if chat else []
                yield chunk(None, FINISH.get(out.output.stop_reason or "eos", "stop"), logprobs=rest or None)
                if include_usage:
                    yield "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": model,
                                                 "choices": [], "usage": watch.usage(out)}) + "\n\n"
            elif isinstance(event, RequestFailed):
                yield "data: " + json.dumps(APIError.of_failure(event.kind, event.error, event.field).body()) + "\n\n"
    yield "data: [DONE]\n\n"
