"""AR serving benchmark: this runtime's paged engine against HF transformers on the same random-weight model.

Builds a random-weight checkpoint of the Qwen2.5-0.5B-Instruct shape in memory (bf16) and measures, in one
process: (a) HF `generate` one request at a time (on a subset), (b) HF `generate` in static left-padded batches
of 32 in arrival order, (c) transformers' own continuous batching (the manager behind `generate_batch`, with
per-request max_new_tokens), (d) this runtime. Then TTFT of a shared-prefix workload with and without prefix
caching, the runtime's decode-only step at batch 32 against a bare HF forward on a contiguous cache, and one
request alone. EOS is ignored everywhere. The last line printed is one JSON object.

    .venv/bin/python benchmarks/ar_serving.py --quick
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time

import torch
from transformers import DynamicCache, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from omni_kernel.events import StageFinished
from omni_kernel.params import ARParams
from omni_kernel.request import StageInput
from omni_qwen.paged.engine import build_paged_engine
from omni_qwen.paged.qwen2 import PagedQwen2

log = logging.getLogger("omni")


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def build_model(layers: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True,
                         rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Qwen2ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0, do_sample=False)
    return model


def workload(n: int, prompt_range, output_range, seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(1000, 150000) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
            for _ in range(n)]


def hf_generate(model, batch):
    """Left-padded greedy generate over a batch of (prompt, max_tokens); returns the useful output tokens."""
    width = max(len(p) for p, _ in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (prompt, _) in enumerate(batch):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=max(m for _, m in batch), min_new_tokens=1,
                       do_sample=False, eos_token_id=None, pad_token_id=0)
    return sum(m for _, m in batch)


def hf_sequential(model, reqs) -> float:
    start, tokens = time.perf_counter(), 0
    for req in reqs:
        tokens += hf_generate(model, [req])
    return tokens / (time.perf_counter() - start)


def hf_static(model, reqs, batch: int = 32) -> float:
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(reqs), batch):
        tokens += hf_generate(model, reqs[i:i + batch])
    return tokens / (time.perf_counter() - start)


def hf_continuous(model, reqs) -> float | None:
    try:
        config = GenerationConfig(eos_token_id=-1, pad_token_id=0, do_sample=False,
                                  max_new_tokens=max(m for _, m in reqs))
        with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
            start = time.perf_counter()
            ids = [manager.add_request(prompt, request_id=f"cb{i}", max_new_tokens=m, eos_token_id=-1)
                   for i, (prompt, m) in enumerate(reqs)]
            tokens, finished = 0, set()
            while len(finished) < len(ids):
                result = manager.get_result(timeout=60)
                if result is None:
                    raise RuntimeError("transformers continuous batching stalled")
                if result.is_finished() and result.request_id not in finished:
                    finished.add(result.request_id)
                    tokens += len(result.generated_tokens)
            elapsed = time.perf_counter() - start
        model.set_attn_implementation("sdpa")
        return tokens / elapsed
    except Exception as exc:  # noqa: BLE001 - the baseline is optional: report it missing, keep the run
        say(f"hf continuous batching failed: {type(exc).__name__}: {exc}")
        return None


def runtime_engine(paged, kv_bytes: int, caching: bool = True, budget: int = 512, seqs: int = 64):
    return build_paged_engine(paged, kv_memory_bytes=kv_bytes, block_size=16, max_num_batched_tokens=budget,
                              max_num_seqs=seqs, enable_prefix_caching=caching)


def run_runtime(paged, reqs, kv_bytes: int, budget: int):
    engine, executor, scheduler = runtime_engine(paged, kv_bytes, budget=budget)
    start = time.perf_counter()
    for i, (prompt, m) in enumerate(reqs):
        engine.add_request(StageInput(f"q{i}", "", params=ARParams(max_tokens=m),
                                      options={"prompt_token_ids": prompt}))
    reserved = stored = 0
    ttfts, tokens = [], 0
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, StageFinished):
                ttfts.append(event.output.trace["ar.ttft_ms"])
                tokens += event.output.trace["ar.output_tokens"]
        reserved += scheduler.blocks.num_used * scheduler.blocks.block_size
        stored += sum(s.num_computed for s in scheduler.running)
    elapsed = time.perf_counter() - start
    sizes = [n for n, _ in executor.step_log]
    return {"tok_s": tokens / elapsed, "ttfts": ttfts, "kv_ratio": reserved / max(stored, 1),
            "steps": len(sizes), "mean_batch": statistics.mean(sizes), "preemptions": scheduler.num_preemptions}


def prefix_ttft(paged, n: int, system_len: int, user_len: int, caching: bool, kv_bytes: int) -> float:
    rng = random.Random(1)
    system = [rng.randrange(1000, 150000) for _ in range(system_len)]
    engine, _, _ = runtime_engine(paged, kv_bytes, caching=caching, budget=1024)
    ttfts = []
    for i in range(n):
        prompt = system + [rng.randrange(1000, 150000) for _ in range(user_len)]
        engine.add_request(StageInput(f"p{i}", "", params=ARParams(max_tokens=1),
                                      options={"prompt_token_ids": prompt}))
        while engine.has_unfinished():
            for event in engine.step():
                if isinstance(event, StageFinished):
                    ttfts.append(event.output.trace["ar.ttft_ms"])
    return statistics.median(ttfts[1:] if caching else ttfts)


def decode_efficiency(model, paged, batch: int, context: int, steps: int, kv_bytes: int, profile: bool):
    """Runtime decode-only step (scheduler + executor + model) against HF's bare forward, same contexts."""
    rng = random.Random(2)
    engine, executor, scheduler = runtime_engine(paged, kv_bytes, budget=2048, seqs=batch)
    for i in range(batch):
        engine.add_request(StageInput(f"d{i}", "", params=ARParams(max_tokens=steps * 3 + 4),
                                      options={"prompt_token_ids": [rng.randrange(1000, 150000)
                                                                    for _ in range(context)]}))
    while any(s.num_computed < s.num_prompt for s in scheduler.sequences.values()) or scheduler.waiting:
        engine.step()
    engine.step()  # warm
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    runtime_ms = (time.perf_counter() - start) / steps * 1000
    table = None
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                engine.step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)

    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    cache = DynamicCache(config=config)
    for layer in range(config.num_hidden_layers):
        k = torch.randn(batch, config.num_key_value_heads, context + 1, head_dim, dtype=torch.bfloat16)
        cache.update(k, k.clone(), layer)
    ids = torch.randint(1000, 150000, (batch, 1))
    with torch.inference_mode():
        def hf_step(offset):
            pos = torch.full((batch, 1), context + 1 + offset)
            model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
        hf_step(0)
        start = time.perf_counter()
        for i in range(steps):
            hf_step(i + 1)
        hf_ms = (time.perf_counter() - start) / steps * 1000
    return runtime_ms, hf_ms, table


