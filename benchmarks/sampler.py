"""The sampler's time for one engine step: `Sampler.sample` on `--batch` rows (32) of fp32 logits of SmolLM2's
vocabulary (49152), for each kind of batch: all greedy, all sampled at a temperature alone, all sampled with top-p,
half and half, and (where this checkout's sampler has them) one row or every row under penalties, each with a
300-token history. Medians over `--rounds` rounds of `--calls` calls each, the kinds alternating in each round.
The last line is one JSON object of milliseconds per call, so benchmarks/ab.py compares two checkouts:

    git archive HEAD~3 | tar -x -C /tmp/old
    python benchmarks/ab.py --old /tmp/old --rounds 3 -- benchmarks/sampler.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import attrs
import torch

from omni_kernel.core.params import ARParams
from omni_qwen.sampling import Sampler, Sampling

VOCAB, HISTORY, PROMPT = 49152, 300, 256


def kinds(batch: int) -> dict[str, list[ARParams]]:
    found = {"greedy": [ARParams()] * batch,
             "temperature": [ARParams(temperature=0.8, seed=i) for i in range(batch)],
             "top_p": [ARParams(temperature=0.8, top_p=0.95, seed=i) for i in range(batch)],
             "half_greedy": [ARParams() if i % 2 else ARParams(temperature=0.8, seed=i) for i in range(batch)]}
    if "repetition_penalty" in attrs.fields_dict(ARParams):
        found["one_penalized"] = [ARParams(repetition_penalty=1.1)] + [ARParams()] * (batch - 1)
        found["all_penalized"] = [ARParams(repetition_penalty=1.1, presence_penalty=0.5) for _ in range(batch)]
    return found


def rows_of(params: list[ARParams]) -> list[Sampling]:
    """Each request's sampling state, with a history where this checkout's sampler reads one (penalties)."""
    if "counts" in attrs.fields_dict(Sampling):
        return [Sampling.of(p, list(range(i, i + HISTORY)), PROMPT) for i, p in enumerate(params)]
    return [Sampling.of(p) for p in params]


def timed(logits: torch.Tensor, rows: list[Sampling], calls: int) -> float:
    sampler = Sampler()
    sampler.sample(logits, rows)
    start = time.perf_counter()
    for _ in range(calls):
        sampler.sample(logits, rows)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logits = torch.randn(args.batch, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    batches = {name: rows_of(params) for name, params in kinds(args.batch).items()}
    times: dict[str, list[float]] = {name: [] for name in batches}
    for _ in range(args.rounds):
        for name, rows in batches.items():
            times[name].append(timed(logits, rows, args.calls))
    figures = {f"{name}_ms": round(statistics.median(values), 3) for name, values in times.items()}
    for name, value in figures.items():
        print(f"{name:20s} {value:9.3f}")
    print(json.dumps({**figures, "batch": args.batch, "threads": args.threads, "load": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
