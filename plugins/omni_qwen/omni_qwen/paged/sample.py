"""Token choice for the paged executor: greedy, or temperature / top-k / top-p with a per-request generator
that advances only when a new token is drawn (so recompute after preemption draws the same tokens)."""

from __future__ import annotations

import torch


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def choose(logits: torch.Tensor, params, generator: torch.Generator | None) -> int:
    """Pick one token id from a (vocab,) fp32 row."""
    if params is None or params.temperature == 0:
        return int(logits.argmax())
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        ordered, order = logits.sort(descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) > params.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
