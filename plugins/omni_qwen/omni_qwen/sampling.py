"""Token sampling for one engine step, batched over its requests.

Rows with penalties first get them on their own copy of their logits: repetition_penalty over the prompt's and
output's tokens, then frequency_penalty and presence_penalty over the output's, in vLLM's order. Greedy rows take
one fp32 argmax (as HF's greedy, of the penalized logits where a row has penalties). Sampled rows apply their own
temperature / top-k / top-p / min-p together, then draw from each request's own CPU generator, so a seed
reproduces a request's tokens whatever else runs in the same step and whichever device computed the logits. Every
token reaches the host in one transfer. Rows without penalties pay nothing for them.
"""

from __future__ import annotations

import collections
import secrets
from collections.abc import Sequence

import attrs
import torch

from omni_kernel.core.errors import InvalidParameter
from omni_kernel.core.params import ARParams


def _longs() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.long)


@attrs.define(eq=False)
class TokenCounts:
    """What the penalties of one request read of its tokens, kept sparse: the distinct tokens of its prompt and
    output (repetition_penalty) and the distinct tokens of its output with their counts (presence and frequency
    penalties). `tokens` is the request's list of prompt + output tokens that the scheduler appends to
    (ARSequence.token_ids, not a copy); each step adds only the tokens appended since the last."""

    tokens: Sequence[int]
    num_prompt: int
    counted: int = 0
    seen: set[int] = attrs.Factory(set)
    seen_ids: torch.Tensor = attrs.Factory(_longs)  # the distinct tokens of the prompt and output
    place: dict[int, int] = attrs.Factory(dict)  # an output token -> its place in output_ids and output_counts
    output_ids: torch.Tensor = attrs.Factory(_longs)
    output_counts: torch.Tensor = attrs.Factory(lambda: torch.zeros(0))

    def update(self) -> None:
        end = len(self.tokens)
        if end == self.counted:
            return
        new = self.tokens[self.counted:end]
        fresh = [t for t in dict.fromkeys(new) if t not in self.seen]
        if fresh:
            self.seen.update(fresh)
            self.seen_ids = torch.cat([self.seen_ids, torch.tensor(fresh, dtype=torch.long)])
        generated = collections.Counter(new[max(self.num_prompt - self.counted, 0):])
        known = [t for t in generated if t in self.place]
        if known:
            self.output_counts.index_add_(0, torch.tensor([self.place[t] for t in known]),
                                          torch.tensor([float(generated[t]) for t in known]))
        first = [t for t in generated if t not in self.place]
        if first:
            self.place.update(zip(first, range(len(self.place), len(self.place) + len(first))))
            self.output_ids = torch.cat([self.output_ids, torch.tensor(first, dtype=torch.long)])
            self.output_counts = torch.cat([self.output_counts, torch.tensor([float(generated[t]) for t in first])])
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


def penalize(logits: torch.Tensor, index: Sequence[int], rows: Sequence[Sampling]) -> torch.Tensor:
    """Rows `index` of logits (fp32; rows[j], a request with penalties, is row index[j]'s) under their penalties,
    as a new tensor, as vLLM applies them: repetition_penalty (HF's RepetitionPenaltyLogitsProcessor: the logit of
    a token of the prompt or the output is divided by it when positive, multiplied by it otherwise), then
    frequency_penalty times the token's count in the output and presence_penalty once for a token in the output
    (OpenAI's definition), subtracted. Only the logits of the requests' own tokens are read and written."""
    scores = logits[list(index)]
    for row in rows:
        row.counts.update()
    flat, vocab, device = scores.view(-1), scores.shape[-1], scores.device
    seen = _flat([row.counts.seen_ids for row in rows], vocab, device)
    repetition = _per_token([min(max(row.params.repetition_penalty, MIN_REPETITION), MAX_REPETITION) for row in rows],
                            [row.counts.seen_ids for row in rows], device)
    values = flat[seen]
    flat[seen] = torch.where(values < 0, values * repetition, values / repetition)
    output = _flat([row.counts.output_ids for row in rows], vocab, device)
    counts = torch.cat([row.counts.output_counts for row in rows]).to(device)
    ids = [row.counts.output_ids for row in rows]
    frequency = _per_token([row.params.frequency_penalty for row in rows], ids, device)
    presence = _per_token([row.params.presence_penalty for row in rows], ids, device)
    flat[output] = flat[output] - frequency * counts - presence
    return scores


def _flat(ids: Sequence[torch.Tensor], vocab: int, device: torch.device) -> torch.Tensor:
    """Each row's token ids as indices into the rows' flattened logits."""
    return torch.cat([row_ids + j * vocab for j, row_ids in enumerate(ids)]).to(device)


def _per_token(values: Sequence[float], ids: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Each row's value, once for each of its token ids."""
    return torch.tensor(values).repeat_interleave(torch.tensor([len(row_ids) for row_ids in ids])).to(device)


def probabilities(logits: torch.Tensor, params: Sequence[ARParams]) -> torch.Tensor:
    """Row i's next-token distribution under params[i]: temperature, then top-k, then top-p, then min-p (fp32, vocab
    order). For finite logits and validated params no value is NaN or inf: the row's maximum is subtracted first,
    the temperature is clamped (MIN_TEMPERATURE..MAX_TEMPERATURE) and the best token always stays."""
    vocab = logits.shape[-1]
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / torch.tensor([[temperature_of(p)] for p in params])
    # Only the rows that cut their distribution sort the vocabulary (the sort costs far more than the softmax).
    cut = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0]
    if cut:
        logits[cut] = _cut(logits[cut], [params[i] for i in cut])
    return logits.softmax(dim=-1)


def _cut(logits: torch.Tensor, params: Sequence[ARParams]) -> torch.Tensor:
    """The rows' logits (over temperature) with -inf where top-k, top-p or min-p drop a token."""
    vocab = logits.shape[-1]
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
    return torch.empty_like(ranked).scatter_(1, order, ranked)


class Sampler:
    def sample(self, logits: torch.Tensor, rows: Sequence[Sampling]) -> list[int | Exception]:
        """A token per logits row, or the exception of a row that cannot be sampled (it fails alone)."""
        if not rows:
            return []
        tokens = _argmax(logits)  # in the model's dtype: widening to fp32 is exact, so the same first maximum
        if any(row.counts is not None or row.generator is not None for row in rows):
            logits = logits.float()  # penalties and draws work in fp32; greedy rows alone need no fp32 copy
        penalized = [i for i, row in enumerate(rows) if row.counts is not None]
        scores = {}  # row -> its penalized logits
        if penalized:
            adjusted = penalize(logits, penalized, [rows[i] for i in penalized])
            tokens[penalized] = _argmax(adjusted)
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


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    # max's indices are argmax's (the first maximum; a NaN counts as one) at about a third of its time on a CPU
    return logits.max(dim=-1).indices


def _sampling_error(logits: torch.Tensor, params: ARParams, exc: RuntimeError) -> Exception:
    if torch.isfinite(logits).all():
        return InvalidParameter("temperature", f"{params.temperature!r} leaves no valid distribution to sample "
                                               "from (use 0 for greedy)")
    return RuntimeError(f"the model's logits hold NaN or inf, so this request cannot be sampled "
                        f"({' '.join(str(exc).split())})")