def single_request(model, paged, prompt_len: int, out_len: int, kv_bytes: int):
    rng = random.Random(3)
    prompt = [rng.randrange(1000, 150000) for _ in range(prompt_len)]
    hf_generate(model, [(prompt[:8], 2)])  # warm
    start = time.perf_counter()
    hf_generate(model, [(prompt, out_len)])
    hf_tok_s = out_len / (time.perf_counter() - start)
    engine, _, _ = runtime_engine(paged, kv_bytes, caching=False)
    start = time.perf_counter()
    engine.add_request(StageInput("one", "", params=ARParams(max_tokens=out_len),
                                  options={"prompt_token_ids": prompt}))
    while engine.has_unfinished():
        engine.step()
    return out_len / (time.perf_counter() - start), hf_tok_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a reduced run (under 5 minutes)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--layers", type=int, default=24)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="omni: %(message)s", stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    quick = args.quick
    n = 16 if quick else 64
    reqs = workload(n, (32, 256), (32, 256) if not quick else (16, 64))
    kv_bytes = 1 << 30

    t0 = time.perf_counter()
    model = build_model(args.layers)
    say(f"model built in {time.perf_counter() - t0:.1f}s: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
        f"parameters, bf16, {torch.get_num_threads()} threads")
    paged = PagedQwen2(model)
    figures: dict = {"quick": quick, "requests": n, "threads": torch.get_num_threads()}

    warm = [(list(range(1000, 1100)), 4)]
    run_runtime(paged, warm, 64 << 20, budget=512)
    hf_generate(model, warm)
    stage = time.perf_counter()
    run = run_runtime(paged, reqs, kv_bytes, budget=512)
    figures.update(runtime_tok_s=run["tok_s"], ttft_p50_ms=statistics.median(run["ttfts"]),
                   ttft_p99_ms=sorted(run["ttfts"])[min(len(run["ttfts"]) - 1, int(0.99 * len(run["ttfts"])))],
                   kv_reserved_over_stored=run["kv_ratio"], runtime_steps=run["steps"],
                   runtime_mean_batch=run["mean_batch"], runtime_preemptions=run["preemptions"])
    say(f"runtime: {run['tok_s']:.1f} tok/s, {run['steps']} steps ({time.perf_counter() - stage:.0f}s)")

    stage = time.perf_counter()
    figures["hf_sequential_tok_s"] = hf_sequential(model, reqs[:2 if quick else 4])
    say(f"hf sequential: {figures['hf_sequential_tok_s']:.1f} tok/s ({time.perf_counter() - stage:.0f}s)")
    stage = time.perf_counter()
    figures["hf_static_tok_s"] = hf_static(model, reqs)
    say(f"hf static 32: {figures['hf_static_tok_s']:.1f} tok/s ({time.perf_counter() - stage:.0f}s)")
    stage = time.perf_counter()
    figures["hf_cb_tok_s"] = hf_continuous(model, reqs)
    say(f"hf continuous batching: {figures['hf_cb_tok_s']} tok/s ({time.perf_counter() - stage:.0f}s)")

    stage = time.perf_counter()
    prefix_n, system_len = (6, 512) if quick else (16, 512)
    cold = prefix_ttft(paged, prefix_n, system_len, 32, caching=False, kv_bytes=256 << 20)
    warm = prefix_ttft(paged, prefix_n, system_len, 32, caching=True, kv_bytes=256 << 20)
    figures.update(prefix_ttft_cold_ms=cold, prefix_ttft_cached_ms=warm, prefix_ttft_speedup=cold / warm)
    say(f"prefix TTFT: {cold:.0f} ms cold, {warm:.0f} ms cached ({time.perf_counter() - stage:.0f}s)")

    stage = time.perf_counter()
    context = 96 if quick else 144
    runtime_ms, hf_ms, table = decode_efficiency(model, paged, 32, context, 4 if quick else 8, kv_bytes, True)
    figures.update(decode_step_ms=runtime_ms, hf_decode_step_ms=hf_ms, decode_efficiency=hf_ms / runtime_ms)
    say(f"decode step at batch 32, context {context}: runtime {runtime_ms:.1f} ms, HF {hf_ms:.1f} ms "
        f"({time.perf_counter() - stage:.0f}s)")
    say(table)

    stage = time.perf_counter()
    one, hf_one = single_request(model, paged, 128, 32 if quick else 128, kv_bytes)
    figures.update(single_runtime_tok_s=one, single_hf_tok_s=hf_one, single_request_ratio=one / hf_one)
    say(f"single request: runtime {one:.1f} tok/s, HF {hf_one:.1f} tok/s ({time.perf_counter() - stage:.0f}s)")

    runtime = figures["runtime_tok_s"]
    figures.update(ratio_vs_sequential=runtime / figures["hf_sequential_tok_s"],
                   ratio_vs_static=runtime / figures["hf_static_tok_s"],
                   ratio_vs_hf_cb=runtime / figures["hf_cb_tok_s"] if figures["hf_cb_tok_s"] else None,
                   total_s=time.perf_counter() - t0)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    main()
