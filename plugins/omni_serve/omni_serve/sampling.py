"""OpenAI's sampling fields (shared by chats and completions) as the pipeline's declared request parameters, and
what OpenAI refuses of them that omni's node types would take."""

from __future__ import annotations

from typing import Any

from .protocol import NEUTRAL, SERVER_OWNED, APIError, SamplingFields
from .structured import STRUCTURED_FIELDS, structured_params


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
              "stop": body.stop, "ignore_eos": body.ignore_eos, "presence_penalty": body.presence_penalty,
              "frequency_penalty": body.frequency_penalty, "repetition_penalty": body.repetition_penalty,
              "min_p": body.min_p}
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
