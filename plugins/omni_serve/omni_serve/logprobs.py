"""OpenAI's logprobs (docs/serving.md, "Logprobs"): the request fields onto the AR node's request parameters
(`logprobs`, `prompt_logprobs`), and the stage's entries (in OpenAI's chat shape plus `token_id`, on its token
deltas, TokenDelta.logprobs and .prompt_logprobs, and in its output's data) into the chat and completions shapes,
whole or streamed.

An entry: {"token_id", "token", "logprob", "bytes", "top_logprobs": [{"token_id", "token", "logprob", "bytes"}]};
the prompt's first entry has `logprob` None.
"""

from __future__ import annotations

from typing import Any

import attrs

from .protocol import APIError

MAX_TOP = 20  # as vLLM; OpenAI's completions allow 5, its chat 20


def _top(field: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_TOP:
        raise APIError(400, f"invalid {field}: {value} is not in 0..{MAX_TOP}", field, "invalid_value")


def chat_params(body) -> dict[str, Any]:
    """`logprobs: true` and `top_logprobs` (0-20) as the request parameter `logprobs`."""
    _top("top_logprobs", body.top_logprobs)
    if body.top_logprobs and not body.logprobs:  # 0 alone is the neutral value some clients send
        raise APIError(400, "invalid top_logprobs: only allowed when logprobs is true", "top_logprobs",
                       "invalid_value")
    return {"logprobs": body.top_logprobs or 0} if body.logprobs else {}


def completion_params(body, token_ids: bool) -> dict[str, Any]:
    """`logprobs` (0-20) and `echo` as `logprobs` and `prompt_logprobs`. An echoed token-id prompt gets its text
    from its entries, so it asks for them even without `logprobs`."""
    _top("logprobs", body.logprobs)
    params = {} if body.logprobs is None else {"logprobs": body.logprobs}
    if body.echo and (body.logprobs is not None or token_ids):
        params["prompt_logprobs"] = body.logprobs or 0
    return params


def prompt_only(body) -> bool:
    """`echo` with `max_tokens: 0`: the prompt's logprobs alone (one token is generated and left out)."""
    return bool(body.echo) and body.max_tokens == 0


def _one(entry: dict) -> dict:
    return {"token": entry["token"], "logprob": entry["logprob"], "bytes": entry["bytes"]}


def chat_entries(output) -> list:
    """A finished chat's entries: the generated tokens' without the EOS token's (its text is not the message's)."""
    entries = list((output.data or {}).get("logprobs") or [])
    return entries[:-1] if output.stop_reason == "eos" and entries else entries


def chat_content(entries) -> dict:
    """Chat's `choices[].logprobs`."""
    return {"content": [{**_one(e), "top_logprobs": [_one(t) for t in e["top_logprobs"]]} for e in entries],
            "refusal": None}


def completion_logprobs(entries, offset: int = 0) -> dict:
    """Completions' `choices[].logprobs`; `top_logprobs` holds the chosen token too (as vLLM), None for the
    prompt's first token; `text_offset` counts characters from `offset`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        out["tokens"].append(entry["token"])
        out["token_logprobs"].append(entry["logprob"])
        top = None
        if entry["logprob"] is not None:
            top = {t["token"]: t["logprob"] for t in entry["top_logprobs"]}
            top.setdefault(entry["token"], entry["logprob"])
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(entry["token"])
    return out


def prompt_text(entries) -> str:
    """An echoed token-id prompt's text, from its tokens' bytes."""
    return b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8", errors="replace")


@attrs.define
class Echo:
    """What one completions choice echoes and reports: the prompt (text, entries) before the completion."""

    echo: bool
    text: str | None  # the prompt text; None: token ids (their text comes from their entries)
    logprobs: bool  # the request asked for logprobs
    prompt_only: bool

    def whole(self, text: str, data: dict) -> tuple[str, dict | None]:
        """A finished choice's text and `logprobs`."""
        tokens = [] if self.prompt_only else list(data.get("logprobs") or [])
        prompt = list(data.get("prompt_logprobs") or []) if self.echo else []
        head = self.head(prompt)
        text = head + ("" if self.prompt_only else text)
        if not self.logprobs:
            return text, None
        out = completion_logprobs(prompt)
        rest = completion_logprobs(tokens, len(head))
        return text, {k: out[k] + rest[k] for k in out}

    def head(self, prompt: list) -> str:
        if not self.echo:
            return ""
        return self.text if self.text is not None else prompt_text(prompt)


@attrs.define
class StreamedLogprobs:
    """One streamed choice: its echo chunk first, then each delta's entries; what no delta carried (held-back
    text, EOS) comes with the finish chunk."""

    echo: Echo
    sent: int = 0  # generated entries streamed
    offset: int = 0  # characters streamed, for text_offset
    started: bool = False

    def start(self, event=None, data: dict | None = None) -> tuple[str, dict | None] | None:
        """The echo chunk's (text, logprobs), once, when the prompt's entries are known."""
        if self.started:
            return None
        self.started = True
        if not self.echo.echo:
            return None
        streamed = event.prompt_logprobs if event is not None else None
        prompt = list(streamed or (data or {}).get("prompt_logprobs") or [])
        text = self.echo.head(prompt)
        self.offset = len(text)
        return text, completion_logprobs(prompt) if self.echo.logprobs else None

    def delta(self, event) -> dict | None:
        entries = list(event.logprobs or ())
        return self._logprobs(entries, event.text)

    def rest(self, data: dict) -> dict | None:
        return self._logprobs(list(data.get("logprobs") or [])[self.sent:], "")

    def _logprobs(self, entries: list, text: str) -> dict | None:
        self.sent += len(entries)
        out = completion_logprobs(entries, self.offset) if self.echo.logprobs else None
        self.offset += len(text)
        return out
