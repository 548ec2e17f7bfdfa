"""Per-request token sampling: greedy by default; temperature / top-k / top-p with a seeded generator."""

from __future__ import annotations

import secrets

import torch

from omni_kernel.params import ARParams


class Sampler:
    """Samples one request's tokens. Draws come from its own CPU generator, so a seed reproduces them
    whatever else runs in the same step and whichever device computed the logits."""

    def __init__(self, params: ARParams):
        self.params = params
        self.seed = None
        self.generator = None
        if not params.greedy:
            self.seed = params.seed if params.seed is not None else secrets.randbits(63)
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(self.seed)

    def sample(self, logits: torch.Tensor) -> int:
        if self.generator is None:
            return int(torch.argmax(logits.float()).item())  # as HF's greedy; fp32 argmax is also 3x faster on CPU
        probs = self.probabilities(logits.float().cpu())
        return int(torch.multinomial(probs, 1, generator=self.generator).item())

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            # Drop a token when the ones ranked above it already reach top_p; the best token always stays.
            drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= p.top_p
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        return torch.softmax(logits, dim=-1)
