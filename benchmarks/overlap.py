"""Benchmark (not in CI): stage placement. AR and diffusion in worker processes overlap; in one process they take
turns.

On random-weight checkpoints built locally (the Wan demo; a Qwen2 of hidden 512 x 8 layers, so a token costs
milliseconds rather than Python overhead). The workload: a burst of 8 `qwen_to_wan_i2v` requests (all submitted at
t=0) whose AR budgets are evenly staggered (longest/16, 3 longest/16, ... 15 longest/16), so the AR stage hands
requests to the diffusion stage one after another while it decodes the longer ones. `longest` is calibrated on
the `process` placement so that, over the whole burst, the AR worker's busy time (CPU seconds, one torch thread)
matches the diffusion worker's with its ffmpeg: AR and diffusion cost about the same per request, as served
(both stages batch, so a one-request calibration would leave one stage the bottleneck and nothing to overlap).
Every placement runs one full burst before it is measured (`process`: the calibration runs).

- `overlap_throughput_ratio`: the burst's throughput with `process` placement over `inproc`. Threads: process,
  the two workers share the cores (`worker_threads="shared"`: before each step a worker takes cores // busy
  workers torch threads, so one busy alone gets both) and the front runs no torch;
  `overlap_throughput_ratio_fixed_split` is the same with 1 thread per worker (`worker_threads=1`, which the
  calibration uses); inproc runs twice per round, torch with 2 threads (both cores for whichever stage steps)
  and with 1; the ratios are taken against the faster inproc run of each round
  (`overlap_throughput_ratio_vs_inproc_2t` against 2 threads). `single_request_s`: one request (the longest
  budget) alone, per round. `overlap_throughput_ratio_bound`: the inproc burst over `floor_s`, the shortest
  burst any overlap of the two workers could reach (see `floor_s`): what a perfect pipeline would score here
  (`_no_fill`: the same floor without the fill). Why it is where it is: `second_thread_speedup`, each stage's
  work alone in one process at 1 thread over 2 threads (the AR stage's burst; `n` requests of the diffusion
  stage one after another); `overlap_throughput_ratio_stages`, a perfect overlap with no fill and no tail
  against a baseline that runs each stage at that speed; `inproc_switching_cost`, the inproc burst over its two
  stages' work alone, both at 2 threads (the baseline's loss from taking turns).
- `itl_p99_under_video_ratio`: a streaming `ar_text` chat's inter-token latency p99 while a `wan_i2v` job
  denoises (the chat starts 0.15 s after it; the video's steps are set from a two-point timing so that its
  denoising outlasts the chat, and `itl_video_outlasted_chat` says it did), over the chat alone, both with
  `process` placement and 1 thread per worker (the two pipelines' workers, one front loop blocking on all their
  pipes); `_shared` is the same with shared cores (the chat alone then steps with both cores, so its
  denominator shrinks) and `_inproc` with both pipelines in one process (bounded below by a denoise step);
  `itl_p99_ms_alone_under_video` gives the milliseconds.
- `ray_over_process`: the first workload's time with `ray` placement (a local Ray, 2 CPUs, actors of 1 thread)
  over `process` with 1 thread per worker; `ray_cpu_s` gives, per round, the CPU seconds of the workers and the
  front (process) and of the actors, Ray's own processes and the front (ray).

Runs alternate: the bursts of a round run in one order, the next round's in the reverse order; each ratio is the
median over rounds. The last line printed is one JSON object.

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
from functools import partial
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
IMAGE = str(ROOT / "examples" / "assets" / "image.png")
VIDEO = dict(num_frames=9, height=128, width=128)
CHAT_AFTER_S = 0.15  # the ITL chat starts this long after the video job


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def drive(omnis, submits, on_event=None) -> dict:
    """Submit (time offset, omni, request) as their times come; step every omni until all finished. Blocks on
    the worker pipes of all omnis at once when no in-process stage has work."""
    from omni_kernel.events import RequestFailed

    for o in omnis:
        o.scheduler.step_wait_s = 0
    handles = [h for o in omnis for s in o.graph.stages.values() if hasattr(s, "handles") for h in s.handles()]
    queue = sorted(submits, key=lambda s: s[0])
    start = time.perf_counter()
    finished: dict = {}
    while queue or any(o.has_unfinished() for o in omnis):
        submit_due(queue, time.perf_counter() - start)
        if step_all(omnis, finished, start, on_event) or inproc_busy(omnis):
            continue
        timeout = (queue[0][0] - (time.perf_counter() - start)) if queue else 0.05
        timeout = max(0.0, min(timeout, 0.05))
        if handles:
            multiprocessing.connection.wait(handles, timeout)
        elif queue:
            time.sleep(timeout)
    failed = [e for e, _ in finished.values() if isinstance(e, RequestFailed)]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0].error}")
    return finished


def submit_due(queue: list, now: float) -> None:
    while queue and queue[0][0] <= now:
        _, omni, request = queue.pop(0)
        omni.submit(request)


def step_all(omnis, finished: dict, start: float, on_event) -> bool:
    """One step of every omni with work; True if any event came."""
    from omni_kernel.events import RequestFailed, RequestFinished

    got = False
    for o in omnis:
        if not o.has_unfinished():
            continue
        for event in o.step():
            got = True
            if on_event:
                on_event(event, time.perf_counter())
            if isinstance(event, (RequestFinished, RequestFailed)):
                finished[event.request_id] = (event, time.perf_counter() - start)
    return got


def inproc_busy(omnis) -> bool:
    """An in-process stage's engine has work (a placed stage has `handles`: its worker's pipe)."""
    return any(s.engine.has_unfinished() for o in omnis for s in o.graph.stages.values() if not hasattr(s, "handles"))


def lengths(n: int, longest: int) -> list[int]:
    """The AR budgets of the burst, evenly staggered (longest/2n, 3 longest/2n, ... up to about longest), so the
    AR stage hands requests to the diffusion stage one after another while it decodes the longer ones (equal
    budgets would all finish together, leaving nothing to overlap)."""
    return [max(1, round(longest * (2 * i + 1) / (2 * n))) for i in range(n)]


def workload(omni, tokens: list[int], gap: float, steps: int, out: Path, tag: str,
             ar_done: dict | None = None) -> float:
    """The requests' time; `ar_done` gets, per request index, when its AR stage finished (seconds)."""
    from omni_kernel.events import StageFinished

    submits = [(i * gap, omni, omni.request(f"a red fox in the snow, take {i}", image=IMAGE, max_tokens=t,
                                            ignore_eos=True, num_inference_steps=steps, seed=i,
                                            output=str(out / f"{tag}_{i}.mp4"), **VIDEO)) for i, t in enumerate(tokens)]
    index = {request.request_id: i for i, (_, _, request) in enumerate(submits)}
    ar_node = omni.graph.order[0]
    start = time.perf_counter()

    def on_event(event, at):
        if ar_done is not None and isinstance(event, StageFinished) and event.node_id == ar_node:
            ar_done[index[event.request_id]] = at - start

    done = drive([omni], submits, on_event)
    return max(t for _, t in done.values())


