"""Logprobs of an AR stage (docs/qwen.md, "Logprobs"): the log-softmax of the model's raw logits (before
temperature, top-k and top-p), for the generated tokens (`logprobs`) and the prompt's (`prompt_logprobs`).

The runner computes them in its step for the rows of the requests that asked, into each one's StepLogprobs in its
record (ARRunnerState.logprobs); the output processor that gets the record's output takes them (stages of several
pipelines may share one engine), turns them into text (TokenTexts) and carries them on TokenDelta events (`logprobs`,
`prompt_logprobs`) and in the StageOutput's data. Requests that did not ask pay nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from omni_kernel.core.ar_scheduler import ARSchedulerOutput, ARSequence
from omni_kernel.events import TokenDelta


@attrs.frozen
class Logprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # best first


def asked(seq: ARSequence, name: str) -> int | None:
    return getattr(seq.item.params, name, None)


def _entries(logprobs: torch.Tensor, targets: Sequence[int], tops: Sequence[int]) -> list[Logprob]:
    """Row i's logprob of targets[i] and its tops[i] best tokens; one transfer of each."""
    chosen = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])[:, 0].tolist()
    k = max(tops)
    values, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    values, ids = values.tolist(), ids.tolist()
    return [Logprob(t, c, tuple(zip(i[:n], v[:n]))) for t, c, i, v, n in zip(targets, chosen, ids, values, tops)]


@attrs.define
class StepLogprobs:
    """What the runner's steps computed of one request's logprobs (ARRunnerState.logprobs), until the output
    processor that gets its output takes them."""

    tokens: list[Logprob] = attrs.Factory(list)  # of its sampled tokens not yet taken
    prompt: tuple[Logprob | None, ...] | None = None  # its prompt's entries, once complete
    partial: list[Logprob | None] | None = None  # those of a prompt being prefilled

    def take_tokens(self) -> list[Logprob]:
        tokens, self.tokens = self.tokens, []
        return tokens

    def take_prompt(self) -> tuple[Logprob | None, ...] | None:
        prompt, self.prompt = self.prompt, None
        return prompt


def wanted(params) -> StepLogprobs | None:
    """A new request's StepLogprobs, None unless it asked for logprobs or prompt logprobs."""
    if getattr(params, "logprobs", None) is None and getattr(params, "prompt_logprobs", None) is None:
        return None
    return StepLogprobs()


def every_row(batch: ARSchedulerOutput) -> frozenset[str]:
    """Requests whose chunk this step needs logits at every row: prompt positions not yet delivered."""
    return frozenset(c.request_id for c, seq in zip(batch.chunks, batch.records)
                     if asked(seq, "prompt_logprobs") is not None
                     and seq.num_output == 0 and c.start < seq.num_prompt - 1)


def raw(logits: torch.Tensor, rows: Sequence[ARSequence]) -> tuple[list[int], torch.Tensor | None]:
    """The logits rows (rows[i]: row i's request) that asked and their log-softmax, taken before sampling can change
    the logits."""
    asking = [i for i, seq in enumerate(rows) if asked(seq, "logprobs") is not None]
    return asking, logits[asking].float().log_softmax(dim=-1) if asking else None


def write(batch: ARSchedulerOutput, rows: Sequence[ARSequence], found_raw, tokens: Sequence,
          every: dict[str, torch.Tensor]) -> None:
    """Each asking request's entries of this step into its StepLogprobs: its sampled token's (from `raw`) and its
    prompt's (from `every`, the logits of every row of its chunk)."""
    asking, logprobs = found_raw
    keep = [j for j, i in enumerate(asking) if isinstance(tokens[i], int)]  # a failed row has none
    if keep:
        picked = [rows[asking[j]] for j in keep]
        found = _entries(logprobs[keep], [tokens[asking[j]] for j in keep], [asked(s, "logprobs") for s in picked])
        for seq, entry in zip(picked, found):
            seq.state.logprobs.tokens.append(entry)
    for chunk, seq in zip(batch.chunks, batch.records):
        computed = seq.state.logprobs
        if computed is None:
            continue
        if chunk.request_id in every:
            _prompt(seq, chunk.start, every[chunk.request_id])
        if chunk.samples and computed.partial is not None:
            computed.prompt, computed.partial = tuple(computed.partial), None


