"""Benchmark (not in CI): Wan over two devices' worth of compute: replicas and the Ulysses-parallel stage against
one copy of the stage at two threads.

Text-to-video requests (different prompts and seeds) go to `wan_t2v` on a locally built random-weight checkpoint
(benchmarks/wan_i2v.py's transformer), every side in worker processes (`placement="process"`), built once, kept
loaded:

- one: `worker_threads=2`: one worker, one copy of the model, its forwards on two threads (the baseline);
- replicas: `replicas="wan=2", worker_threads=1`: two workers, a copy each, one thread each; each request goes to
  the one with less outstanding work;
- ulysses2: `wan_ulysses=2, worker_threads=1`: one stage over two ranks (rank 0 in the worker, rank 1 started by
  it), one thread each, every forward split by sequence over both.

Throughput: a burst (all sent at once) on replicas and on one, rounds alternating their order (A B, B A, ...);
`ratio` is the median over rounds of one's burst time over the replicas'. Latency: one request alone on each of
the three, alternating too; `ulysses_latency_ratio` is the median of one's time over ulysses2's. The bound: two
threads speed one request up by `thread_speedup` (its time on a one-thread replica over its time on one at two
threads); two one-thread copies can at best do twice a one-thread copy's work, so replicas can beat one copy at
two threads by at most `2 / thread_speedup` (`ratio_bound`), less where a batched forward costs less per request
than two lone ones (one batches the whole burst, each replica its half); ulysses2 likewise at most
`2 / thread_speedup` on latency, less its all-to-all and gathers.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/wan_devices.py [--requests N] [--steps N] [--rounds N] [--quick]
        [--device cuda]

With `--device cuda --no-offload` (the parallel stage keeps the transformer on its GPUs), give the front
`CUDA_VISIBLE_DEVICES=0,1`: each replica then has a GPU of its own, the ulysses2 ranks take GPUs 0 and 1, and
the one-copy side runs on the first. The last line printed is one JSON object.
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
from wan_batching import PROMPTS  # noqa: E402 - the same prompts as the batching benchmark
from wan_i2v import BENCH_DIMS  # noqa: E402 - the same checkpoint as the wan_i2v benchmark


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
    parser.add_argument("--no-offload", action="store_true", help="cuda: keep the model on the GPU (ulysses needs it)")
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
        if args.device == "cuda" and args.no_offload:
            config["disable_cpu_offload"] = True
        sides = {"replicas": Omni("wan_t2v", host=host, **config, replicas="wan=2", worker_threads=1),
                 "one": Omni("wan_t2v", host=host, **config, worker_threads=2),
                 "ulysses2": Omni("wan_t2v", host=host, **config, wan_ulysses=2, worker_threads=1)}
        try:
            for name, omni in sides.items():  # warm-up: first forwards, the prepare cache's text encoder
                burst(omni, 2, params, work)
                print(f"{name}: warmed up", file=sys.stderr, flush=True)
            times: dict[str, list[float]] = {name: [] for name in sides}
            lone: dict[str, list[float]] = {name: [] for name in sides}
            for i in range(args.rounds):
                order = list(sides) if i % 2 == 0 else list(sides)[::-1]
                for name in order:
                    lone[name].append(burst(sides[name], 1, params, work))
                for name in (n for n in order if n != "ulysses2"):
                    times[name].append(burst(sides[name], args.requests, params, work))
                print(f"round {i}: burst replicas {times['replicas'][-1]:.2f} s, one {times['one'][-1]:.2f} s; "
                      f"alone " + ", ".join(f"{n} {lone[n][-1]:.2f} s" for n in sides), file=sys.stderr, flush=True)
        finally:
            for omni in sides.values():
                omni.close()
    ratios = [one / rep for one, rep in zip(times["one"], times["replicas"])]
    latency = [one / uly for one, uly in zip(lone["one"], lone["ulysses2"])]
    speedup = statistics.median(rep / one for rep, one in zip(lone["replicas"], lone["one"]))
    print(json.dumps({
        "requests": args.requests, "steps": args.steps, "size": f"{args.height}x{args.width}x{args.num_frames}",
        "device": args.device, "rounds": args.rounds,
        "burst_s": {k: [round(t, 3) for t in v] for k, v in times.items() if v},
        "ratio": round(statistics.median(ratios), 3), "ratios": [round(r, 3) for r in ratios],
        "alone_s": {k: [round(t, 3) for t in v] for k, v in lone.items()},
        "ulysses_latency_ratio": round(statistics.median(latency), 3),
        "thread_speedup": round(speedup, 3), "ratio_bound": round(2 / speedup, 3)}))


if __name__ == "__main__":
    main()
