"""Benchmark (not in CI): continuous batching of wan_i2v against one request at a time and static batches.

8 requests (different images, prompts and seeds, guidance 5) arrive over time (Poisson arrivals, fixed seed)
at one wan_i2v pipeline on a locally built random-weight checkpoint (benchmarks/wan_i2v.py's transformer).
Three ways to serve them, all in this process on the same loaded model:

- continuous: the stage's default (every denoising request of one shape shares one forward per step; a new
  request is prepared at the next step boundary and joins the batch);
- sequential: `wan_max_batch=1` with the CFG rows in two forwards: one request at a time, as the stage ran before
  batching (and as diffusers runs Wan); `ratio_vs_sequential_cfg_batched` is against `wan_max_batch=1` with the
  CFG rows in one forward, so request batching alone is seen apart from CFG batching;
- static: the continuous engine, but requests are held until 4 are queued and the engine is idle, then run as
  one batch (the last batch is whatever is left once every request has arrived).

Throughput is requests / (last finish - first arrival); each ratio is the median over rounds of
(other's time / continuous time), the runs of a round alternating their order. The prepare cache is cleared
before every run so all sides do the same work. `cfg_batch_speedup` is one request's denoise time with the CFG
rows in two forwards over one forward. `max_abs_diff` is the largest difference between a request's frames
in a continuous run and in its sequential (solo) run. The same is repeated at a larger size (4x the tokens).
With `--steps-spread N` each request's steps are drawn from steps +- N (fixed seed) instead of all equal.
With `--workload mixed` every other request is text-to-video (sent to wan_t2v) and the rest image-to-video (sent to
wan_i2v): continuous is the two pipelines on one plugin host, so one shared engine (text and image rows in one
forward), stepped in turn as `omni serve` steps them; `separate` is the same two pipelines on two hosts (an engine
each, every step of one waiting for the other's), `ratio_vs_separate` its time over continuous; sequential is one
stage that takes both (image policy `optional`) at `wan_max_batch=1`. `max_abs_diff` then covers both kinds.

`busy_s` is the time each run spent inside the engine's steps (the rest it waited for arrivals).
`ratio_vs_static_ceiling` is static's makespan over its busy time: what continuous batching would reach doing
static's work (the same cost per request) with no idle moment, so the most it can gain over static unless its
own batches cost less per request than static's batches of 4. With `--sweep 0.5,1` one more round runs at each
of those arrival factors (mean gap between arrivals over one request's solo time; the headline's is
`--arrival-factor`, 0.25): slower arrivals make static wait longer for its 4th request but let sequential keep up.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/wan_batching.py [--threads N] [--steps-spread N] [--sweep F,..]
        [--workload image|mixed] [--device cuda] [--quick]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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


# mode: (engine, CFG rows in one forward); a mode runs when its engine was built (separate: --workload mixed only)
MODES = {"continuous": ("continuous", True), "sequential": ("sequential", False),
         "sequential_cfg_batched": ("sequential", True), "static": ("continuous", True),
         "separate": ("separate", True)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--num-frames", type=int, default=17)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="rounds at the benchmark size")
    parser.add_argument("--large-rounds", type=int, default=1, help="rounds at the larger size (0: skip)")
    parser.add_argument("--large-scale", type=int, default=2, help="height and width factor of the larger size")
    parser.add_argument("--arrival-factor", type=float, default=0.25,
                        help="mean time between arrivals, as a fraction of one request's solo time")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival times (and of --steps-spread)")
    parser.add_argument("--steps-spread", type=int, default=0,
                        help="each request's steps drawn from steps +- this (0: every request has --steps)")
    parser.add_argument("--sweep", type=lambda v: [float(x) for x in v.split(",")], default=[],
                        help="also one round at each of these arrival factors (comma-separated), base size only")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: the whole model on the GPU (offload off, so the text key/value cache is used)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, every core)")
    parser.add_argument("--quick", action="store_true", help="6 steps, 1 round, 1 larger round")
    parser.add_argument("--workload", default="image", choices=("image", "mixed"),
                        help="mixed: every other request is text-to-video, served beside the image ones")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.quick:
        args.steps, args.rounds, args.large_rounds = 6, 1, 1

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from omni_kernel import Omni
    from omni_kernel.plugins import load_host
    from omni_wan.demo import build_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="omni-wan-batching-") as tmp:
        work = Path(tmp)
        model = build_tiny_checkpoint(work / "model", dims=BENCH_DIMS)
        images = _images(work, args.requests)
        if args.workload == "mixed":  # odd requests text-to-video (request 0, the solo one, has an image)
            images = [image if i % 2 == 0 else None for i, image in enumerate(images)]
        host = load_host()
        where = {"device": args.device} | ({"disable_cpu_offload": True} if args.device == "cuda" else {})
        pipeline = "wan_i2v" if args.workload == "image" else _mixed_plan()
        engines = {"continuous": Omni(pipeline, host=host, model=str(model), **where),
                   "sequential": Omni(pipeline, host=host, model=str(model), **where, wan_max_batch=1)}
        hosts = [host]
        if args.workload == "mixed":
            hosts += [load_host(), load_host()]
            engines["continuous"] = Turns(*(Omni(name, host=host, model=str(model), **where)
                                            for name in ("wan_i2v", "wan_t2v")))
            engines["separate"] = Turns(*(Omni(name, host=h, model=str(model), **where)
                                          for name, h in zip(("wan_i2v", "wan_t2v"), hosts[1:])))
        cache = Caches([h.pm.get_plugin("omni_wan").stages.cache for h in hosts])
        sizes = {"base": (args.height, args.width),
                 "large": (args.height * args.large_scale, args.width * args.large_scale)}
        report = {"benchmark": "wan_batching", "checkpoint": {"transformer": BENCH_DIMS},
                  "settings": {"num_frames": args.num_frames, "steps": args.steps, "guidance_scale": 5.0,
                               "requests": args.requests, "rounds": args.rounds, "large_rounds": args.large_rounds,
                               "arrival_factor": args.arrival_factor, "arrival_seed": args.seed,
                               "steps_spread": args.steps_spread, "sweep": args.sweep, "device": args.device,
                               "workload": args.workload,
                               "text_to_video_requests": sum(image is None for image in images),
                               "threads": torch.get_num_threads(),
                               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}}
        for label, rounds in (("base", args.rounds), ("large", args.large_rounds)):
            if rounds < 1:
                continue
            height, width = sizes[label]
            params = dict(height=height, width=width, num_frames=args.num_frames, num_inference_steps=args.steps,
                          guidance_scale=5.0)
            sweep, args.sweep = args.sweep, (args.sweep if label == "base" else [])
            result = _compare(engines, cache, images, params, rounds, args, work / label)
            args.sweep = sweep
            result["size"] = f"{width}x{height}x{args.num_frames}"
            if label == "base":
                report.update(result)
            else:
                report["large"] = result
            print(f"{label}: {json.dumps(result)}", flush=True)
    print(json.dumps(report))


class Turns:
    """wan_i2v and wan_t2v served side by side: a request goes to the pipeline its image says, and a step steps each
    pipeline with work in turn (as `omni serve`'s engine thread does)."""

    def __init__(self, i2v, t2v):
        self.omnis = {"wan_i2v": i2v, "wan_t2v": t2v}

    def request(self, prompt, image=None, **params):
        return self.omnis["wan_i2v" if image else "wan_t2v"].request(prompt, image=image, **params)

    def generate(self, prompt, image=None, **params):
        return self.omnis["wan_i2v" if image else "wan_t2v"].generate(prompt, image=image, **params)

    def submit(self, request) -> None:
        self.omnis[request.pipeline].submit(request)

    def has_unfinished(self) -> bool:
        return any(o.has_unfinished() for o in self.omnis.values())

    def step(self) -> list:
        return [e for o in self.omnis.values() if o.has_unfinished() for e in o.step()]


class Caches:
    def __init__(self, caches):
        self.caches = caches

    def clear(self) -> None:
        for cache in self.caches:
            cache.clear()


def _runners(engine) -> list:
    omnis = engine.omnis.values() if isinstance(engine, Turns) else [engine]
    return [o.graph.stages["wan"].engine.runner for o in omnis]


def _set_cfg_batched(engine, value: bool) -> None:
    for runner in _runners(engine):
        runner.cfg_batched = value


def _mixed_plan():
    """One Wan node that takes requests with and without an image (what wan_i2v and wan_t2v share)."""
    from omni_kernel import NodeSpec, PipelinePlan
    from omni_wan.plugin import NODE_TYPE

    return PipelinePlan("wan_mixed", [NodeSpec("wan", NODE_TYPE, final=True, policy={"image": "optional"})])


def _compare(engines, cache, images, params, rounds, args, out: Path) -> dict:
    """Warm up, measure one request's solo time (sets the arrival rate) and the CFG speedup, then rounds; then
    one round at each `--sweep` arrival factor."""
    omni = engines["continuous"]

    def solo(cfg_batched: bool):
        _set_cfg_batched(omni, cfg_batched)
        cache.clear()
        start = time.perf_counter()
        trace = omni.generate(PROMPTS[0], image=images[0], **params, seed=0, output=str(out / "solo.mp4")).trace
        _set_cfg_batched(omni, True)
        return time.perf_counter() - start, trace["diffusion.denoise_ms"]

    solo(True)  # load and warm up
    one, two = [], []
    for i in range(3):
        for batched in ((True, False) if i % 2 == 0 else (False, True)):
            (one if batched else two).append(solo(batched))
    solo_s = statistics.median(t for t, _ in one)
    spread = random.Random(args.seed + 1)
    steps = [params["num_inference_steps"] + spread.randint(-args.steps_spread, args.steps_spread)
             for _ in range(args.requests)]
    arrivals = _arrivals(args.requests, args.arrival_factor * solo_s, args.seed)
    result = _rounds(engines, cache, images, params, arrivals, steps, rounds, out, keep_frames=True)
    result.update({"solo_request_s": round(solo_s, 3), "mean_arrival_gap_s": round(args.arrival_factor * solo_s, 3),
                   "arrivals_s": [round(a, 3) for a in arrivals], "steps_per_request": steps,
                   "cfg_batch_speedup": round(statistics.median(d for _, d in two) /
                                              statistics.median(d for _, d in one), 3),
                   "cfg_denoise_ms": {"one_forward": round(statistics.median(d for _, d in one), 1),
                                      "two_forwards": round(statistics.median(d for _, d in two), 1)}})
    sweep = []
    for factor in args.sweep:
        arrivals = _arrivals(args.requests, factor * solo_s, args.seed)
        row = _rounds(engines, cache, images, params, arrivals, steps, 1, out / f"sweep{factor}")
        sweep.append({"arrival_factor": factor, **{k: row[k] for k in SWEEP_KEYS}})
        print(f"arrival factor {factor}: {json.dumps(sweep[-1])}", flush=True)
    if sweep:
        result["sweep"] = sweep
    return result


SWEEP_KEYS = ("ratio_vs_sequential", "ratio_vs_static", "ratio_vs_static_ceiling", "ratio_vs_sequential_cfg_batched",
              "makespan_s", "busy_s", "continuous_batch_size_mean")


def _arrivals(count: int, mean_gap: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    arrivals, clock = [], 0.0
    for _ in range(count):
        arrivals.append(clock)
        clock += rng.expovariate(1 / mean_gap)
    return arrivals


def _rounds(engines, cache, images, params, arrivals, steps, rounds, out: Path, keep_frames: bool = False) -> dict:
    """Every mode once per round, the order alternating between rounds; the ratios are medians over rounds."""
    modes = {mode: how for mode, how in MODES.items() if how[0] in engines}
    times = {mode: [] for mode in modes}
    busy = {mode: [] for mode in modes}
    frames, batch_means = {}, []
    for r in range(rounds):
        for mode in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
            cache.clear()
            engine, cfg_batched = modes[mode]
            engine = engines[engine]
            _set_cfg_batched(engine, cfg_batched)
            elapsed, stepping, results = _serve(engine, mode, images, params, arrivals, steps, out / f"{mode}{r}")
            _set_cfg_batched(engine, True)
            times[mode].append(elapsed)
            busy[mode].append(stepping)
            if r == 0 and keep_frames and mode in ("continuous", "sequential"):
                frames[mode] = {rid: res.output.data["frames"] for rid, res in results.items()}
            if mode == "continuous":
                batch_means += [res.trace["diffusion.batch_size_mean"] for res in results.values()]
            print(f"round {r} {mode:<11} {elapsed:8.3f} s (stepping {stepping:.3f} s)", flush=True)
    pairs = {other: [o / c for o, c in zip(times[other], times["continuous"])]
             for other in modes if other != "continuous"}
    result = {"ratio_vs_sequential": round(statistics.median(pairs["sequential"]), 3),
              "ratio_vs_static": round(statistics.median(pairs["static"]), 3),
              # static's makespan over the time its engine stepped: what continuous batching would reach doing
              # static's work (same cost per request) without a moment idle, the most it can gain over static
              # unless its batches cost less per request than static's batches of 4
              "ratio_vs_static_ceiling": round(statistics.median(t / b for t, b in zip(times["static"],
                                                                                      busy["static"])), 3),
              "ratio_vs_sequential_cfg_batched": round(statistics.median(pairs["sequential_cfg_batched"]), 3),
              **({"ratio_vs_separate": round(statistics.median(pairs["separate"]), 3),
                  "pairs_vs_separate": [round(x, 3) for x in pairs["separate"]]} if "separate" in pairs else {}),
              "pairs_vs_sequential": [round(x, 3) for x in pairs["sequential"]],
              "pairs_vs_static": [round(x, 3) for x in pairs["static"]],
              "throughput_rps": {m: round(len(arrivals) / statistics.median(t), 4) for m, t in times.items()},
              "makespan_s": {m: [round(x, 3) for x in t] for m, t in times.items()},
              "busy_s": {m: [round(x, 3) for x in t] for m, t in busy.items()},
              "continuous_batch_size_mean": round(statistics.mean(batch_means), 3)}
    if keep_frames:
        result["max_abs_diff"] = max(float(abs(frames["continuous"][rid] - frames["sequential"][rid]).max())
                                     for rid in frames["sequential"])
    return result


def _serve(omni, mode: str, images, params, arrivals, steps, out: Path):
    """Submit each request at its arrival time (static: in groups of 4, when the engine is idle); step the
    engine until every request has finished. Returns (last finish - first arrival, time spent stepping,
    {request id: result})."""
    from omni_kernel import RequestFailed, RequestFinished

    pending = [omni.request(PROMPTS[i % len(PROMPTS)], image=images[i], request_id=f"r{i}",
                            **{**params, "num_inference_steps": steps[i]}, seed=i, output=str(out / f"r{i}.mp4"),
                            return_frames=True) for i in range(len(arrivals))]
    queued, results, stepping = [], {}, 0.0
    start = time.perf_counter()
    while len(results) < len(arrivals):
        now = time.perf_counter() - start
        while pending and arrivals[len(arrivals) - len(pending)] <= now:
            queued.append(pending.pop(0))
        idle = not omni.has_unfinished()
        if mode != "static" or (idle and (len(queued) >= 4 or (not pending and queued))):
            for request in queued:
                omni.submit(request)
            queued = []
        if omni.has_unfinished():
            began = time.perf_counter()
            events = omni.step()
            stepping += time.perf_counter() - began
            for event in events:
                if isinstance(event, RequestFailed):
                    raise RuntimeError(f"{event.request_id} failed: {event.error}")
                if isinstance(event, RequestFinished):
                    results[event.request_id] = event.result
        elif pending:
            time.sleep(max(0.0, arrivals[len(arrivals) - len(pending)] - (time.perf_counter() - start)))
    return time.perf_counter() - start, stepping, results


def _images(work: Path, count: int) -> list[str]:
    """Different images: a colour gradient each, with a little seeded noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    paths = []
    for i in range(count):
        y, x = np.mgrid[0:144, 0:160]
        base = np.stack([(x * (i + 1) * 7) % 256, (y * (i + 3) * 5) % 256, np.full_like(x, 40 * i % 256)], -1)
        pixels = np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
        paths.append(str(work / f"image{i}.png"))
        Image.fromarray(pixels).save(paths[-1])
    return paths


if __name__ == "__main__":
    main()
