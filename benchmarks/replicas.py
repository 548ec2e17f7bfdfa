"""Benchmark (not in CI): two replicas of the Wan stage, one thread each, against one replica at two threads.

A burst of text-to-video requests (different prompts and seeds, all sent at once) goes to `wan_t2v` on a locally
built random-weight checkpoint (benchmarks/wan_i2v.py's transformer), served two ways side by side:

- replicas: `placement="process", replicas="wan=2", worker_threads=1`: two workers, each with its own copy of the
  model and one torch thread; each request goes to the one with less outstanding work;
- one: `placement="process", worker_threads=2`: one worker, one copy, the burst batched in it on two threads.

Both are built once and kept loaded; rounds alternate their order (A B, B A, ...). `ratio` is the median over
rounds of one's burst time over the replicas' (above 1: replicas are faster). The bound: two threads speed one
request up by `thread_speedup` (its time on one replica at one thread over its time on the one at two); two
copies at one thread each can at best do twice a one-thread copy's work, so replicas can beat one copy at two
threads by at most `2 / thread_speedup` (`ratio_bound`), and by less where a batched forward costs less per
request than two lone ones (the one replica batches the burst; each replica batches only its half).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/replicas.py [--requests N] [--steps N] [--rounds N] [--quick]
        [--device cuda]

With `--device cuda`, give the front `CUDA_VISIBLE_DEVICES=0,1`: each replica then has a GPU of its own and the
one-copy side runs on the first. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from wan_i2v import BENCH_DIMS  # noqa: E402 - the same checkpoint as the wan_i2v benchmark

PROMPTS = ["a cat surfing on a blue wave at sunset", "a red fox running through fresh snow",
           "a paper boat drifting down a rainy street", "a hot air balloon over green hills",
           "a lighthouse in a storm at night", "a hummingbird hovering near a flower",
           "a train crossing a stone bridge in autumn", "a robot watering plants in a greenhouse"]


def burst(omni, n: int, params: dict, out: Path) -> float:
    """Seconds from sending `n` requests at once to the last one's end; every one must finish."""
    from omni_kernel import RequestFinished
    from omni_kernel.testing import drain

    start = time.perf_counter()
    ids = [omni.submit(omni.request(PROMPTS[i % len(PROMPTS)], seed=i, output=str(out / f"{i}.mp4"), **params))
           for i in range(n)]
    finished = {e.request_id for e in drain(omni, None) if isinstance(e, RequestFinished)}
    elapsed = time.perf_counter() - start
    if finished != set(ids):
        raise SystemExit(f"{len(set(ids) - finished)} of {n} requests did not finish")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--num-frames", type=int, default=17)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4, help="rounds, alternating which side goes first")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--quick", action="store_true", help="4 requests, 6 steps, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.steps, args.rounds = 4, 6, 2

    from omni_kernel import Omni
    from omni_kernel.plugins import load_host
    from omni_wan.demo import build_tiny_checkpoint

    params = {"height": args.height, "width": args.width, "num_frames": args.num_frames,
              "num_inference_steps": args.steps, "preset": "smoke"}
    with tempfile.TemporaryDirectory(prefix="omni-replicas-") as tmp:
        work = Path(tmp)
        model = build_tiny_checkpoint(work / "model", dims=BENCH_DIMS)
        host = load_host()
        config = {"model": str(model), "device": args.device, "placement": "process"}
        sides = {"replicas": Omni("wan_t2v", host=host, **config, replicas="wan=2", worker_threads=1),
                 "one": Omni("wan_t2v", host=host, **config, worker_threads=2)}
        try:
            for name, omni in sides.items():  # warm-up: first forwards, the prepare cache's text encoder
                burst(omni, 2, params, work)
                print(f"{name}: warmed up", file=sys.stderr, flush=True)
            lone = {name: burst(omni, 1, params, work) for name, omni in sides.items()}
            times: dict[str, list[float]] = {name: [] for name in sides}
            for i in range(args.rounds):
                for name in ("replicas", "one") if i % 2 == 0 else ("one", "replicas"):
                    times[name].append(burst(sides[name], args.requests, params, work))
                print(f"round {i}: replicas {times['replicas'][-1]:.2f} s, one {times['one'][-1]:.2f} s",
                      file=sys.stderr, flush=True)
        finally:
            for omni in sides.values():
                omni.close()
    ratios = [one / rep for one, rep in zip(times["one"], times["replicas"])]
    speedup = lone["replicas"] / lone["one"]
    print(json.dumps({
        "requests": args.requests, "steps": args.steps, "size": f"{args.height}x{args.width}x{args.num_frames}",
        "device": args.device, "rounds": args.rounds,
        "replicas_s": [round(t, 3) for t in times["replicas"]], "one_s": [round(t, 3) for t in times["one"]],
        "ratio": round(statistics.median(ratios), 3), "ratios": [round(r, 3) for r in ratios],
        "lone_request_s": {k: round(v, 3) for k, v in lone.items()}, "thread_speedup": round(speedup, 3),
        "ratio_bound": round(2 / speedup, 3)}))


if __name__ == "__main__":
    main()
