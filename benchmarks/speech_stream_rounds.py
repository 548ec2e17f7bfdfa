"""Where a spoken answer's rounds go (the bound behind benchmarks/speech_stream.py's gaps): 8 `ar_speech` requests
at once, chained and streamed alternately, each StageScheduler round (`Omni.step`) timed and sorted by what it
stepped: the AR stage alone (tokens, no sound), the AR stage and the voice (both), the voice alone.

    .venv/bin/python benchmarks/speech_stream_rounds.py [--requests 8] [--max-tokens 60] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import speech_stream


def rounds_of(omni, n: int, max_tokens: int) -> dict[str, list[float]]:
    from omni_kernel.events import AudioDelta, RequestFinished, TokenDelta

    for i in range(n):
        omni.submit(omni.request(speech_stream.PROMPTS[i % len(speech_stream.PROMPTS)], max_tokens=max_tokens,
                                 temperature=0, seed=i))
    kinds: dict[str, list[float]] = {"AR only": [], "AR + voice": [], "voice only": []}
    finished = 0
    while finished < n:
        start = time.perf_counter()
        events = omni.step()
        seconds = time.perf_counter() - start
        wrote = any(isinstance(e, TokenDelta) for e in events)
        spoke = any(isinstance(e, AudioDelta) for e in events)
        if wrote or spoke:
            kinds["AR + voice" if wrote and spoke else "AR only" if wrote else "voice only"].append(seconds)
        finished += sum(isinstance(e, RequestFinished) for e in events)
    return kinds


def describe(seconds: list[float]) -> str:
    if not seconds:
        return "0 rounds"
    return f"{len(seconds)} rounds, median {statistics.median(seconds) * 1000:.0f} ms, sum {sum(seconds):.2f} s"


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sides = speech_stream.omnis(args.requests, compile_ar=False)
    for _ in range(args.rounds):
        for name in ("chained", "streamed"):
            kinds = rounds_of(sides[name], args.requests, args.max_tokens)
            total = sum(sum(seconds) for seconds in kinds.values())
            print(f"{name}: {total:.2f} s of rounds | " + " | ".join(f"{k}: {describe(v)}" for k, v in kinds.items()),
                  flush=True)


if __name__ == "__main__":
    main()