def _prompt(seq: ARSequence, start: int, logits: torch.Tensor) -> None:
    """Row j predicts position start + j + 1: the prompt's own tokens only (a recompute may hold more)."""
    computed = seq.state.logprobs
    if computed.partial is None:
        computed.partial = [None] * seq.num_prompt
    count = min(logits.shape[0], seq.num_prompt - 1 - start)
    if count > 0:
        targets = seq.token_ids[start + 1:start + 1 + count]
        found = _entries(logits[:count].float().log_softmax(dim=-1), targets, [asked(seq, "prompt_logprobs")] * count)
        computed.partial[start + 1:start + 1 + count] = found


def _byte_table() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character of each byte (GPT-2's scheme), reversed."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class TokenTexts:
    """A token id's text and exact bytes (a byte-level BPE token may hold part of a character: its text then
    has U+FFFD where its bytes are incomplete); added tokens as written. Cached per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.bytes_of = _byte_table() if type(decoder).__name__ == "ByteLevel" else None
        self.added = set(tokenizer.get_added_vocab())
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self.cache.get(token_id)
        if found is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""  # None: an id past the tokenizer's vocab
            if self.bytes_of is not None and piece not in self.added and all(c in self.bytes_of for c in piece):
                raw = bytes(self.bytes_of[c] for c in piece)
                found = raw.decode("utf-8", errors="replace"), list(raw)
            else:
                text = piece if piece in self.added else self.tokenizer.decode([token_id])
                found = text, list(text.encode("utf-8"))
            self.cache[token_id] = found
        return found

    def entry(self, lp: Logprob) -> dict[str, Any]:
        """OpenAI's chat shape of one token (plus `token_id`), as omni_serve reads it."""
        return {**self.one(lp.token, lp.logprob), "top_logprobs": [self.one(t, v) for t, v in lp.top]}

    def one(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        text, raw = self(token_id)
        return {"token_id": token_id, "token": text, "logprob": logprob, "bytes": raw}


@attrs.define
class RequestLogprobs:
    """The output processor's logprobs of one request (RequestText.logprobs)."""

    tokens: list[dict] = attrs.Factory(list)  # every sampled token's entry (EOS included)
    sent: int = 0  # entries already carried on a delta
    prompt: tuple[dict, ...] | None = None
    prompt_sent: bool = False


class LogprobsOutput:
    """The output processor's side: the entries the runner computed for a request (its StepLogprobs) into text, onto
    deltas and the final data."""

    def __init__(self, texts: TokenTexts):
        self.texts = texts

    def start(self, seq: ARSequence) -> RequestLogprobs | None:
        if asked(seq, "logprobs") is None and asked(seq, "prompt_logprobs") is None:
            return None
        return RequestLogprobs()

    def take(self, req: RequestLogprobs, seq: ARSequence) -> None:
        computed = seq.state.logprobs
        req.tokens.extend(self.texts.entry(found) for found in computed.take_tokens())
        prompt = computed.take_prompt()
        if prompt is not None and req.prompt is None:  # the first token has no logprob, but has its text
            first = {**self.texts.one(seq.token_ids[0], None), "top_logprobs": []}
            req.prompt = (first, *(self.texts.entry(p) for p in prompt[1:]))

    def delta(self, req: RequestLogprobs, request_id: str, node_id: str, text: str, eos: bool = False
              ) -> TokenDelta:
        """`eos`: the last entry is the EOS token's, whose text is not in the output: it stays in the data only."""
        prompt = None if req.prompt_sent else req.prompt
        req.prompt_sent = req.prompt_sent or prompt is not None
        end = max(req.sent, len(req.tokens) - eos)
        tokens, req.sent = tuple(req.tokens[req.sent:end]), end
        return TokenDelta(request_id, node_id, text, logprobs=tokens, prompt_logprobs=prompt)

    @staticmethod
    def data(req: RequestLogprobs | None) -> dict[str, Any]:
        if req is None:
            return {}
        return {"logprobs": list(req.tokens), "prompt_logprobs": None if req.prompt is None else list(req.prompt)}
