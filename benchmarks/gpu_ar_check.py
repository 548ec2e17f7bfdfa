"""GPU check (not in CI): the AR engine (ar_text, omni_qwen) on a CUDA device, against HF transformers there.

The model is a random-weight checkpoint of SmolLM2-135M-Instruct's shape (30 layers, hidden 576, 9 heads / 3 KV
heads, intermediate 1536, vocab 49152, tied embeddings, rope_theta 1e5, context 8192), built here with a fixed
seed and saved as bf16 safetensors with save_pretrained (`--arch qwen2`, the default: a Qwen2ForCausalLM, whose
zero q/k/v biases make it a Llama, which the paged engine serves; `--arch llama`: a LlamaForCausalLM, served by
whichever backend the plugin picks for it). Its tokenizer is a byte-level BPE whose 49152 ids all decode to
text. The real SmolLM2 weights do not travel to a device machine: the registry's GGUF is 98 MB and its bf16
safetensors 269 MB, over the 64 MiB the tree may carry; `--ar-model DIR` uses a real directory where one exists.

One JSON line per section as it finishes, then one with all of them (the last line printed):

- `checkpoint`: what was built or loaded (architecture, parameters, seconds);
- `greedy`: per dtype (fp32, bf16) and KV backend (paged, dynamic_cache): four prompts of different lengths served
  together through Omni("ar_text") against HF `generate` for each alone on the same loaded model and device:
  `equal`, the tokens that match before the first difference, and HF's top-2 logit gap there (a tie in bf16 is
  rounding, not a bug); `kv_pool` is the pool's line that omni_qwen logs when the first request arrives;
- `throughput`: benchmarks/ar_serving.py's workload (prompts 32-256, outputs 32-256, EOS ignored) through the
  runtime against HF `generate` one request at a time (a subset) and in static left-padded batches of 32, bf16,
  the median of `--rounds` alternating rounds (the vLLM anchor: 14-24x HF on a GPU).

    HF_HUB_OFFLINE=1 python benchmarks/gpu_ar_check.py [--device cpu] [--ar-model DIR] [--arch llama]

`--device cpu` is a dry run of the same code: 4 layers, fewer and shorter requests. The figures are reported,
not judged.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

SMOLLM2_SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                 "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
                 "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
INIT_RANGE = 0.05  # HF's default 0.02 makes a random model repeat one token; 0.05 gives varied greedy text
ROPE_THETA = 1e5
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PROMPT_LENGTHS = (5, 40, 130, 300)  # one chunk, a few blocks, and one longer than a step's 256-token share


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def emit(section: str, value) -> None:
    print(json.dumps({section: value}), flush=True)


def full_vocab_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE of exactly `vocab_size` ids: the 256 bytes, random merges of a-z and ' a'-' z' (ASCII
    words), then the three ChatML specials; so a random model's output streams as text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2Tokenizer

    letters = list("abcdefghijklmnopqrstuvwxyz")
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [("Ġ", c) for c in letters]  # Ġ is ByteLevel's space
    for a, b in merges:
        vocab[a + b] = len(vocab)
    pool, rng = letters + [a + b for a, b in merges], random.Random(seed)
    while len(vocab) < vocab_size - len(SPECIAL_TOKENS):
        a, b = rng.choice(pool), rng.choice(letters)
        if a + b not in vocab and len(a) < 8:
            vocab[a + b] = len(vocab)
            merges.append((a, b))
            pool.append(a + b)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    from omni_qwen.demo import CHATML_TEMPLATE

    tokenizer = Qwen2Tokenizer(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def ensure_checkpoint(arch: str = "qwen2", layers: int = 30, seed: int = 0) -> Path:
    """The SmolLM2-shaped random checkpoint in $OMNI_CACHE_DIR/gpu-check/, built once (bf16, save_pretrained)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from omni_kernel.util.files import cache_dir
    from omni_qwen.model import quiet_progress

    path = cache_dir() / "gpu-check" / f"smollm2-shape-{arch}-{layers}l-seed{seed}"
    if (path / "config.json").is_file():
        return path
    tokenizer = full_vocab_tokenizer(SMOLLM2_SHAPE["vocab_size"])
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    shape = {**SMOLLM2_SHAPE, "num_hidden_layers": layers, "bos_token_id": None, "eos_token_id": eos,
             "pad_token_id": pad, "initializer_range": INIT_RANGE,
             "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA}}
    config, cls = (Qwen2Config(**shape), Qwen2ForCausalLM) if arch == "qwen2" else \
        (LlamaConfig(**shape, head_dim=64, attention_bias=False, mlp_bias=False), LlamaForCausalLM)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(config).to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, bos_token_id=None)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with quiet_progress():
        model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)
    return path


