"""Token sampling for one engine step, batched over its requests.

Greedy rows take one fp32 argmax (as HF's greedy). Sampled rows
apply their own temperature / top-k / top-p together, then draw from each request's own CPU generator, so a
seed reproduces a request's tokens whatever else runs in the same step and whichever device computed the
logits. Every token reaches the host in one transfer.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import attrs
import torch

from omni_kernel.core.errors import InvalidParameter
from omni_kernel.core.params import ARParams


@attrs.frozen(eq=False)
class Sampling:
    """One request's sampling parameters and, unless greedy, its seeded generator."""

    params: ARParams
    generator: torch.Generator | None = None

    @classmethod
    def of(cls, params: ARParams) -> Sampling:
        if params.greedy:
            return cls(params)
        generator = torch.Generator(device="cpu")
        generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        return cls(params, generator)


# A sampled temperature is clamped into this range: below 1e-5 every logit gap a model produces becomes one-hot
# (the draw is the argmax, up to exact ties), above 1e6 the distribution is uniform to fp32 precision; inside
# it, logits / temperature is finite in fp32 for any finite logits.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-5, 1e6


def temperature_of(params: ARParams) -> float:
    return min(max(params.temperature, MIN_TEMPERATURE), MAX_TEMPERATURE)


def probabilities(logits: torch.Tensor, params: Sequence[ARParams]) -> torch.Tensor:
    """Row i's next-token distribution under params[i]: temperature, then top-k, then top-p (fp32, vocab order).
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
        drawn = [i for i, row in enumerate(rows) if row.generator is not None]
        errors: dict[int, Exception] = {}
        if drawn:
            picked = logits[drawn].cpu()
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
