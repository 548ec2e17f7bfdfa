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

    from omni_kernel.util.files import cache_dir
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


AIPERF_TOKENIZER = "omni-bench/tokenizer"  # the name aiperf is given; its files sit in an HF-cache layout


def aiperf_command(spec: str) -> Path:
    """The `aiperf` command: PATH itself, or PATH/bin/aiperf when PATH is a virtual environment."""
    path = Path(spec).expanduser()
    exe = path / "bin" / "aiperf" if path.is_dir() else path
    if not exe.is_file():
        raise SystemExit(f"--aiperf {spec}: no aiperf command there (install aiperf==0.13.0 into a venv of its own: "
                         "python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0)")
    return exe


def hf_cache_layout(tokenizer_dir: Path, home: Path, name: str) -> None:
    """The tokenizer as the hub cache holds `name` (offline, aiperf takes only a repo id: FACTS.md)."""
    repo = home / "hub" / ("models--" + name.replace("/", "--"))
    shutil.rmtree(repo, ignore_errors=True)
    snapshot = repo / "snapshots" / "local"
    snapshot.mkdir(parents=True)
    for file in tokenizer_dir.iterdir():
        if file.is_file() and (file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "added_tokens"))
                               or file.name == "chat_template.jinja"):  # no config.json: keep its own class
            shutil.copy(file, snapshot / file.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("local")


def server_generated_tokens(url: str, model: str) -> float:
    """omni serve's own count of generated tokens (/metrics), to check a client's count against."""
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("omni_generated_tokens_total{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def aiperf_run(exe: Path, url: str, model: str, tokenizer_dir: Path, n: int, isl: int, osl: int, logs: Path,
               server_counts: bool = True) -> dict:
    """aiperf (NVIDIA's load client, a third party) against omni serve's /v1/completions, streamed: n requests at
    concurrency n, prompts of `isl` tokens, `osl` new tokens each (EOS ignored). Its TTFT / ITL / latency
    percentiles and throughput, with its completion-token count beside the server's."""
    home = logs / "aiperf-hf"
    hf_cache_layout(tokenizer_dir, home, AIPERF_TOKENIZER)
    artifacts = logs / "aiperf-artifacts"
    shutil.rmtree(artifacts, ignore_errors=True)
    before = server_generated_tokens(url, model)
    argv = [str(exe), "profile", "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
            "--tokenizer", AIPERF_TOKENIZER, "--request-count", str(n), "--concurrency", str(n),
            "--isl", str(isl), "--isl-stddev", "0", "--osl", str(osl), "--osl-stddev", "0",
            "--extra-inputs", '{"ignore_eos": true, "temperature": 0}', "--random-seed", "0",
            "--artifact-dir", str(artifacts), "--ui-type", "none", "--no-server-metrics"]
    if server_counts:  # its ITL and throughput from the tokens generated, not from re-tokenized text
        argv.append("--use-server-token-count")
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    started = time.perf_counter()
    with open(logs / "aiperf.log", "wb") as log:
        code = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=3600).returncode
    if code != 0:
        raise RuntimeError(f"aiperf exited with {code}: {(logs / 'aiperf.log').read_text(errors='replace')[-1500:]}")
    served = server_generated_tokens(url, model) - before
    summary = json.loads(next(artifacts.rglob("profile_export_aiperf.json")).read_text())
    return {"argv": argv, "summary": summary, "server_tokens": served, "s": time.perf_counter() - started}