class PoolLine(logging.Handler):
    """Keeps the KV pool line omni_qwen logs when a stage gets its first request."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "KV backend" in message:
            self.lines.append(message)


def greedy(path: Path, device: str, dtype: str, backend: str, max_tokens: int, pool: PoolLine) -> dict:
    """Four prompts served together through the runtime, each against HF generate alone, same model."""
    import torch
    from ar_serving import hf_model_of

    from omni_kernel import Omni, RequestFailed, RequestFinished
    from omni_kernel.plugins import load_host

    omni = Omni("ar_text", host=load_host(), ar_model=str(path), ar_dtype=dtype, ar_device=device,
                ar_kv_backend=backend)
    model = hf_model_of(omni)
    vocab = model.config.vocab_size
    rng = random.Random(7)
    prompts = {f"g{n}": [rng.randrange(300, vocab - 3) for _ in range(n)] for n in PROMPT_LENGTHS}
    mark = len(pool.lines)
    for rid, prompt in prompts.items():
        omni.submit(omni.request("", request_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens,
                                 temperature=0.0, ignore_eos=True))
    ours, traces = {}, {}
    start = time.perf_counter()
    while omni.has_unfinished():
        for event in omni.step():
            if isinstance(event, RequestFailed):
                raise RuntimeError(f"{event.request_id}: {event.error}")
            if isinstance(event, RequestFinished):
                ours[event.request_id] = event.result.output.data["token_ids"]
                traces[event.request_id] = event.result.trace
    runtime_s = time.perf_counter() - start
    rows = {}
    for rid, prompt in prompts.items():
        ids = torch.tensor([prompt], device=model.device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        theirs = out[0, len(prompt):].tolist()
        same = next((i for i, (a, b) in enumerate(zip(ours[rid], theirs)) if a != b), min(len(ours[rid]),
                                                                                           len(theirs)))
        row = {"prompt_tokens": len(prompt), "equal": ours[rid] == theirs, "matching_prefix": same,
               "tokens": len(theirs)}
        if not row["equal"] and same < len(theirs):  # HF's own top-2 gap where the two first differ
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + theirs[:same]], device=model.device)).logits[0, -1].float()
            top = logits.topk(2).values.tolist()
            row["hf_top2_gap_at_diff"] = round(top[0] - top[1], 5)
        rows[rid] = row
    trace = next(iter(traces.values()))
    result = {"backend": trace.get("ar.kv_cache_backend"), "dtype": trace.get("ar.dtype"),
              "all_equal": all(r["equal"] for r in rows.values()), "runtime_s": round(runtime_s, 3),
              "requests": rows, "kv_pool": pool.lines[mark] if len(pool.lines) > mark else None,
              "decoded_sample": omni.graph.stages["generate"].outputs.decode(ours["g5"][:12])}
    omni.close()
    return result


def throughput(path: Path, device: str, quick: bool, rounds: int, deadline: float) -> dict:
    """ar_serving.py's throughput systems (runtime, HF one at a time, HF static batches of 32), bf16; a round
    after the first only if it fits before `deadline` (time.monotonic())."""
    import ar_serving
    from ar_serving import Runtime, hf_generate, hf_model_of, hf_sequential, hf_static, run_runtime, workload

    runtime = Runtime(path, device=device, dtype="bf16")
    warm = runtime.omni(kv_memory="64MiB")
    model = hf_model_of(warm)
    vocab = model.config.vocab_size - 3
    n = 8 if quick else 64
    reqs = workload(n, (32, 256) if not quick else (16, 64), (32, 256) if not quick else (4, 8), vocab=vocab)
    for i, (prompt, m) in enumerate([(list(range(1000, 1256)), 4), (list(range(2000, 2256)), 4)]):
        ar_serving.submit(warm, f"w{i}", prompt, m)
    ar_serving.drain(warm)
    hf_generate(model, [(list(range(1000, 1256)), 4)] * 2)
    systems = {"runtime": lambda: run_runtime(runtime, reqs, budget=512),
               "hf_sequential": lambda: hf_sequential(model, reqs[:2 if quick else 4]),
               "hf_static": lambda: hf_static(model, reqs)}
    tok_s: dict[str, list] = {name: [] for name in systems}
    details, done, last = {}, 0, 0.0
    for r in range(rounds):
        began = time.monotonic()
        if r and began + last > deadline:
            break
        for name in (list(systems) if r % 2 == 0 else list(reversed(systems))):
            start = time.perf_counter()
            out = systems[name]()
            if name == "runtime":
                details, out = out, out["tok_s"]
            tok_s[name].append(out)
            say(f"round {r + 1} {name}: {out:.1f} tok/s ({time.perf_counter() - start:.1f}s)")
        last, done = time.monotonic() - began, r + 1
    figures = {"requests": n, "rounds": done, **{f"{k}_tok_s": round(statistics.median(v), 1)
                                                   for k, v in tok_s.items()}}
    for name, key in (("hf_sequential", "ratio_vs_sequential"), ("hf_static", "ratio_vs_static")):
        figures[key] = round(statistics.median(a / b for a, b in zip(tok_s["runtime"], tok_s[name])), 3)
    figures.update(ttft_p50_ms=round(statistics.median(details["ttfts"]), 1), runtime_steps=details["steps"],
                   runtime_mean_batch=round(details["mean_batch"], 1),
                   runtime_forward_share=round(details["forward_share"], 3),
                   runtime_preemptions=details["preemptions"])
    warm.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--ar-model", default=None, help="a real causal-LM directory instead of the random one")
    parser.add_argument("--arch", default="qwen2", choices=("qwen2", "llama"),
                        help="class of the random checkpoint (qwen2: served by the paged engine today)")
    parser.add_argument("--layers", type=int, default=None, help="layers of the random checkpoint (cuda 30, cpu 4)")
    parser.add_argument("--rounds", type=int, default=None, help="throughput rounds (cuda 2, cpu 1)")
    parser.add_argument("--budget-s", type=float, default=1e9, help="a throughput round starts only if it fits")
    args = parser.parse_args()
    import torch

    logging.basicConfig(level=logging.INFO, format="omni: %(message)s", stream=sys.stderr)
    pool = PoolLine()
    logging.getLogger("omni").addHandler(pool)
    cpu = args.device == "cpu"
    report: dict = {"check": "gpu_ar", "device": args.device, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    start, deadline = time.perf_counter(), time.monotonic() + args.budget_s
    if args.ar_model:
        path, built = Path(args.ar_model).expanduser().resolve(), False
    else:
        path, built = ensure_checkpoint(args.arch, args.layers or (4 if cpu else 30)), True
    config = json.loads((path / "config.json").read_text())
    report["checkpoint"] = {"path": str(path), "random_weights": built, "architectures": config.get("architectures"),
                            "layers": config.get("num_hidden_layers"), "vocab_size": config.get("vocab_size"),
                            "ready_s": round(time.perf_counter() - start, 1),
                            "why_not_real_smollm2": None if not built else
                            "real SmolLM2 weights do not fit the 64 MiB that travels (GGUF 98 MB, bf16 269 MB)"}
    emit("checkpoint", report["checkpoint"])
    report["greedy"] = {}
    for dtype in ("fp32", "bf16"):
        for backend in ("paged", "dynamic_cache"):
            key = f"{dtype}_{backend}"
            try:
                report["greedy"][key] = greedy(path, args.device, dtype, backend, 8 if cpu else 32, pool)
            except Exception as exc:  # noqa: BLE001 - recorded; the other runs go on
                report["greedy"][key] = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
            emit(f"greedy_{key}", report["greedy"][key])
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    try:
        report["throughput"] = throughput(path, args.device, quick=cpu, rounds=args.rounds or (1 if cpu else 2),
                                          deadline=deadline)
    except Exception as exc:  # noqa: BLE001
        report["throughput"] = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
    emit("throughput", report["throughput"])
    if torch.cuda.is_available():
        report["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    report["total_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
