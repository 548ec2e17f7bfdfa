"""Serving benchmark: `omni serve` over HTTP against the same workload in-process, and against
`transformers serve` (continuous batching on) on the same local checkpoint, with the same streaming clients.

The workload has the shape of benchmarks/ar_serving.py: N requests (64; 16 with --quick), prompts of 32-256
tokens, outputs of 32-256 tokens (16-64 with --quick), EOS ignored, all sent at once by concurrent clients.
Prompts are text made of the checkpoint tokenizer's own pieces; omni gets their token ids (request parameter
`prompt_token_ids`, raw, no chat template) and transformers the text, so both prefill the same tokens. Prefix
caching is off so that repeated rounds do not hit a warm cache.

Systems run alternately (in-process, omni HTTP, transformers serve; then again), so load that comes and goes on
a shared machine hurts each alike; each ratio is the median of the per-round ratios. TTFT and inter-token
latency (time between streamed chunks that carry text) are measured by the clients (`*_samples`: how many).
The checkpoint has the Qwen2.5-0.5B shape but the demo tokenizer's small vocabulary, as when the figures in
docs/serving.md were measured (ar_serving.py's has the real Qwen2.5 tokenizer's 151936). The last line printed is
one JSON object.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402

from omni_kernel import Omni, RequestFailed, RequestFinished, TokenDelta  # noqa: E402
from omni_kernel.plugins import load_host  # noqa: E402

CONFIG = {"ar_dtype": "bf16", "ar_device": "cpu", "ar_kv_backend": "paged", "ar_kv_memory": "1GiB",
          "ar_prefix_caching": False, "ar_max_num_batched_tokens": 512, "ar_max_num_seqs": 64}


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def workload(tokenizer, n: int, prompt_range, output_range, seed: int = 0):
    """[(text, ids, max_tokens)]: text whose raw encoding is `ids` (checked), of the asked length."""
    rng = random.Random(seed)
    pieces = sorted(t for t in tokenizer.get_vocab() if t.isascii() and t.isalpha() and len(t) > 2)
    out = []
    for _ in range(n):
        want = rng.randint(*prompt_range)
        words = []
        while True:
            words.append(rng.choice(pieces))
            ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
            if len(ids) >= want:
                break
        text = " ".join(words)
        out.append((text, tokenizer.encode(text, add_special_tokens=False), rng.randint(*output_range)))
    return out


def ensure_checkpoint(layers: int) -> Path:
    """A random bf16 checkpoint of the Qwen2.5-0.5B shape (benchmarks/ar_serving.py) except its vocabulary, which
    is its small tokenizer's: every generated id then decodes to text, so streamed chunks (TTFT, ITL) exist."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from omni_kernel.files import cache_dir
    from omni_qwen.demo import train_tokenizer

    path = cache_dir() / "bench" / f"qwen2.5-0.5b-shape-tokenizer-vocab-{layers}l"
    if (path / "config.json").is_file():
        return path
    tokenizer = train_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=layers, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
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
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CHILDREN: list[Process] = []  # every server this run started: stopped however the run ends


def stop_children() -> None:
    for child in reversed(CHILDREN):
        child.stop(timeout=10)


def on_sigterm(signum, frame) -> None:
    """SIGTERM (a time limit) or SIGHUP ends the run like Ctrl-C: the servers it started are stopped, not left
    holding their models' memory."""
    raise SystemExit(128 + signum)


