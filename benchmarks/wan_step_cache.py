"""Benchmark (not in CI): a continuous Wan batch with the step cache against the same batch uncached, next to the
ideal ratio measured in the same run.

`--requests` text-to-video requests (different prompts and seeds, guidance 5) join one wan_t2v stage one step
apart, on a locally built random-weight checkpoint whose transformer dominates a step (12 blocks of 512
channels). The cached side sets `step_cache=first_block` at `--threshold`; the uncached side sets nothing. Rounds
alternate the two (A B A B ...), and each time is the median over rounds of the batch's makespan (first
submit to last finish).

The ideal ratio is what skipping alone could give: uncached time / (uncached time - skipped share x the time
the uncached run spends in the blocks after the first), with the skipped share the cached run's skipped
transformer forwards over all its forwards, and the blocks' time measured in one extra uncached run with a timer
around them (kept out of the timed rounds). `of_ideal` is the measured ratio over the ideal one.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/wan_step_cache.py [--rounds N] [--threshold T] [--device cuda]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A random-weight transformer wide and deep enough that its blocks, not the VAE or the text encoder, take most of
# a request's time on a CPU (the wan_i2v benchmark's has 8 blocks of 256 channels)
DIMS = {"num_layers": 12, "num_attention_heads": 8, "attention_head_dim": 64, "ffn_dim": 2048}

PROMPTS = ["a cat surfing on a blue wave at sunset", "a red fox running through fresh snow",
           "a paper boat drifting down a rainy street", "a hot air balloon over green hills",
           "a lighthouse in a storm at night", "a hummingbird hovering near a flower",
           "a train crossing a stone bridge in autumn", "a robot watering plants in a greenhouse"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", default="192x320", help="HEIGHTxWIDTH")
    parser.add_argument("--num-frames", type=int, default=17)
    parser.add_argument("--threshold", type=float, default=0.2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    return parser.parse_args()


def run_batch(omni, args, cached: bool, out: Path) -> tuple[float, list[dict]]:
    """The batch's makespan, requests joining one engine step apart, and each request's trace."""
    height, width = (int(v) for v in args.size.split("x"))
    extra = {"step_cache": "first_block", "step_cache_threshold": args.threshold} if cached else {}
    requests = [omni.request(PROMPTS[i % len(PROMPTS)], height=height, width=width, num_frames=args.num_frames,
                             num_inference_steps=args.steps, guidance_scale=5.0, seed=i,
                             output=str(out / f"{'c' if cached else 'u'}{i}.mp4"), **extra)
                for i in range(args.requests)]
    from omni_kernel import RequestFinished

    traces = []
    start = time.perf_counter()
    for request in requests:
        omni.submit(request)
        traces += [e.result.trace for e in omni.step() if isinstance(e, RequestFinished)]
    while omni.has_unfinished():
        traces += [e.result.trace for e in omni.step() if isinstance(e, RequestFinished)]
    return time.perf_counter() - start, traces


def tail_block_share(omni, args, out: Path) -> float:
    """The share of an uncached batch's time spent in the transformer's blocks after the first."""
    import torch

    blocks = omni.graph.stages["wan"].engine.runner.model.pipe.transformer.blocks[1:]
    spent = [0.0]
    begun: list[float] = []
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def before(*_):
        sync()
        begun.append(time.perf_counter())

    def after(*_):
        sync()
        spent[0] += time.perf_counter() - begun.pop()

    hooks = [h for b in blocks for h in (b.register_forward_pre_hook(before), b.register_forward_hook(after))]
    try:
        total, _ = run_batch(omni, args, cached=False, out=out)
    finally:
        for hook in hooks:
            hook.remove()
    return spent[0] / total


def main() -> None:
    args = parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from omni_kernel import Omni
    from omni_wan.demo import build_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="omni-wan-step-cache-") as tmp:
        work = Path(tmp)
        model = build_tiny_checkpoint(work / "model", dims=DIMS)
        where = {"device": args.device} | ({"disable_cpu_offload": True} if args.device == "cuda" else {})
        omni = Omni("wan_t2v", model=str(model), **where)
        run_batch(omni, args, cached=True, out=work)  # warm-up: the model, the text cache, the allocator
        times = {"uncached": [], "cached": []}
        skipped_share = []
        for _ in range(args.rounds):
            for side in ("uncached", "cached"):
                seconds, traces = run_batch(omni, args, side == "cached", work)
                times[side].append(seconds)
                if side == "cached":
                    skipped = sum(t["diffusion.step_cache_skipped_forwards"] for t in traces)
                    forwards = sum(t["diffusion.step_cache_forwards"] for t in traces)
                    skipped_share.append(skipped / forwards)
        tail = tail_block_share(omni, args, work)
        omni.close()
    uncached, cached = statistics.median(times["uncached"]), statistics.median(times["cached"])
    share = statistics.median(skipped_share)
    measured, ideal = uncached / cached, 1 / (1 - share * tail)
    print(f"uncached {uncached:.2f}s, cached {cached:.2f}s: {measured:.3f}x; skipped {share:.1%} of forwards, "
          f"blocks after the first {tail:.1%} of the time: ideal {ideal:.3f}x, reached {measured / ideal:.1%}")
    print(json.dumps({"benchmark": "wan_step_cache", "checkpoint": {"transformer": DIMS},
                      "requests": args.requests, "steps": args.steps, "size": args.size,
                      "num_frames": args.num_frames, "threshold": args.threshold, "rounds": args.rounds,
                      "device": args.device, "threads": torch.get_num_threads(),
                      "uncached_s": round(uncached, 3), "cached_s": round(cached, 3),
                      "times": {k: [round(v, 3) for v in vs] for k, vs in times.items()},
                      "skipped_share": round(share, 4), "tail_block_share": round(tail, 4),
                      "ratio": round(measured, 3), "ideal_ratio": round(ideal, 3),
                      "of_ideal": round(measured / ideal, 3)}))


if __name__ == "__main__":
    main()
