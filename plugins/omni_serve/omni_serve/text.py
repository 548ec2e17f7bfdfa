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


def usage_of(result) -> dict:
    """OpenAI's `usage` of one finished request: what its stages' outputs count (StageOutput.usage), added up;
    `cached_tokens`: its prompt tokens the prefix cache served."""
    counted = [out.usage for out in result.outputs.values() if out.usage is not None]
    prompt = sum(u.input_tokens or 0 for u in counted)
    completion = sum(u.output_tokens or 0 for u in counted)
    cached = sum(u.cached_tokens or 0 for u in counted)
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


class LatencyRecorder:
    """Records one text request's latencies (time to first token, between tokens, end to end) and token counts
    in the metrics."""

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
        return usage_of(result)

    def done(self, result, route: str) -> None:
        usage = self.usage(result)
        self.metrics.generated.labels(self.model).inc(usage["completion_tokens"])
        self.metrics.prompt.labels(self.model).inc(usage["prompt_tokens"])
        self.metrics.e2e.labels(self.model, route).observe(time.perf_counter() - self.arrival)
        for out in result.outputs.values():
            if out.structured is None:
                continue
            self.metrics.structured.labels(self.model, out.structured.kind).inc()
            if out.structured.compile_ms is not None:
                self.metrics.grammar_compile.labels(self.model).observe(out.structured.compile_ms / 1000)


async def collect(stream, final: str, recorder: LatencyRecorder):
    parts: list[str] = []
    async with stream:
        async for event in stream:
            if isinstance(event, TokenDelta) and event.node_id == final:
                recorder.delta()
                parts.append(event.text)
            elif isinstance(event, (RequestFinished, RequestFailed)):
                return "".join(parts), event
    return "".join(parts), RequestFailed(stream.request_id, None, "aborted", "aborted")


async def sse(stream, final: str, recorder: LatencyRecorder, rid: str, model: str,
              include_usage: bool) -> AsyncIterator[str]:
    """A chat's events as `chat.completion.chunk` SSE lines: the assistant's role first, each text delta (with its
    logprobs when the request asked), the finish reason (with the logprobs not streamed yet), the usage when asked,
    an error event if it failed, then [DONE]."""
    created = int(time.time())
    sent = 0  # logprobs entries streamed (omni_serve.logprobs)

    def line(choices: list, **extra) -> str:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices, **extra}
        return "data: " + json.dumps(body, ensure_ascii=False) + "\n\n"

    def chunk(delta: dict, finish: str | None = None, logprobs=None) -> str:
        return line([{"index": 0, "delta": delta, "finish_reason": finish,
                      "logprobs": None if logprobs is None else chat_content(logprobs)}])

    async with stream:
        yield chunk({"role": "assistant", "content": ""})
        async for event in stream:
            if isinstance(event, TokenDelta) and event.node_id == final:
                recorder.delta()
                sent += len(event.logprobs or ())
                yield chunk({"content": event.text}, logprobs=event.logprobs or None)
            elif isinstance(event, RequestFinished):
                out = event.result
                recorder.done(out, "chat")
                rest = chat_entries(out.output)[sent:]
                yield chunk({}, FINISH[out.output.stop_reason or "eos"], logprobs=rest or None)
                if include_usage:
                    yield line([], usage=recorder.usage(out))
            elif isinstance(event, RequestFailed):
                yield "data: " + json.dumps(APIError.of_failure(event.kind, event.error, event.field).body()) + "\n\n"
    yield "data: [DONE]\n\n"
