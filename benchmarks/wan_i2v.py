"""Benchmark (not in CI): the wan_i2v runtime against a direct diffusers WanImageToVideoPipeline call.

Both run in this process on the same locally built random-weight checkpoint (the real classes, a transformer
large enough that a run takes seconds), with the same settings and seed. The baseline is the direct
pipeline call plus the same MP4 export the runtime does, so the ratio is the runtime's own overhead (step-wise
engine, scheduler, per-request state, trace). Models are loaded once and warmed up; the runtime's prepare
cache is cleared before each of its runs so both sides do the same work. Runs alternate; medians are kept.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/wan_i2v.py [--repeats 3] [--steps 8] ...

The last line printed is one JSON object: both times, overhead_ratio (runtime / direct; target <= 1.03) and
the runtime's per-phase split (medians). Times are the best of --repeats runs (noise only adds time).
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

BENCH_DIMS = {"num_layers": 8, "num_attention_heads": 8, "attention_head_dim": 32, "ffn_dim": 1024}
IMAGE = Path(__file__).resolve().parents[1] / "examples" / "assets" / "image.png"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--num-frames", type=int, default=17)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance-scale", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (0: torch's default); 1 keeps runs comparable on a shared machine")
    return parser.parse_args()


def main() -> None:
    args = parse_args()

    import numpy as np
    import torch
    from omni_hf import quiet_hf_load

    from omni_kernel import Omni
    from omni_wan.demo import build_tiny_checkpoint
    from omni_wan.images import open_image

    with quiet_hf_load(("transformers", "diffusers")):
        from diffusers import WanImageToVideoPipeline
    from omni_wan.presets import DEFAULT_NEGATIVE_PROMPT
    from omni_wan.video import write_mp4

    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = "a cat surfing on a blue wave at sunset"
    with tempfile.TemporaryDirectory(prefix="omni-wan-bench-") as tmp:
        work = Path(tmp)
        model = build_tiny_checkpoint(work / "model", dims=BENCH_DIMS)
        params = dict(height=args.height, width=args.width, num_frames=args.num_frames,
                      num_inference_steps=args.steps, guidance_scale=args.guidance_scale, seed=args.seed)
        omni = Omni("wan_i2v", model=str(model), device="cpu")
        cache = omni.host.pm.get_plugin("omni_wan").stages.cache
        with quiet_hf_load(("transformers", "diffusers")):
            pipe = WanImageToVideoPipeline.from_pretrained(str(model), use_safetensors=True)
        pipe.set_progress_bar_config(disable=True)
        image = open_image(IMAGE)

        def runtime(i: int):
            cache.clear()
            start = time.perf_counter()
            result = omni.generate(prompt, image=str(IMAGE), **params, output=str(work / f"rt{i}.mp4"),
                                   return_frames=True)
            return time.perf_counter() - start, result

        def direct(i: int):
            start = time.perf_counter()
            frames = pipe(image=image, prompt=prompt, negative_prompt=DEFAULT_NEGATIVE_PROMPT, height=args.height,
                          width=args.width, num_frames=args.num_frames, num_inference_steps=args.steps,
                          guidance_scale=args.guidance_scale, generator=torch.Generator().manual_seed(args.seed),
                          output_type="np").frames[0]
            write_mp4(frames, work / f"direct{i}.mp4", fps=24)
            return time.perf_counter() - start, frames

        _, warm = runtime(-1)  # loads the model, warms allocators and kernels on both sides
        _, reference = direct(-1)
        max_abs_diff = float(np.abs(warm.output.data["frames"] - reference).max())
        runtime_s, direct_s, phases = [], [], []
        for i in range(args.repeats):
            for side in ((runtime, direct) if i % 2 == 0 else (direct, runtime)):
                elapsed, out = side(i)
                (runtime_s if side is runtime else direct_s).append(elapsed)
                if side is runtime:
                    phases.append({k[len("diffusion."):-3]: v for k, v in out.trace.items()
                                   if k.startswith("diffusion.") and k.endswith("_ms")
                                   and k not in ("diffusion.elapsed_ms", "diffusion.load_ms")})
                print(f"run {i} {side.__name__:<8} {elapsed:8.3f} s", flush=True)

    # Noise on a shared machine only ever adds time: the best run of each side is the estimate of its cost;
    # the ratio of medians is printed beside it.
    rt, dt = min(runtime_s), min(direct_s)
    split = {name: round(statistics.median(p[name] for p in phases), 1) for name in phases[0]}
    print(json.dumps({
        "benchmark": "wan_i2v", "checkpoint": {"transformer": BENCH_DIMS, "parameters": _params(pipe)},
        "settings": {"height": args.height, "width": args.width, "num_frames": args.num_frames,
                     "steps": args.steps, "guidance_scale": args.guidance_scale, "repeats": args.repeats,
                     "threads": torch.get_num_threads()},
        "runtime_s": round(rt, 4), "direct_s": round(dt, 4), "overhead_ratio": round(rt / dt, 4),
        "median_ratio": round(statistics.median(runtime_s) / statistics.median(direct_s), 4),
        "runtime_runs_s": [round(x, 4) for x in runtime_s], "direct_runs_s": [round(x, 4) for x in direct_s],
        "max_abs_diff": max_abs_diff, "runtime_phase_ms": split}))


def _params(pipe) -> dict:
    return {name: sum(p.numel() for p in getattr(pipe, name).parameters())
            for name in ("transformer", "text_encoder", "vae")}


if __name__ == "__main__":
    main()
