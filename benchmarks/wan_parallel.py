"""Benchmark (not in CI): one Wan denoise forward split over two ranks (Ulysses, `wan_ulysses=2`) against one rank.

On a random-weight checkpoint built locally (benchmarks/wan_i2v.py's transformer). One request's denoise step:
a text-to-video row with guidance, its cond and uncond rows in one transformer forward (the stage's default),
`Wan22I2VPipeline.denoise_batch` on a fresh copy of the request's state each time. Three sides, each in rank
processes started once:

- `ulysses2`: two rank processes under torch.distributed (gloo on a CPU, NCCL on CUDA), one torch thread each,
  every forward split by sequence over both (omni_wan/ulysses.py); its time is rank 0's, after a barrier;
- `one_rank_2t`: one process with 2 torch threads (both cores for the one forward), the baseline;
- `one_rank_1t`: the same process with 1 thread: `second_thread_speedup` (1 thread over 2) is the bound a second
  core sets on the baseline, as `ulysses_speedup` (one_rank_2t over ulysses2) is what splitting the tokens
  makes of the same second core.

Rounds alternate the order of the sides (A B A B, then B A B A); each side's figure is the median of its
forwards in the round; each ratio is the median over rounds of the round's ratio. `max_abs_diff` is the largest
difference between the two ranks' latents and one rank's after the same step (fp32 on a CPU). With
`--device cuda` (two GPUs or more) the ranks take GPUs 0 and 1, the baseline GPU 0, bf16, and threads do not
matter. The last line printed is one JSON object.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/wan_parallel.py [--height 256 --width 256 --num-frames 17]
        [--rounds 5] [--repeats 3] [--device cuda]
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from wan_i2v import BENCH_DIMS  # noqa: E402 - the same checkpoint as the wan_i2v benchmark

PROMPT, NEGATIVE = "a cat surfing on a blue wave at sunset", "blurred, static, low quality"
LOOPBACK, GUIDANCE, SEED = "127.0.0.1", 5.0, 0
NUM_STEPS = 4  # the request's schedule; every forward is its first step
_STORES: list = []  # the ranks' rendezvous stores, hosted here


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def _serve(rank: int, num_ranks: int, port: int, pipe, args) -> None:
    """A rank: loads the model, prepares the request, then times `repeats` forwards per order it gets."""
    import torch

    from omni_wan.comm import Mesh, init_ranks, open_store
    from omni_wan.device import WanDevice
    from omni_wan.model import TextEmbeds, Wan22I2VPipeline
    from omni_wan.parallel import WanParallel

    torch.set_num_threads(args.threads)
    device = init_ranks(rank, num_ranks, open_store(LOOPBACK, port, num_ranks), args.device) \
        if num_ranks > 1 else None
    if args.device == "cuda":
        placement = WanDevice("cuda", "bf16", "bf16", "benchmark", "off")
        torch.cuda.set_device(device or 0)
    else:
        placement = WanDevice("cpu", "fp32", "fp32", "benchmark", "not applicable (CPU)")
    model = Wan22I2VPipeline.load(args.model, placement)
    if num_ranks > 1:
        WanParallel.install(model, Mesh.build(1, num_ranks))
    text, negative = model.encode_texts([PROMPT, NEGATIVE])
    state = model.prepare(TextEmbeds(text, negative), None, args.height, args.width, args.num_frames, NUM_STEPS,
                          GUIDANCE, torch.Generator().manual_seed(SEED))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def step():
        fresh = copy.deepcopy(state)
        if num_ranks > 1:
            torch.distributed.barrier()
        sync()
        start = time.perf_counter()
        model.denoise_batch([fresh], [0])
        sync()
        return time.perf_counter() - start, fresh.latents

    step()  # warm-up: allocators, kernels
    pipe.send(step()[1].float().cpu())
    while (threads := pipe.recv()) is not None:
        torch.set_num_threads(threads)
        pipe.send(statistics.median(step()[0] for _ in range(args.repeats)))
    if num_ranks > 1:
        torch.distributed.destroy_process_group()


def _start(context, num_ranks: int, args) -> list:
    """The ranks, meeting at a store this process hosts on a port the OS assigns (kept for the run)."""
    from omni_wan.comm import open_store

    store = open_store(LOOPBACK, 0, num_ranks)
    _STORES.append(store)
    port = store.port
    pipes = []
    for rank in range(num_ranks):
        parent, child = context.Pipe()
        context.Process(target=_serve, args=(rank, num_ranks, port, child, args), daemon=True).start()
        pipes.append(parent)
    return pipes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--num-frames", type=int, default=17)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="forwards per side and round (their median)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()

    import torch

    from omni_wan.demo import build_tiny_checkpoint

    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"--device cuda needs two GPUs; {torch.cuda.device_count()} visible")
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="omni-wan-parallel-") as tmp:
        args.model = str(build_tiny_checkpoint(Path(tmp) / "model", dims=BENCH_DIMS))
        args.threads = 1
        ranks = _start(context, 2, args)
        single = _start(context, 1, args)
        parallel_latents = [pipe.recv() for pipe in ranks]
        single_latents = single[0].recv()
        max_abs_diff = max(float((p - single_latents).abs().max()) for p in parallel_latents)
        sides = {"ulysses2": (ranks, 1), "one_rank_2t": (single, 2), "one_rank_1t": (single, 1)}
        times: dict[str, list[float]] = {name: [] for name in sides}
        for i in range(args.rounds):
            for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
                pipes, threads = sides[name]
                for pipe in pipes:
                    pipe.send(threads)
                times[name].append([pipe.recv() for pipe in pipes][0])
                log(f"round {i} {name:<12} {times[name][-1]:.4f} s")
        for pipe in ranks + single:
            pipe.send(None)

    def ratio(a: str, b: str) -> float:
        return round(statistics.median(x / y for x, y in zip(times[a], times[b])), 4)

    tokens = ((args.num_frames - 1) // 4 + 1) * (args.height // 32) * (args.width // 32)
    print(json.dumps({
        "benchmark": "wan_parallel", "device": args.device, "checkpoint": {"transformer": BENCH_DIMS},
        "settings": {"height": args.height, "width": args.width, "num_frames": args.num_frames, "tokens": tokens,
                     "rows": 2, "rounds": args.rounds, "repeats": args.repeats},
        "forward_s": {name: round(statistics.median(t), 4) for name, t in times.items()},
        "ulysses_speedup": ratio("one_rank_2t", "ulysses2"),
        "second_thread_speedup": ratio("one_rank_1t", "one_rank_2t"),
        "ulysses_over_one_thread": ratio("one_rank_1t", "ulysses2"),
        "max_abs_diff": max_abs_diff}))


if __name__ == "__main__":
    main()
