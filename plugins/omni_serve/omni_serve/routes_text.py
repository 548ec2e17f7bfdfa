"""POST /v1/chat/completions and POST /v1/completions (completions.py), streamed (SSE) or not; a chat's
messages as the pipeline's prompt (`chat_prompt`)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from omni_kernel.events import RequestFailed

from .chat_audio import answer_spoken, spoken_chat
from .completions import complete
from .guards import until_disconnect
from .handlers import api_error
from .logprobs import chat_content, chat_entries, chat_params
from .protocol import APIError, ChatCompletionRequest, CompletionRequest
from .sampling import sampling
from .state import Served, ServedDep
from .text import FINISH, LatencyRecorder, collect, sse

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest, served: ServedDep):
    return await answer_chat(request, served, body)


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest, served: ServedDep):
    return await complete(request, served, body)


def chat_prompt(body: ChatCompletionRequest, served: Served, name: str) -> tuple[str, dict[str, Any]]:
    """The prompt and parameters of a chat: the whole conversation where the pipeline takes `messages`, else
    its one user message as the prompt."""
    messages = [("system" if m.role == "developer" else m.role,
                 m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or []))
                for m in body.messages]
    if "messages" in served.options(name):
        return "", {"messages": messages}
    if len(messages) == 1 and messages[0][0] == "user":
        return messages[0][1], {}
    raise APIError(400, f"invalid messages: model {body.model!r} takes one user message", "messages")


async def answer_chat(request: Request, served: Served, body: ChatCompletionRequest):
    arrival = time.perf_counter()
    name = served.resolve(body.model, "text")
    spoken = spoken_chat(body, served, name)  # chat_audio: a chat that hears or speaks (None: neither)
    params = sampling(body)
    prompt, extra = ("", {}) if spoken is not None and spoken.heard is not None else chat_prompt(body, served, name)
    params.update(extra, **chat_params(body))
    if spoken is not None:
        return await answer_spoken(request, served, body, spoken, (name, prompt, params), arrival)
    rid = "chatcmpl-" + uuid.uuid4().hex[:24]
    try:
        stream = await served.async_omni.open(name, prompt, request_id=rid, **params)
    except Exception as exc:  # noqa: BLE001 - mapped to its HTTP answer
        raise api_error(exc) from None
    final = served.final(name)
    recorder = LatencyRecorder(served.metrics, body.model, arrival)
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(sse(stream, final, recorder, rid, body.model, usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    result = await until_disconnect(request, collect(stream, final, recorder))
    if result is None:
        return Response(status_code=499)
    _, finished = result
    if isinstance(finished, RequestFailed):
        raise APIError.of_failure(finished.kind, finished.error, finished.field)
    out = finished.result
    recorder.done(out, "chat")
    choice = {"index": 0, "finish_reason": FINISH[out.output.stop_reason or "eos"],
              "logprobs": chat_content(chat_entries(out.output)) if body.logprobs else None,
              "message": {"role": "assistant", "content": out.text or "", "refusal": None}}
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": body.model,
            "choices": [choice], "usage": recorder.usage(out)}
