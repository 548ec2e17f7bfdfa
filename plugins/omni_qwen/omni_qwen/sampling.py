"""Token sampling for one engine step, batched over its requests.

Rows with penalties first get them on their own copy of their logits: repetition_penalty over the prompt's and
output's tokens, then frequency_penalty and presence_penalty over the output's, in vLLM's order. Greedy rows take
one fp32 argmax (as HF's greedy, of the penalized logits where a row has penalties). Sampled rows apply their own
temperature / top-k / top-p / min-p together, then draw from each request's own CPU generator, so a seed
reproduces a request's tokens whatever else runs in the same step and whichever device computed the logits. Every
token reaches the host in one transfer. Rows without penalties pay nothing for them.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import attrs
import torch

from omni_kernel.core.errors import InvalidParameter
from omni_kernel.core.params import ARParams


@attrs.define(eq=False)
class TokenCounts:
    """What the penalties of one request read of its tokens: which ones its prompt or output holds
    (repetition_penalty) and how many times its output holds each (presence and frequency penalties). `tokens` is
    the request's list of prompt + output tokens that the scheduler appends to (ARSequence.token_ids, not a copy);
    each step counts only the tokens appended since the last."""

    tokens: Sequence[int]
    num_prompt: int
    counted: int = 0
    seen: torch.Tensor | None = None  # [vocab] bool: in the prompt or the output
    output: torch.Tensor | None = None  # [vocab] fp32: times in the output

    def update(self, vocab: int, device: torch.device) -> None:
        if self.seen is None:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.output = torch.zeros(vocab, dtype=torch.float32, device=device)
        end = len(self.tokens)
        if end == self.counted:
            return
        new = torch.tensor(self.tokens[self.counted:end], dtype=torch.long, device=device)
        self.seen[new] = True
        generated = new[max(self.num_prompt - self.counted, 0):]
        self.output.index_put_((generated,), torch.ones(len(generated), device=device), accumulate=True)
        self.counted = end


@attrs.frozen(eq=False)
class Sampling:
    """One request's sampling parameters, unless greedy its seeded generator, and, when it has penalties, the
    counts of its tokens that they read."""

    params: ARParams
    generator: torch.Generator | None = None
    counts: TokenCounts | None = None

    @classmethod
    def of(cls, params: ARParams, tokens: Sequence[int] = (), num_prompt: int | None = None) -> Sampling:
        """`tokens`: the request's prompt + output so far, as the list that grows with it (penalties read it);
        the first `num_prompt` (default: all given now) are its prompt."""
        counts = None
        if params.penalized:
            counts = TokenCounts(tokens, len(tokens) if num_prompt is None else num_prompt)
        if params.greedy:
            return cls(params, None, counts)
        generator = torch.Generator(device="cpu")
        generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        return cls(params, generator, counts)


# A sampled temperature is clamped into this range: below 1e-5 every logit gap a model produces becomes one-hot
# (the draw is the argmax, up to exact ties), above 1e6 the distribution is uniform to fp32 precision; inside
# it, logits / temperature is finite in fp32 for any finite logits.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-5, 1e6


def temperature_of(params: ARParams) -> float:
    return min(max(params.temperature, MIN_TEMPERATURE), MAX_TEMPERATURE)


# A repetition penalty is clamped into this range too: beyond it a real model's logit gaps are decided as at its
# limit (a repeated token with a positive logit always wins, or one with a negative logit never does), and inside
# it a penalized logit stays finite in fp32.
MIN_REPETITION, MAX_REPETITION = 1e-5, 1e6


def penalize(logits: torch.Tensor, rows: Sequence[Sampling]) -> torch.Tensor:
    """Rows of logits (fp32; rows[i], a request with penalties, is row i's) under their penalties, as vLLM applies
    them: repetition_penalty (HF's RepetitionPenaltyLogitsProcessor: the logit of a token of the prompt or the
    output is divided by it when positive, multiplied by it otherwise), then frequency_penalty times the token's
    count in the output and presence_penalty once for a token in the output (OpenAI's definition), subtracted."""
    vocab, device = logits.shape[-1], logits.device
    for row in rows:
        row.counts.update(vocab, device)
    seen = torch.stack([row.counts.seen for row in rows])
    output = torch.stack([row.counts.output for row in rows])
    repetition = _column([min(max(row.params.repetition_penalty, MIN_REPETITION), MAX_REPETITION) for row in rows],
                         device)
    logits = torch.where(seen, torch.where(logits < 0, logits * repetition, logits / repetition), logits)
    frequency = _column([row.params.frequency_penalty for row in rows], device)
    presence = _column([row.params.presence_penalty for row in rows], device)
    return logits - output * frequency - (output > 0) * presence


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def probabilities(logits: torch.Tensor, params: Sequence[ARParams]) -> torch.Tensor:
    """Row i's next-token distribution under params[i]: temperature, then top-k, then top-p, then min-p (fp32, vocab
    order).
    For finite logits and validated params no value is NaN or inf: the row's maximum is subtracted first, the
    temperature is clamped (MIN_TEMPERATURE..MAX_TEMPERATURE) and the best token always stays."""
    vocab = logits.shape[-1]
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / torch.tensor([[temperature_of(p)] for p in params])
    ranked, order = logits.sort(dim=-1, descending=True)
    top_k = torch.tensor([[p.top_k if 0 < p.top_k < vocab else vocab] for p in params])
    ranked = ranked.masked_fill(ranked < ranked.gather(1, top_k - 1), float("-inf"))
    probs = ranked.softmax(dim=-1)
    # Drop a token when the ones ranked above it already reach top_p (a top_p that rounds to 0 in fp32 too).
    top_p = torch.tensor([[p.top_p if p.top_p < 1 else float("inf")] for p in params])
    drop = probs.cumsum(dim=-1) - probs >= top_p
    min_p = [p.min_p for p in params]
    if any(min_p):  # a token less likely than min_p times the best one (HF's MinPLogitsWarper, after top-p)
        drop |= probs < torch.tensor(min_p)[:, None] * probs[:, :1]
    drop[:, 0] = False
    ranked = ranked.masked_fill(drop, float("-inf"))
    return torch.empty_like(ranked).scatter_(1, order, ranked).softmax(dim=-1)


class Sampler:
    def sample(self, logits: torch.Tensor, rows: Sequence[Sampling]) -> list[int | Exception]:
        """A token per logits row, or the exception of a row that cannot be sampled (it fails alone)."""
        if not rows:
            return []
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        penalized = [i for i, row in enumerate(rows) if row.counts is not None]
        scores = {}  # row -> its penalized logits
        if penalized:
            adjusted = penalize(logits[penalized], [rows[i] for i in penalized])
            tokens[penalized] = adjusted.argmax(dim=-1)
            scores = dict(zip(penalized, adjusted))
        drawn = [i for i, row in enumerate(rows) if row.generator is not None]
        errors: dict[int, Exception] = {}
        if drawn:
            picked = logits[drawn].cpu()
            for j, i in enumerate(drawn):
                if i in scores:
                    picked[j] = scores[i].cpu()
            probs = probabilities(picked, [rows[i].params for i in drawn])
            draws = torch.zeros(len(drawn), dtype=torch.long)
            for j, i in enumerate(drawn):
                try:
                    draws[j] = torch.multinomial(probs[j], 1, generator=rows[i].generator)[0]
                except RuntimeError as exc:
                    errors[i] = _sampling_error(picked[j], rows[i].params, exc)
            tokens[drawn] = draws.to(tokens.device)
        return [errors.get(i, token) for i, token in enumerate(tokens.tolist())]


def _sampling_error(logits: torch.Tensor, params: ARParams, exc: RuntimeError) -> Exception:
    if torch.isfinite(logits).all():
        return InvalidParameter("temperature", f"{params.temperature!r} leaves no valid distribution to sample "
                                               "from (use 0 for greedy)")
    return RuntimeError(f"the model's logits hold NaN or inf, so this request cannot be sampled "
                        f"({' '.join(str(exc).split())})")
