"""Time to first audio of a spoken answer (issue 54): `ar_speech` with its answer streamed into the voice against the
same pipeline chained (the edge not streamed: the voice starts when the whole answer is written), on the real
weights (SmolLM2-135M-Instruct and the Piper voice joe from omni's cache).

Both run on one plugin host, so they share the loaded models and engines; each side is given N requests at once
(submitted to its Omni, stepped until all finish; request i asks prompt i % 8, greedy, its voice seeded with i, so
both sides write the same answers and speak them with the same noise). Figures per side and concurrency: first
audio (from the moment the N requests arrive, before the first submit, to each request's first AudioDelta) and
total time (to its RequestFinished), p50 and p99 over the requests; and for the streamed side the playback gaps: a
request's sound played from its first chunk on, each chunk right after the one before, has a gap where a chunk
arrives after the one before it has finished playing (`gaps`: the requests with one; `gap_s`: their longest
silence). Each round runs both sides, the order reversed every other round (A B, B A, ...); a figure is the median
of the rounds, a ratio (streamed / chained) the median of the per-round ratios.

    .venv/bin/python benchmarks/speech_stream.py [--rounds 2] [--concurrency 1,8,32] [--max-tokens 80] [--threads 2]
        [--compile]

The AR stage runs eager unless `--compile` (omni serve's default where the machine can: the compile takes minutes
on a CPU, and both sides share the one engine either way).

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import attrs

PROMPTS = (
    "Describe the sea in three short sentences.",
    "Give me two tips for sleeping better.",
    "What is a rainbow? Answer in a few sentences.",
    "Tell me about cats, briefly.",
    "Explain what a volcano is in simple words.",
    "Name three fruits and say one thing about each.",
    "Why is exercise good for you? Keep it short.",
    "Describe a sunny morning in a park.",
)


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


@attrs.frozen
class Timing:
    """One request's times (seconds from the arrival of its round's requests) and its sound's playback gaps."""

    first_audio: float
    total: float
    longest_gap: float


def gaps(chunks: list[tuple[float, float]]) -> float:
    """The longest silence in a request's sound played from its first chunk on, each chunk right after the one
    before it: (arrival, seconds) of each chunk."""
    ends, longest = None, 0.0
    for arrival, seconds in chunks:
        if ends is not None and arrival > ends:
            longest = max(longest, arrival - ends)
        ends = max(ends if ends is not None else arrival, arrival) + seconds
    return longest


def run(omni, n: int, max_tokens: int) -> list[Timing]:
    from omni_kernel.events import AudioDelta, RequestFailed, RequestFinished

    start = time.perf_counter()
    ids = [omni.submit(omni.request(PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, temperature=0, seed=i))
           for i in range(n)]
    chunks: dict[str, list[tuple[float, float]]] = {rid: [] for rid in ids}
    done: dict[str, float] = {}
    while len(done) < n:
        for event in omni.step():
            now = time.perf_counter() - start
            if isinstance(event, AudioDelta) and event.node_id == "speak":
                chunks[event.request_id].append((now, len(event.pcm) / 2 / event.sample_rate))
            elif isinstance(event, RequestFinished):
                done[event.request_id] = now
            elif isinstance(event, RequestFailed):
                raise RuntimeError(f"{event.request_id} failed: {event.error}")
    return [Timing(chunks[rid][0][0], done[rid], gaps(chunks[rid])) for rid in ids]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(timings: list[Timing]) -> dict[str, float]:
    first, total = [t.first_audio for t in timings], [t.total for t in timings]
    return {"first_audio_p50": percentile(first, 0.5), "first_audio_p99": percentile(first, 0.99),
            "total_p50": percentile(total, 0.5), "total_p99": percentile(total, 0.99),
            "gaps": sum(t.longest_gap > 0 for t in timings), "gap_s": max(t.longest_gap for t in timings)}


def omnis(max_batch: int, compile_ar: bool):
    from omni_kernel import Omni
    from omni_kernel.core.planner import Planner
    from omni_kernel.plugins import load_host
    from omni_qwen.registry_model import cached as qwen_cached
    from omni_speech import weights

    ar, voice = qwen_cached(), weights.cached(weights.VOICE)
    if ar is None or voice is None:
        sys.exit("the real SmolLM2 and the Piper voice are needed in omni's cache: `make models` fetches them")
    host = load_host()
    streamed = Planner(host.registry).plan("ar_speech")
    chained = attrs.evolve(streamed, name="ar_speech_chained",
                           edges=[attrs.evolve(e, stream=False) for e in streamed.edges])
    config = {"ar_model": str(ar), "tts_model": str(voice), "tts_max_batch": max_batch, "ar_compile": compile_ar}
    return {"streamed": Omni(streamed, host=host, **config), "chained": Omni(chained, host=host, **config)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="compile the AR stage's decode step")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    sides = omnis(max(levels), args.compile)
    for omni in sides.values():  # warm-up: the models load, the first steps pay their one-time costs
        run(omni, 1, 16)
    results = {}
    for n in levels:
        rounds = []
        for r in range(args.rounds):
            order = ["streamed", "chained"] if r % 2 == 0 else ["chained", "streamed"]
            got = {side: summary(run(sides[side], n, args.max_tokens)) for side in order}
            say(f"n={n} round {r}: " + "; ".join(f"{s} first audio p50 {got[s]['first_audio_p50']:.2f} s, total p50 "
                                                   f"{got[s]['total_p50']:.2f} s" for s in order))
            rounds.append(got)
        results[n] = {side: {k: statistics.median(g[side][k] for g in rounds) for k in rounds[0][side]}
                      for side in sides}
        results[n]["first_audio_p50_ratio"] = statistics.median(
            g["streamed"]["first_audio_p50"] / g["chained"]["first_audio_p50"] for g in rounds)
    for n, row in results.items():
        s, c = row["streamed"], row["chained"]
        say(f"n={n:>2}: first audio p50/p99 streamed {s['first_audio_p50']:.2f}/{s['first_audio_p99']:.2f} s, "
            f"chained {c['first_audio_p50']:.2f}/{c['first_audio_p99']:.2f} s "
            f"(ratio {row['first_audio_p50_ratio']:.2f}); "
            f"total p50/p99 streamed {s['total_p50']:.2f}/{s['total_p99']:.2f} s, chained "
            f"{c['total_p50']:.2f}/{c['total_p99']:.2f} s; streamed gaps {s['gaps']:.0f} of {n} (longest "
            f"{s['gap_s']:.2f} s)")
    print(json.dumps({"rounds": args.rounds, "max_tokens": args.max_tokens, "threads": args.threads,
                      "compile": args.compile,
                      "results": results}))


if __name__ == "__main__":
    main()
