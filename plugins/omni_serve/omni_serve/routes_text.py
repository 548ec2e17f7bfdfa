"""POST /v1/chat/completions and POST /v1/completions, streamed (SSE) or not, with the mapping of OpenAI's
fields onto the pipeline's declared request parameters (`sampling`, `chat_prompt`)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from omni_kernel.events import RequestFailed

from .guards import until_disconnect
from .handlers import api_error
from .logprobs import chat_content, chat_entries, chat_params
from .protocol import NEUTRAL, SERVER_OWNED, APIError, ChatCompletionRequest, CompletionRequest, SamplingFields
from .state import Served, ServedDep
from .structured import STRUCTURED_FIELDS, structured_params
from .text import FINISH, LatencyRecorder, collect, sse

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest, served: ServedDep):
    return await answer_chat(request, served, body)


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest, served: ServedDep):
    from .completions import complete

    return await complete(request, served, body)


def sampling(body: SamplingFields) -> dict[str, Any]:
    """OpenAI's sampling fields as request parameters; any other field is passed on by its name, for the
    kernel to refuse (naming it) unless a node of the pipeline declares it."""
    if body.n is not None and body.n != 1:
        raise APIError(400, f"invalid n: {body.n} choices are not supported (only n=1)", "n")
    openai_limits(body)
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise APIError(400, "invalid max_tokens: max_tokens and max_completion_tokens disagree", "max_tokens")
    params = {"max_tokens": body.max_completion_tokens if body.max_tokens is None else body.max_tokens,
              "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
              "stop": body.stop, "ignore_eos": body.ignore_eos}
    params = {k: v for k, v in params.items() if v is not None}
    params.update(structured_params(body.model_extra or {}))
    for key, value in (body.model_extra or {}).items():
        if key in STRUCTURED_FIELDS:
            continue
        if key in NEUTRAL:
            neutral = NEUTRAL[key]
            if neutral is not None and value not in neutral:
                raise APIError(400, f"invalid {key}: {value!r} is not supported", key)
            continue
        if key in SERVER_OWNED:
            raise APIError(400, f"invalid {key}: set by the server, not by a request", key)
        params[key] = value
    return params


MAX_TEMPERATURE = 2.0  # OpenAI's range is 0..2
MAX_STOP = 4  # OpenAI takes up to 4 stop sequences


def openai_limits(body: SamplingFields) -> None:
    """What OpenAI refuses that omni's node types would take: 400 naming the field, as OpenAI answers."""
    if body.temperature is not None and body.temperature > MAX_TEMPERATURE:
        raise APIError(400, f"invalid temperature: {body.temperature:g} is greater than the maximum of 2",
                       "temperature", "invalid_value")
    if isinstance(body.stop, list) and len(body.stop) > MAX_STOP:
        raise APIError(400, f"invalid stop: {len(body.stop)} stop sequences, at most {MAX_STOP} are allowed",
                       "stop", "invalid_value")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "invalid stream_options: only allowed when stream is true", "stream_options",
                       "invalid_value")


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
    params = sampling(body)
    prompt, extra = chat_prompt(body, served, name)
    params.update(extra, **chat_params(body))
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
