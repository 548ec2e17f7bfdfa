"""Benchmark (not in CI): stage placement. AR and diffusion in worker processes overlap; in one process they take
turns.

On random-weight checkpoints built locally (the Wan demo; a Qwen2 of hidden 512 x 8 layers, so a token costs
milliseconds rather than Python overhead), with the AR budget calibrated so that one request's AR stage costs
about what its diffusion stage costs:

- `overlap_throughput_ratio`: 8 `qwen_to_wan_i2v` requests arriving one every `gap` seconds (gap = one video
  request's time), throughput with `process` placement over `inproc`. Threads: inproc, the one process uses
  torch with 2 threads (both cores); process, each of the two workers uses 1 (`worker_threads=1`) and the front
  runs no torch.
- `itl_p99_under_video_ratio`: a streaming `ar_text` chat's inter-token latency p99 while a `wan_i2v` job runs,
  over the chat alone, both with `process` placement (the two pipelines' workers, one front loop blocking on all
  their pipes); `itl_p99_under_video_ratio_inproc` is the same with both pipelines in one process (bounded below
  by a denoise step).
- `ray_over_process`: the first workload's time with `ray` placement (a local Ray, 2 CPUs) over `process`.

Runs alternate A B A B; each ratio is the median over pairs. The last line printed is one JSON object.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/overlap.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing.connection
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
IMAGE = str(ROOT / "examples" / "assets" / "image.png")
VIDEO = dict(num_frames=9, height=128, width=128)


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def drive(omnis, submits, on_event=None) -> dict:
    """Submit (time offset, omni, request) as their times come; step every omni until all finished. Blocks on
    the worker pipes of all omnis at once when no in-process stage has work."""
    from omni_kernel.events import RequestFailed, RequestFinished

    for o in omnis:
        o.scheduler.step_wait_s = 0
    handles = [h for o in omnis for s in o.graph.stages.values() if hasattr(s, "handles") for h in s.handles()]
    ray_stages = [s for o in omnis for s in o.graph.stages.values() if type(s).__name__ == "RayStage"]
    queue = sorted(submits, key=lambda s: s[0])
    start = time.perf_counter()
    finished, ids = {}, set()
    while queue or any(o.has_unfinished() for o in omnis):
        now = time.perf_counter() - start
        while queue and queue[0][0] <= now:
            _, omni, request = queue.pop(0)
            ids.add(omni.submit(request))
        got = False
        for o in omnis:
            if o.has_unfinished():
                for event in o.step():
                    got = True
                    if on_event:
                        on_event(event, time.perf_counter())
                    if isinstance(event, (RequestFinished, RequestFailed)):
                        finished[event.request_id] = (event, time.perf_counter() - start)
        if got:
            continue
        inproc_busy = any(s.has_unfinished() for o in omnis for s in o.graph.stages.values()
                          if not hasattr(s, "handles"))
        if inproc_busy:
            continue
        timeout = (queue[0][0] - (time.perf_counter() - start)) if queue else 0.05
        timeout = max(0.0, min(timeout, 0.05))
        if ray_stages:
            ray_stages[0].wait(timeout)
        elif handles:
            multiprocessing.connection.wait(handles, timeout)
        elif queue:
            time.sleep(timeout)
    failed = [e for e, _ in finished.values() if isinstance(e, RequestFailed)]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0].error}")
    return finished


def workload(omni, n: int, gap: float, max_tokens: int, steps: int, out: Path, tag: str) -> float:
    submits = [(i * gap, omni, omni.request(f"a red fox in the snow, take {i}", image=IMAGE, max_tokens=max_tokens,
                                            ignore_eos=True, num_inference_steps=steps, seed=i,
                                            output=str(out / f"{tag}_{i}.mp4"), **VIDEO)) for i in range(n)]
    done = drive([omni], submits)
    return max(t for _, t in done.values())


def itl_p99(chat, video, max_tokens: int, steps: int, out: Path) -> float:
    from omni_kernel.events import TokenDelta

    times: list[float] = []
    chat_ids = set()

    def on_event(event, at):
        if isinstance(event, TokenDelta) and event.request_id in chat_ids:
            times.append(at)

    request = chat.request("tell me about foxes", max_tokens=max_tokens, ignore_eos=True, stream=True, seed=0)
    chat_ids.add(request.request_id)
    submits = [(0.3 if video is not None else 0.0, chat, request)]
    omnis = [chat]
    if video is not None:
        submits.append((0.0, video, video.request("a fox", image=IMAGE, num_inference_steps=steps, seed=1,
                                                  output=str(out / f"itl_{time.time_ns()}.mp4"), **VIDEO)))
        omnis.append(video)
    drive(omnis, submits, on_event)
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]


def bench_ar_model() -> str:
    """A random-weight Qwen2 large enough that a token costs milliseconds (the demo's costs ~1 ms, all
    overhead): hidden 512, 8 layers, the demo's tokenizer; built once under the omni cache."""
    from omni_kernel.files import cache_dir
    from omni_qwen.demo import build_checkpoint

    path = cache_dir() / "bench" / "qwen2-overlap-512x8"
    if not (path / "config.json").is_file():
        staging = path.with_name(path.name + f".{os.getpid()}")
        build_checkpoint(staging, hidden_size=512, num_layers=8, initializer_range=0.5)
        os.replace(staging, path)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    pairs = 1 if args.quick else 3
    n = 8
    import torch

    from omni_kernel import Omni

    torch.set_num_threads(2)
    out = Path(tempfile.mkdtemp(prefix="omni-overlap-"))
    steps = 12 if args.quick else 16

    ar_model = bench_ar_model()
    inproc = Omni("qwen_to_wan_i2v", device="cpu", ar_model=ar_model)
    process = Omni("qwen_to_wan_i2v", device="cpu", placement="process", worker_threads=1, ar_model=ar_model)

    # Calibrate on the process workers (1 thread each): the AR budget whose time matches one video request.
    chat_p = Omni("ar_text", placement="process", worker_threads=1, ar_model=ar_model)

    def chat_time(tokens: int) -> float:
        start = time.perf_counter()
        drive([chat_p], [(0, chat_p, chat_p.request("hello", max_tokens=tokens, ignore_eos=True, seed=0))])
        return time.perf_counter() - start

    t_video = min(workload(process, 1, 0, 1, steps, out, "cal") for _ in range(2))
    per_token = max((min(chat_time(65) for _ in range(2)) - min(chat_time(1) for _ in range(2))) / 64, 1e-4)
    max_tokens = int(min(400, max(8, t_video / per_token)))
    log(f"calibration: one video request {t_video:.3f}s, {per_token * 1000:.2f} ms/token -> max_tokens={max_tokens}")
    gap = t_video / 4  # faster than either placement serves them: the run measures capacity, not arrivals

    ratios, times = [], {"inproc": [], "process": []}
    workload(inproc, 2, gap, max_tokens, steps, out, "warm")
    for r in range(pairs):
        a = workload(inproc, n, gap, max_tokens, steps, out, f"i{r}")
        b = workload(process, n, gap, max_tokens, steps, out, f"p{r}")
        times["inproc"].append(a)
        times["process"].append(b)
        ratios.append(a / b)
        log(f"pair {r}: inproc {a:.2f}s process {b:.2f}s -> throughput ratio {a / b:.2f}")
    overlap = statistics.median(ratios)

    # Chat ITL under a video job.
    chat_tokens = 48
    video_steps = 4 * steps
    video_p = Omni("wan_i2v", device="cpu", placement="process", worker_threads=1)
    chat_i = Omni("ar_text", ar_model=ar_model)
    video_i = Omni("wan_i2v", device="cpu")
    itl_ratios, itl_inproc = [], []
    itl_p99(chat_p, None, 8, steps, out)
    for r in range(pairs):
        alone = itl_p99(chat_p, None, chat_tokens, video_steps, out)
        under = itl_p99(chat_p, video_p, chat_tokens, video_steps, out)
        alone_i = itl_p99(chat_i, None, chat_tokens, video_steps, out)
        under_i = itl_p99(chat_i, video_i, chat_tokens, video_steps, out)
        itl_ratios.append(under / alone)
        itl_inproc.append(under_i / alone_i)
        log(f"pair {r}: process ITL p99 alone {alone * 1000:.2f} ms, under video {under * 1000:.2f} ms; "
            f"inproc alone {alone_i * 1000:.2f} ms, under video {under_i * 1000:.2f} ms")
    for o in (chat_p, video_p, inproc):
        o.close()

    # Ray over process.
    ray_ratio, ray_note = None, None
    try:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
        rayo = Omni("qwen_to_wan_i2v", device="cpu", placement="ray", worker_threads=1, ar_model=ar_model)
        workload(rayo, 2, gap, max_tokens, steps, out, "rwarm")
        rr = []
        for r in range(pairs):
            b = workload(process, n, gap, max_tokens, steps, out, f"pp{r}")
            c = workload(rayo, n, gap, max_tokens, steps, out, f"r{r}")
            rr.append(c / b)
            log(f"pair {r}: process {b:.2f}s ray {c:.2f}s -> {c / b:.2f}")
        ray_ratio = statistics.median(rr)
        rayo.close()
        ray.shutdown()
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        ray_note = f"{type(exc).__name__}: {exc}"
        log("ray:", ray_note)
    process.close()

    result = {
        "requests": n, "pairs": pairs, "quick": args.quick, "max_tokens": max_tokens, "video": VIDEO,
        "num_inference_steps": steps, "arrival_gap_s": round(gap, 4),
        "threads": {"inproc": "one process, torch 2 threads", "process": "two workers, torch 1 thread each "
                    "(worker_threads=1), front without torch", "cpus": os.cpu_count()},
        "inproc_s": [round(t, 3) for t in times["inproc"]], "process_s": [round(t, 3) for t in times["process"]],
        "overlap_throughput_ratio": round(overlap, 3),
        "itl_p99_under_video_ratio": round(statistics.median(itl_ratios), 3),
        "itl_p99_under_video_ratio_inproc": round(statistics.median(itl_inproc), 3),
        "ray_over_process": None if ray_ratio is None else round(ray_ratio, 3),
    }
    if ray_note:
        result["ray_error"] = ray_note
    print(json.dumps(result))


if __name__ == "__main__":
    main()