def cpu_s(pid: int) -> float:
    """User + system CPU seconds so far of a process and of its children that ended (the diffusion stage's
    ffmpeg, about a fifth of that stage's CPU here), from Linux /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def ray_cpu() -> dict[str, float]:
    """CPU seconds so far of the local Ray's processes: the stage actors, and Ray's own (raylet, GCS, agents)."""
    total = {"actors": 0.0, "ray_daemons": 0.0}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if "StageActor" in cmd:
                total["actors"] += cpu_s(int(entry.name))
            elif "ray" in cmd and ("raylet" in cmd or "gcs_server" in cmd or "site-packages/ray/" in cmd):
                total["ray_daemons"] += cpu_s(int(entry.name))
        except (OSError, ValueError):
            continue
    return total


def busy(omni, run) -> tuple[float, dict[str, float]]:
    """Run `run()` on a `process`-placed omni; its time and each stage worker's CPU seconds meanwhile (one torch
    thread per worker, and a worker blocks when idle: its busy time)."""
    stages = {node: s for node, s in omni.graph.stages.items()}
    before = {node: cpu_s(s.proc.pid) for node, s in stages.items()}
    elapsed = run()
    return elapsed, {node: cpu_s(s.proc.pid) - before[node] for node, s in stages.items()}


def floor_s(burst_cpu: dict[str, float], tail_cpu: float, tail_s: float, fill_cpu: float = 0.0,
            fill_s: float = 0.0) -> float:
    """The shortest burst any overlap could reach. The diffusion stage has nothing to do until the first request
    leaves the AR stage (the fill: `fill_s` with the AR worker alone on both cores, shared cores; `fill_cpu`: its
    CPU seconds at one thread, the fixed split's time to its first hand-off), and the last request's diffusion
    cannot start before its AR stage is done (the tail: `tail_s`, a lone request's time after its AR stage, shared
    cores; `tail_cpu`: its diffusion worker's CPU seconds at one thread). At best every other piece of work runs
    with both cores busy at one thread each (the fixed split's CPU seconds, over 2). With the fill left out (the
    defaults), the floor is more optimistic still."""
    return fill_s + (sum(burst_cpu.values()) - fill_cpu - tail_cpu) / 2 + tail_s


def thread_times(run, reverse: bool = False) -> tuple[float, float]:
    """`run()`'s time with torch at 1 thread and at 2 (one process; `reverse`: the 2-thread run first)."""
    import torch

    times = {}
    for threads in ((2, 1) if reverse else (1, 2)):
        torch.set_num_threads(threads)
        times[threads] = run()
    torch.set_num_threads(2)
    return times[1], times[2]


def ar_burst(ar, tokens: list[int]) -> float:
    """The burst's AR stage alone: the same prompts and budgets on an `ar_text` pipeline."""
    return drive_time([ar], [(0.0, ar, ar.request(f"a red fox in the snow, take {i}", max_tokens=t, ignore_eos=True,
                                                  seed=i)) for i, t in enumerate(tokens)])


def diffusion_alone(video, steps: int, out: Path, n: int) -> float:
    """`n` `wan_i2v` requests one after another, each alone in the stage, as the burst's hand-offs mostly come."""
    return sum(video_time(video, steps, out) for _ in range(n))


def stage_ratio(burst_cpu: dict[str, float], order, speedup: dict[str, float]) -> float:
    """What a perfect overlap would score with no fill and no tail, against an inproc baseline that ran each
    stage's work at the speed the second thread gives that stage alone (`speedup`; the stage's CPU seconds at 1
    thread over it) and lost nothing by switching between the stages."""
    ar_cpu, video_cpu = burst_cpu[order[0]], burst_cpu[order[-1]]
    inproc = ar_cpu / speedup["ar"] + video_cpu / speedup["diffusion"]
    return inproc / ((ar_cpu + video_cpu) / 2)


def calibrate(process, n: int, steps: int, out: Path) -> tuple[list[int], dict]:
    """Scale the evenly staggered AR budgets until, over the whole burst, the AR worker's busy time (CPU seconds,
    one torch thread) matches the diffusion worker's on the `process` placement: AR and diffusion cost about the
    same per request, as served (both stages batch, so a one-request calibration would leave one stage the
    bottleneck and nothing to overlap)."""
    ar_node, video_node = process.graph.order
    longest, history = 120, []
    for it in range(5):
        ends: dict[int, float] = {}
        run = partial(workload, process, lengths(n, longest), 0.0, steps, out, f"cal{it}", ends)
        elapsed, cpu = busy(process, run)
        balance = cpu[ar_node] / max(cpu[video_node], 1e-3)
        history.append({"longest": longest, "ar_busy_s": round(cpu[ar_node], 3),
                        "diffusion_busy_s": round(cpu[video_node], 3), "elapsed_s": round(elapsed, 3),
                        "ar_finished_s": [round(ends[i], 3) for i in range(n)]})
        log(f"calibration {it}: AR budgets up to {longest} tokens -> AR busy {cpu[ar_node]:.2f}s, diffusion busy "
            f"{cpu[video_node]:.2f}s, burst {elapsed:.2f}s, AR finished at {[round(ends[i], 2) for i in range(n)]}")
        if abs(balance - 1) < 0.05 and it:
            break
        longest = int(min(1000, max(8, round(longest / balance))))
    return lengths(n, longest), {"longest": longest, "iterations": history}


def itl_p99(chat, video, max_tokens: int, steps: int, out: Path) -> tuple[float, float, bool]:
    """The chat's inter-token p99, how long it streamed, and whether the video job was still running when the
    chat's last token came (so the chat ran under it throughout)."""
    from omni_kernel.events import RequestFinished, TokenDelta

    times: list[float] = []
    video_done: list[float] = []
    chat_ids = set()

    def on_event(event, at):
        if isinstance(event, TokenDelta) and event.request_id in chat_ids:
            times.append(at)
        elif isinstance(event, RequestFinished) and event.request_id not in chat_ids:
            video_done.append(at)

    request = chat.request("tell me about foxes", max_tokens=max_tokens, ignore_eos=True, stream=True, seed=0)
    chat_ids.add(request.request_id)
    submits = [(CHAT_AFTER_S if video is not None else 0.0, chat, request)]
    omnis = [chat]
    if video is not None:
        submits.append((0.0, video, video.request("a fox", image=IMAGE, num_inference_steps=steps, seed=1,
                                                  output=str(out / f"itl_{time.time_ns()}.mp4"), **VIDEO)))
        omnis.append(video)
    drive(omnis, submits, on_event)
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    covered = video is None or bool(video_done and video_done[0] > times[-1])
    return gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], times[-1] - times[0], covered


def drive_time(omnis, submits) -> float:
    start = time.perf_counter()
    drive(omnis, submits)
    return time.perf_counter() - start


def video_time(video, steps: int, out: Path) -> float:
    return drive_time([video], [(0.0, video, video.request("a fox", image=IMAGE, num_inference_steps=steps, seed=1,
                                                           output=str(out / f"vt_{time.time_ns()}.mp4"), **VIDEO))])


def bench_ar_model() -> str:
    """A random-weight Qwen2 large enough that a token costs milliseconds (the demo's costs ~1 ms, all
    overhead): hidden 512, 8 layers, the demo's tokenizer; built once under the omni cache."""
    from omni_kernel.util.files import cache_dir
    from omni_qwen.demo import build_checkpoint

    path = cache_dir() / "bench" / "qwen2-overlap-512x8"
    if not (path / "config.json").is_file():
        staging = path.with_name(path.name + f".{os.getpid()}")
        build_checkpoint(staging, hidden_size=512, num_layers=8, initializer_range=0.5)
        os.replace(staging, path)
    return str(path)


def main() -> None:  # noqa: C901, PLR0915 - one measurement protocol, read top to bottom in the order it runs
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
    shared = Omni("qwen_to_wan_i2v", device="cpu", placement="process", worker_threads="shared", ar_model=ar_model)

    workload(process, lengths(2, 20), 0.0, steps, out, "pwarm")
    tokens, calibration = calibrate(process, n, steps, out)
    log(f"AR budgets: {tokens}")

    # inproc at both torch settings (2 threads: both cores for whichever stage steps; 1 thread), against the
    # process placement with shared cores and with the fixed split; the ratios are taken against the faster
    # inproc run of each round.
    ratios, ratios2, ratios_fixed = [], [], []
    times = {"inproc_2t": [], "inproc_1t": [], "process": [], "process_fixed_split": []}
    lone = {"inproc_2t": [], "process": [], "process_fixed_split": []}  # one request alone (the longest budget)
    bounds = []  # per round: the shortest burst any overlap of these two workers could reach (floor_s)
    video_node = process.graph.order[-1]
    workload(inproc, tokens, 0.0, steps, out, "warm")  # warmed by one burst, as process was by calibration
    workload(shared, tokens, 0.0, steps, out, "swarm")

    ar_alone = Omni("ar_text", ar_model=ar_model)
    video_alone = Omni("wan_i2v", device="cpu")
    ar_burst(ar_alone, tokens)
    diffusion_alone(video_alone, steps, out, 1)
    speedups = {"ar": [], "diffusion": []}  # per round: inproc, 1 thread over 2, each stage's work alone
    switching = []  # per round: the inproc burst at 2 threads over its two stages' work run alone at 2 threads
    firsts = {"process": {}, "process_fixed_split": {}}  # the latest round's AR finish times per request

    def burst(kind: str, r: int):
        torch.set_num_threads(1 if kind == "inproc_1t" else 2)
        if kind.startswith("inproc"):
            return workload(inproc, tokens, 0.0, steps, out, f"{kind}{r}"), None
        omni = shared if kind == "process" else process
        firsts[kind] = {}
        return busy(omni, partial(workload, omni, tokens, 0.0, steps, out, f"{kind}{r}", firsts[kind]))

    for r in range(pairs):
        order = ["inproc_2t", "process", "inproc_1t", "process_fixed_split"]
        got = {kind: burst(kind, r) for kind in (order if r % 2 == 0 else order[::-1])}  # drift hurts all alike
        torch.set_num_threads(2)
        (a2, _), (b, cpu), (a1, _), (f, cpu_f) = (got[kind] for kind in order)
        for key, value in (("inproc_2t", a2), ("inproc_1t", a1), ("process", b), ("process_fixed_split", f)):
            times[key].append(value)
        ar1, ar2 = thread_times(partial(ar_burst, ar_alone, tokens), reverse=r % 2 == 1)
        video1, video2 = thread_times(partial(diffusion_alone, video_alone, steps, out, n), reverse=r % 2 == 1)
        speedups["ar"].append(ar1 / ar2)
        speedups["diffusion"].append(video1 / video2)
        switching.append(a2 / (ar2 + video2))
        lone["inproc_2t"].append(workload(inproc, tokens[-1:], 0.0, steps, out, f"li{r}"))
        ends: dict[int, float] = {}
        lone["process"].append(workload(shared, tokens[-1:], 0.0, steps, out, f"ls{r}", ends))
        lone_f, cpu_lone = busy(process, partial(workload, process, tokens[-1:], 0.0, steps, out, f"lf{r}"))
        lone["process_fixed_split"].append(lone_f)
        tail_s = lone["process"][-1] - ends[0]
        fill_s, fill_cpu = min(firsts["process"].values()), min(firsts["process_fixed_split"].values())
        floor = floor_s(cpu_f, cpu_lone[video_node], tail_s, fill_cpu, fill_s)
        floor_no_fill = floor_s(cpu_f, cpu_lone[video_node], tail_s)
        bounds.append({"floor_s": round(floor, 3), "fill_s": round(fill_s, 3), "fill_cpu_s": round(fill_cpu, 3),
                       "tail_s": round(tail_s, 3), "tail_cpu_s": round(cpu_lone[video_node], 3),
                       "burst_cpu_s": round(sum(cpu_f.values()), 3), "ratio_bound": round(min(a1, a2) / floor, 3),
                       "ratio_bound_no_fill": round(min(a1, a2) / floor_no_fill, 3),
                       "ratio_stages": round(stage_ratio(cpu_f, process.graph.order,
                                                         {k: v[-1] for k, v in speedups.items()}), 3)})
        ratios.append(min(a1, a2) / b)
        ratios2.append(a2 / b)
        ratios_fixed.append(min(a1, a2) / f)
        log(f"round {r}: inproc 2 threads {a2:.2f}s, inproc 1 thread {a1:.2f}s, process shared cores {b:.2f}s "
            f"(worker CPU {', '.join(f'{k} {v:.2f}s' for k, v in cpu.items())}), fixed split {f:.2f}s (worker "
            f"busy {', '.join(f'{k} {v:.2f}s' for k, v in cpu_f.items())}) -> throughput ratio "
            f"{min(a1, a2) / b:.2f}, fixed split {min(a1, a2) / f:.2f}; one request alone: "
            f"{', '.join(f'{k} {v[-1]:.2f}s' for k, v in lone.items())}; floor {floor:.2f}s (fill {fill_s:.2f}s, "
            f"tail {tail_s:.2f}s) -> at most {min(a1, a2) / floor:.2f} ({min(a1, a2) / floor_no_fill:.2f} without "
            f"the fill); the second thread speeds inproc AR up {speedups['ar'][-1]:.2f}x, diffusion "
            f"{speedups['diffusion'][-1]:.2f}x (no fill, no tail, no switching: {bounds[-1]['ratio_stages']:.2f}); "
            f"inproc burst / its stages alone {switching[-1]:.2f}")
    overlap = statistics.median(ratios)
    shared.close()
    chat_p = Omni("ar_text", placement="process", worker_threads=1, ar_model=ar_model)

    # Chat ITL under a video job.
    # The video's denoising must outlast the chat (which starts CHAT_AFTER_S later): steps from a two-point timing.
    chat_tokens = 48
    video_p = Omni("wan_i2v", device="cpu", placement="process", worker_threads=1)
    chat_sh = Omni("ar_text", placement="process", worker_threads="shared", ar_model=ar_model)
    video_sh = Omni("wan_i2v", device="cpu", placement="process", worker_threads="shared")
    chat_i = Omni("ar_text", ar_model=ar_model)
    video_i = Omni("wan_i2v", device="cpu")
    itl_ratios, itl_shared, itl_inproc, covered = [], [], [], []
    itl_ms = {"process_fixed_split": [], "process_shared": [], "inproc": []}
    itl_p99(chat_sh, None, 8, steps, out)
    itl_p99(chat_p, None, 8, steps, out)
    _, chat_s, _ = itl_p99(chat_p, None, chat_tokens, steps, out)
    video_time(video_p, steps, out)
    per_step = max((min(video_time(video_p, 5 * steps, out) for _ in range(2)) -
                    min(video_time(video_p, steps, out) for _ in range(2))) / (4 * steps), 1e-4)
    video_steps = int(min(200, max(4 * steps, (CHAT_AFTER_S + 1.5 * chat_s) / per_step)))  # 250 fails in Wan
    log(f"chat streams {chat_s:.2f}s; a denoise step {per_step * 1000:.1f} ms -> video of {video_steps} steps")
    for r in range(pairs):
        alone, _, _ = itl_p99(chat_sh, None, chat_tokens, video_steps, out)
        under, _, cov = itl_p99(chat_sh, video_sh, chat_tokens, video_steps, out)
        alone_f, _, _ = itl_p99(chat_p, None, chat_tokens, video_steps, out)
        under_f, _, cov_f = itl_p99(chat_p, video_p, chat_tokens, video_steps, out)
        alone_i, _, _ = itl_p99(chat_i, None, chat_tokens, video_steps, out)
        under_i, _, cov_i = itl_p99(chat_i, video_i, chat_tokens, video_steps, out)
        itl_shared.append(under / alone)
        itl_ratios.append(under_f / alone_f)
        itl_inproc.append(under_i / alone_i)
        covered += [cov, cov_f, cov_i]
        for key, pair in (("process_fixed_split", (alone_f, under_f)), ("process_shared", (alone, under)),
                          ("inproc", (alone_i, under_i))):
            itl_ms[key].append([round(x * 1000, 2) for x in pair])
        log(f"pair {r}: process ITL p99 alone {alone_f * 1000:.2f} ms, under video {under_f * 1000:.2f} ms; shared "
            f"cores alone {alone * 1000:.2f} ms, under video {under * 1000:.2f} ms; inproc alone "
            f"{alone_i * 1000:.2f} ms, under video {under_i * 1000:.2f} ms; video outlasted the chat: {cov_f}, {cov}, "
            f"{cov_i}")
    for o in (chat_p, video_p, chat_sh, video_sh, inproc, ar_alone, video_alone):
        o.close()

    # Ray over process.
    ray_ratio, ray_note, ray_cpu_s = None, None, []
    try:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
        rayo = Omni("qwen_to_wan_i2v", device="cpu", placement="ray", worker_threads=1, ar_model=ar_model)
        workload(rayo, tokens, 0.0, steps, out, "rwarm")  # warmed by one burst, as process was by calibration
        rr = []
        for r in range(pairs):
            front = time.process_time()
            b, cpu = busy(process, partial(workload, process, tokens, 0.0, steps, out, f"pp{r}"))
            cpu_process = {"workers": sum(cpu.values()), "front": time.process_time() - front}
            front, before = time.process_time(), ray_cpu()
            c = workload(rayo, tokens, 0.0, steps, out, f"r{r}")
            after = ray_cpu()
            cpu_ray = {k: after[k] - before[k] for k in after} | {"front": time.process_time() - front}
            rr.append(c / b)
            ray_cpu_s.append({"process": {k: round(v, 2) for k, v in cpu_process.items()},
                              "ray": {k: round(v, 2) for k, v in cpu_ray.items()}})
            log(f"pair {r}: process {b:.2f}s ray {c:.2f}s -> {c / b:.2f}; CPU seconds {ray_cpu_s[-1]}")
        ray_ratio = statistics.median(rr)
        rayo.close()
        ray.shutdown()
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        ray_note = f"{type(exc).__name__}: {exc}"
        log("ray:", ray_note)
    process.close()

    result = {
        "requests": n, "pairs": pairs, "quick": args.quick, "max_tokens": tokens, "video": VIDEO,
        "num_inference_steps": steps, "arrivals": "a burst: all at t=0", "calibration": calibration,
        "threads": {"inproc_2t": "one process, torch 2 threads", "inproc_1t": "one process, torch 1 thread",
                    "process": "two workers sharing the cores (worker_threads='shared'): torch threads = "
                               "cores // busy workers before each step, front without torch",
                    "process_fixed_split": "two workers, torch 1 thread each (worker_threads=1)",
                    "itl": "chat and video pipelines, process placement, 1 thread per worker (worker_threads=1); "
                           "_shared: worker_threads='shared' (one board: the chat alone steps with 2 threads, "
                           "under the video with 1); _inproc: one process, torch 2 threads",
                    "ray": "two actors of {CPU: 1}, torch 1 thread each, local Ray num_cpus=2; ray_over_process is "
                           "against the process placement with the fixed split (1 thread each, like the actors)",
                    "cpus": os.cpu_count()},
        **{f"{k}_s": [round(t, 3) for t in v] for k, v in times.items()},
        "single_request_s": {k: [round(t, 3) for t in v] for k, v in lone.items()},
        "overlap_throughput_ratio": round(overlap, 3),
        "overlap_throughput_ratio_vs_inproc_2t": round(statistics.median(ratios2), 3),
        "overlap_throughput_ratio_fixed_split": round(statistics.median(ratios_fixed), 3),
        "overlap_throughput_ratio_bound": round(statistics.median(b["ratio_bound"] for b in bounds), 3),
        "overlap_throughput_ratio_bound_no_fill": round(statistics.median(b["ratio_bound_no_fill"] for b in bounds),
                                                        3),
        "overlap_throughput_ratio_stages": round(statistics.median(b["ratio_stages"] for b in bounds), 3),
        "second_thread_speedup": {k: round(statistics.median(v), 3) for k, v in speedups.items()},
        "inproc_switching_cost": round(statistics.median(switching), 3),
        "overlap_bounds": bounds,
        "overlap_throughput_ratios": [round(x, 3) for x in ratios],
        "overlap_throughput_ratios_fixed_split": [round(x, 3) for x in ratios_fixed],
        "itl_p99_under_video_ratio": round(statistics.median(itl_ratios), 3),
        "itl_p99_under_video_ratio_shared": round(statistics.median(itl_shared), 3),
        "itl_p99_ms_alone_under_video": itl_ms,
        "itl_p99_under_video_ratio_inproc": round(statistics.median(itl_inproc), 3),
        "itl_video_steps": video_steps, "itl_video_outlasted_chat": all(covered),
        "ray_over_process": None if ray_ratio is None else round(ray_ratio, 3),
        "ray_cpu_s": ray_cpu_s,
    }
    if ray_note:
        result["ray_error"] = ray_note
    print(json.dumps(result))


if __name__ == "__main__":
    main()
