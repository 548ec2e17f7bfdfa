"""POST /v1/completions: OpenAI's four prompt forms (a text, several texts, one prompt as token ids, several
prompts as token ids), one engine request per prompt and one choice per prompt (`index` = its position).

A completion continues the RAW text: where the pipeline declares `raw_prompt` (omni_qwen's `ar.text_generation`)
the text is tokenized as it is, with no chat template around it; a token-id prompt goes in as
`prompt_token_ids`. Several prompts stream interleaved, each chunk naming its choice's `index`."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from omni_kernel.events import RequestFailed, RequestFinished, TokenDelta

from .guards import until_disconnect
from .handlers import api_error
from .logprobs import Echo, StreamedLogprobs, completion_params, prompt_only
from .protocol import APIError, CompletionRequest
from .sampling import sampling
from .state import Served
from .text import FINISH, LatencyRecorder, add_usage, collect

MAX_PROMPTS = 128  # prompts in one request (OpenAI's `n` limit; each is a request in flight)


def prompts_of(body: CompletionRequest, served: Served, name: str) -> list[tuple[str, dict[str, Any]]]:
    """(prompt text, extra request parameters) of each prompt the request holds."""
    prompt, options = body.prompt, served.options(name)
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "invalid prompt: an empty list", "prompt", "invalid_value")
    if len(prompt) > MAX_PROMPTS:
        raise APIError(400, f"invalid prompt: {len(prompt)} prompts, at most {MAX_PROMPTS}", "prompt", "invalid_value")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]  # one prompt as token ids
    out = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            out.append((item, {"raw_prompt": True} if "raw_prompt" in options else {}))
            continue
        if "prompt_token_ids" not in options:
            raise APIError(400, f"invalid prompt: model {body.model!r} takes text prompts, not token ids", "prompt",
                           "invalid_value")
        if not item:
            raise APIError(400, f"invalid prompt[{i}]: an empty list of token ids", "prompt", "invalid_value")
        out.append(("", {"prompt_token_ids": tuple(item)}))
    return out


async def complete(request: Request, served: Served, body: CompletionRequest):
    arrival = time.perf_counter()
    name = served.resolve(body.model, "text")
    params = sampling(body)
    prompts = prompts_of(body, served, name)
    echoes = [Echo(bool(body.echo), None if "prompt_token_ids" in extra else text, body.logprobs is not None,
                   prompt_only(body)) for text, extra in prompts]
    prompts = [(text, {**extra, **completion_params(body, "prompt_token_ids" in extra)}) for text, extra in prompts]
    if prompt_only(body):
        params["max_tokens"] = 1  # the engine samples one token after a prompt; it is left out of the answer
    rid = "cmpl-" + uuid.uuid4().hex[:24]
    streams = []
    try:
        for i, (prompt, extra) in enumerate(prompts):
            streams.append(await served.async_omni.open(name, prompt, request_id=rid if len(prompts) == 1 else
                                                    f"{rid}-{i}", **{**params, **extra}))
    except Exception as exc:  # noqa: BLE001 - mapped to its HTTP answer; the prompts already in go away
        for stream in streams:
            await stream.aclose()
        raise api_error(exc) from None
    final = served.final(name)
    recorders = [LatencyRecorder(served.metrics, body.model, arrival) for _ in streams]
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(sse_many(streams, final, recorders, rid, body.model, usage, echoes),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    result = await until_disconnect(request, collect_all(streams, final, recorders))
    if result is None:
        return Response(status_code=499)
    choices, usage = [], None
    for i, (_, finished) in enumerate(result):
        if isinstance(finished, RequestFailed):
            raise APIError.of_failure(finished.kind, finished.error, finished.field)
        out = finished.result
        recorders[i].done(out, "completions")
        text, logprobs = echoes[i].whole(out.text or "", out.output.data or {})
        choices.append({"index": i, "text": text, "logprobs": logprobs,
                        "finish_reason": "length" if echoes[i].prompt_only else
                        FINISH[out.output.stop_reason or "eos"]})
        usage = add_usage(usage, recorders[i].usage(out))
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": body.model,
            "choices": choices, "usage": usage}


async def collect_all(streams, final: str, recorders: list[LatencyRecorder]):
    """Every prompt's (text, last event); one that fails ends the others (they are aborted)."""
    tasks = [asyncio.ensure_future(collect(s, final, w)) for s, w in zip(streams, recorders)]
    try:
        results = []
        for task in tasks:
            text, event = await task
            if isinstance(event, RequestFailed):
                return [(text, event)]
            results.append((text, event))
        return results
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class CompletionChunks:
    """The `text_completion` chunks of one streamed completions request of several prompts, each choice with its
    prompt's `index`, and the usage summed over the prompts that finished."""

    def __init__(self, rid: str, model: str, final: str, recorders: list[LatencyRecorder], echoes: list[Echo]):
        self.rid, self.model, self.final = rid, model, final
        self.created = int(time.time())
        self.recorders, self.echoes = recorders, echoes
        self.logprobs = [StreamedLogprobs(echo) for echo in echoes]
        self.usage: dict | None = None

    def chunk(self, choices: list, usage: dict | None = None) -> str:
        body = {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return "data: " + json.dumps(body, ensure_ascii=False) + "\n\n"

    def of(self, i: int, event) -> list[str]:
        """The chunks of prompt `i`'s event (none for an event of another node, or one that says nothing)."""
        if isinstance(event, TokenDelta) and event.node_id == self.final:
            return self._delta(i, event)
        if isinstance(event, RequestFinished):
            return self._finished(i, event)
        return []

    def _head(self, i: int, event=None, data: dict | None = None) -> list[str]:
        """The echoed prompt (and its logprobs) before the prompt's first text, once (it sets where the text's
        logprobs offsets start: before them)."""
        head = self.logprobs[i].start(event, data)
        if head is None:
            return []
        return [self.chunk([{"index": i, "text": head[0], "finish_reason": None, "logprobs": head[1]}])]

    def _delta(self, i: int, event: TokenDelta) -> list[str]:
        self.recorders[i].delta()
        if self.echoes[i].prompt_only:
            return []
        head = self._head(i, event)
        text = self.chunk([{"index": i, "text": event.text, "finish_reason": None,
                            "logprobs": self.logprobs[i].delta(event)}])
        return [*head, text]

    def _finished(self, i: int, event: RequestFinished) -> list[str]:
        out = event.result
        self.recorders[i].done(out, "completions")
        self.usage = add_usage(self.usage, self.recorders[i].usage(out))
        data = out.output.data or {}
        prompt_only = self.echoes[i].prompt_only
        head = self._head(i, data=data)
        last = self.chunk([{"index": i, "text": "", "logprobs": None if prompt_only else self.logprobs[i].rest(data),
                            "finish_reason": "length" if prompt_only else FINISH[out.output.stop_reason or "eos"]}])
        return [*head, last]


async def sse_many(streams, final: str, recorders: list[LatencyRecorder], rid: str, model: str, include_usage: bool,
                   echoes: list[Echo]) -> AsyncIterator[str]:
    """The prompts' deltas as `text_completion` chunks as they come, each with its prompt's `index`; the
    usage chunk (summed) after the last prompt finished."""
    chunks = CompletionChunks(rid, model, final, recorders, echoes)
    events = merged(streams)
    try:
        async for i, event in events:
            if isinstance(event, RequestFailed):
                yield "data: " + json.dumps(APIError.of_failure(event.kind, event.error, event.field).body()) + "\n\n"
                break
            for line in chunks.of(i, event):
                yield line
        else:
            if include_usage and chunks.usage is not None:
                yield chunks.chunk([], chunks.usage)
    finally:
        await events.aclose()
    yield "data: [DONE]\n\n"


async def merged(streams) -> AsyncIterator[tuple[int, object]]:
    """(index of its prompt, event) of every stream's events as they come; leaving early closes (aborts) the
    streams still open. One stream is read directly (no task and queue between it and the caller)."""
    if len(streams) == 1:
        async with streams[0] as stream:
            async for event in stream:
                yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async with stream:
                async for event in stream:
                    await queue.put((i, event))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    open_ = len(streams)
    try:
        while open_:
            i, event = await queue.get()
            if event is None:
                open_ -= 1
            else:
                yield i, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