def handle_signals() -> None:
    for name in ("SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), on_sigterm)


class Process:
    def __init__(self, name: str, argv: list[str], port: int, log: Path):
        self.name, self.url, self.log = name, f"http://127.0.0.1:{port}", log
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
        CHILDREN.append(self)

    def wait(self, timeout: float = 600) -> Process:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start within {timeout}s")

    def stop(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


async def http_run(url: str, model: str, reqs, token_ids: bool) -> dict:
    """All requests at once, streamed; returns tokens/s (from usage), TTFTs and inter-chunk gaps."""
    ttfts, gaps, tokens = [], [], []
    limits = httpx.Limits(max_connections=len(reqs) + 4, max_keepalive_connections=len(reqs) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        async def one(text, ids, max_tokens):
            body = {"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0,
                    "stream_options": {"include_usage": True}}
            if token_ids:
                body.update(prompt="", prompt_token_ids=ids, ignore_eos=True)
            else:
                body.update(prompt=text)
            start = time.perf_counter()
            last, usage, chunks = None, None, 0
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:300]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if data.get("usage"):
                        usage = data["usage"]
                    if not data.get("choices"):
                        continue
                    now = time.perf_counter()
                    if data["choices"][0].get("text") or chunks == 0 and data["choices"][0].get("finish_reason"):
                        if last is None:
                            ttfts.append(now - start)
                        else:
                            gaps.append(now - last)
                        last, chunks = now, chunks + 1
            tokens.append(usage["completion_tokens"] if usage else chunks)

        start = time.perf_counter()
        await asyncio.gather(*[one(*req) for req in reqs])
        elapsed = time.perf_counter() - start
    return {"tok_s": sum(tokens) / elapsed, "ttft": ttfts, "itl": gaps, "tokens": sum(tokens), "s": elapsed}


def inprocess_run(omni: Omni, reqs, tag: str) -> dict:
    start = time.perf_counter()
    sent = {}
    for i, (_, ids, max_tokens) in enumerate(reqs):
        rid = f"{tag}{i}"
        omni.submit(omni.request("", request_id=rid, prompt_token_ids=ids, max_tokens=max_tokens, ignore_eos=True))
        sent[rid] = time.perf_counter()
    last: dict[str, float] = {}
    ttfts, gaps, tokens = [], [], 0
    while omni.has_unfinished():
        events = omni.step()
        now = time.perf_counter()
        for event in events:
            if isinstance(event, TokenDelta):
                if event.request_id in last:
                    gaps.append(now - last[event.request_id])
                else:
                    ttfts.append(now - sent[event.request_id])
                last[event.request_id] = now
            elif isinstance(event, RequestFinished):
                tokens += event.result.trace["ar.output_tokens"]
            elif isinstance(event, RequestFailed):
                raise RuntimeError(f"{event.request_id}: {event.error}")
    elapsed = time.perf_counter() - start
    return {"tok_s": tokens / elapsed, "ttft": ttfts, "itl": gaps, "tokens": tokens, "s": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 requests, outputs of 16-64 tokens, 2 rounds")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=0, help="A B A B rounds (default 2 quick, 3 full)")
    parser.add_argument("--no-transformers", action="store_true", help="skip `transformers serve`")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="omni: %(message)s", stream=sys.stderr)
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    quick = args.quick
    n, rounds = (16, args.rounds or 2) if quick else (64, args.rounds or 3)
    t0 = time.perf_counter()
    path = ensure_checkpoint(args.layers)
    tokenizer = AutoTokenizer.from_pretrained(path)
    reqs = workload(tokenizer, n, (32, 256), (16, 64) if quick else (32, 256))
    warm = workload(tokenizer, 2, (32, 64), (4, 4), seed=9)
    figures: dict = {"quick": quick, "requests": n, "rounds": rounds, "threads": torch.get_num_threads(),
                     "prompt_tokens": sum(len(ids) for _, ids, _ in reqs),
                     "output_tokens": sum(m for _, _, m in reqs)}
    logs = Path(os.environ.get("OMNI_CACHE_DIR", Path.home() / ".cache" / "omni")) / "bench" / "serve-logs"
    logs.mkdir(parents=True, exist_ok=True)

    omni = Omni("ar_text", host=load_host(), ar_model=str(path), **CONFIG)
    inprocess_run(omni, warm, "warm")
    omni_bin = Path(sys.executable).parent / "omni"
    config_flags = [a for k, v in CONFIG.items() for a in ("-c", f"{k}={v}")]
    port = free_port()
    server = Process("omni serve", [str(omni_bin), "serve", "--pipeline", "ar_text", "--ar-model", str(path),
                                    "--port", str(port), "--log-level", "warning", *config_flags], port,
                     logs / "omni.log").wait()
    systems = {"inprocess": lambda: inprocess_run(omni, reqs, f"r{time.monotonic_ns()}-"),
               "omni_http": lambda: asyncio.run(http_run(server.url, "ar_text", reqs, token_ids=True))}
    hf = None
    note = None
    if args.no_transformers:
        note = "skipped (--no-transformers)"
    elif shutil.which("transformers", path=str(Path(sys.executable).parent)) is None:
        note = "the `transformers` command is not installed in this environment"
    else:
        try:
            hf_port = free_port()
            hf = Process("transformers serve", [str(Path(sys.executable).parent / "transformers"), "serve", str(path),
                                                "--continuous-batching", "--device", "cpu", "--dtype", "bfloat16",
                                                "--port", str(hf_port), "--host", "127.0.0.1"], hf_port,
                         logs / "transformers.log").wait()
            asyncio.run(http_run(hf.url, str(path), warm, token_ids=False))  # its first request warms up CB
            systems["transformers_serve"] = lambda: asyncio.run(http_run(hf.url, str(path), reqs, token_ids=False))
        except Exception as exc:  # noqa: BLE001 - the baseline is optional: say exactly why it is missing
            note = f"transformers serve could not run: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
            if hf is not None:
                hf.stop()
                hf = None
    asyncio.run(http_run(server.url, "ar_text", warm, token_ids=True))
    say(f"ready in {time.perf_counter() - t0:.0f}s: {n} requests, {figures['prompt_tokens']} prompt and "
        f"{figures['output_tokens']} output tokens, {rounds} rounds of {', '.join(systems)}")

    runs: dict[str, list[dict]] = {name: [] for name in systems}
    try:
        for r in range(rounds):
            for name, run in systems.items():
                result = run()
                runs[name].append(result)
                say(f"round {r + 1} {name}: {result['tok_s']:.1f} tok/s ({result['tokens']} tokens, "
                    f"{result['s']:.1f}s)")
    finally:
        server.stop()
        if hf is not None:
            hf.stop()

    def median_ratio(a, b):
        return statistics.median(x["tok_s"] / y["tok_s"] for x, y in zip(runs[a], runs[b]))

    for name, results in runs.items():
        ttft = [t for r in results for t in r["ttft"]]
        itl = [t for r in results for t in r["itl"]]
        figures[f"{name}_tok_s"] = statistics.median(r["tok_s"] for r in results)
        for label, values in (("ttft", ttft), ("itl", itl)):
            for q in (50, 99):
                value = pct(values, q / 100)
                figures[f"{name}_{label}_p{q}_ms"] = None if value is None else value * 1000
            figures[f"{name}_{label}_samples"] = len(values)
    figures["http_over_inprocess"] = median_ratio("omni_http", "inprocess")
    figures["ratio_vs_transformers_serve"] = (median_ratio("omni_http", "transformers_serve")
                                              if "transformers_serve" in runs else None)
    figures["transformers_serve_note"] = note or ("continuous batching on, same checkpoint and clients, text prompts "
                                                  "of the same tokens")
    figures["total_s"] = time.perf_counter() - t0
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    handle_signals()
    try:
        main()
    finally:
        stop_children()