def aiperf_figures(result: dict, n: int, osl: int) -> dict:
    """The figures that matter from aiperf's summary (its own names), and the token-count agreement."""
    summary = result["summary"]
    metrics = summary.get("records", summary)

    def metric(name: str) -> dict:
        value = metrics.get(name)
        if isinstance(value, list):  # some versions list the records
            value = next((m for m in value if m.get("tag") == name), None)
        return value or {}

    out: dict = {}
    for name, label in (("time_to_first_token", "ttft"), ("inter_token_latency", "itl"),
                        ("request_latency", "latency")):
        m = metric(name)
        for q in ("p50", "p90", "p99"):
            out[f"aiperf_{label}_{q}_ms"] = m.get(q)
    out["aiperf_output_tok_s"] = metric("output_token_throughput").get("avg")
    out["aiperf_request_count"] = metric("request_count").get("avg")
    osl_metric = metric("output_sequence_length")
    total = osl_metric.get("avg") * (out["aiperf_request_count"] or n) if osl_metric.get("avg") is not None else None
    out["aiperf_completion_tokens"] = total
    out["aiperf_server_completion_tokens"] = result["server_tokens"]
    out["aiperf_expected_completion_tokens"] = n * osl
    out["aiperf_tokens_agree"] = total is not None and round(total) == round(result["server_tokens"]) == n * osl
    out["aiperf_command"] = " ".join(result["argv"][1:])
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 requests, outputs of 16-64 tokens, 2 rounds")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=0, help="A B A B rounds (default 2 quick, 3 full)")
    parser.add_argument("--no-transformers", action="store_true", help="skip `transformers serve`")
    parser.add_argument("--aiperf", metavar="PATH", help="also run aiperf 0.13.0 (this `aiperf` command, or the venv "
                        "holding it) against omni serve and report its TTFT / ITL / throughput percentiles")
    parser.add_argument("--aiperf-client-tokens", action="store_true", help="let aiperf count output tokens by "
                        "re-tokenizing the text (its default) instead of reading the server's usage")
    parser.add_argument("--aiperf-requests", type=int, default=0, help="aiperf's request count (default: --quick's "
                        "or the full workload's)")
    return parser.parse_args()


def start_transformers(args, path, warm, logs) -> tuple:
    """`transformers serve` on the same checkpoint, warmed up: (its process or None, why it is missing or None)."""
    if args.no_transformers:
        return None, "skipped (--no-transformers)"
    if shutil.which("transformers", path=str(Path(sys.executable).parent)) is None:
        return None, "the `transformers` command is not installed in this environment"
    hf = None
    try:
        hf_port = free_port()
        hf = Process("transformers serve", [str(Path(sys.executable).parent / "transformers"), "serve", str(path),
                                            "--continuous-batching", "--device", "cpu", "--dtype", "bfloat16",
                                            "--port", str(hf_port), "--host", "127.0.0.1"], hf_port,
                     logs / "transformers.log").wait()
        asyncio.run(http_run(hf.url, str(path), warm, token_ids=False))  # its first request warms up CB
        return hf, None
    except Exception as exc:  # noqa: BLE001 - the baseline is optional: say exactly why it is missing
        if hf is not None:
            hf.stop()
        return None, f"transformers serve could not run: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}"


def summarize(runs: dict[str, list[dict]], figures: dict) -> None:
    """Each system's medians and percentiles, and the ratios, into `figures`."""
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


def main() -> None:
    args = parse_args()
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
    hf, note = start_transformers(args, path, warm, logs)
    if hf is not None:
        systems["transformers_serve"] = lambda: asyncio.run(http_run(hf.url, str(path), reqs, token_ids=False))
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
        if args.aiperf:
            count = args.aiperf_requests or n
            isl = round(statistics.mean(len(ids) for _, ids, _ in reqs))
            osl = round(statistics.mean(m for _, _, m in reqs))
            say(f"aiperf: {count} requests of {isl} prompt tokens and {osl} new tokens")
            result = aiperf_run(aiperf_command(args.aiperf), server.url, "ar_text", path, count, isl, osl, logs,
                                server_counts=not args.aiperf_client_tokens)
            figures.update(aiperf_figures(result, count, osl))
            say(f"aiperf: {result['s']:.0f}s, {figures['aiperf_completion_tokens']} completion tokens by its count, "
                f"{figures['aiperf_server_completion_tokens']:.0f} by the server's")
    finally:
        server.stop()
        if hf is not None:
            hf.stop()

    summarize(runs, figures)
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
