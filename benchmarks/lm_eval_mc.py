"""lm-eval's `local-completions` against `omni serve`, checked against the same task scored with HF directly.

Starts `omni serve` with the real SmolLM2-135M-Instruct (fp32) on a free 127.0.0.1 port, runs lm-eval 0.4.13
(its own venv, `--lm-eval VENV`) on the local multiple-choice task `benchmarks/lm_eval/omni_mc.yaml` (26
questions written for omni, 4 choices each) through `/v1/completions` (token-id prompts, `echo`, `logprobs=1`,
`max_tokens=1`: its loglikelihood requests), with the model's local tokenizer and no hub (HF_HUB_OFFLINE=1).
Then scores every (question, choice) with HF `AutoModelForCausalLM` on the same checkpoint in fp32: the sum of
the log-softmax of each continuation token given the context, tokenized as lm-eval does (context, then the
whole string's tokens past it). Prints per-item agreement and a final JSON line.

    python3 -m venv .venv-lmeval && .venv-lmeval/bin/pip install "lm-eval[api]==0.4.13" "transformers==5.24.0"
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lm_eval_mc.py --lm-eval .venv-lmeval
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import httpx  # noqa: E402

HERE = Path(__file__).resolve().parent
TASK_DIR = HERE / "lm_eval"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, port: int, log: Path) -> subprocess.Popen:
    code = "import sys; from omni_kernel.cli import main; main(args=sys.argv[1:], prog_name='omni')"
    argv = [sys.executable, "-c", code, "serve", "--pipeline", "ar_text", "--ar-model", str(model), "--port",
            str(port), "-c", "ar_dtype=fp32", "--log-level", "warning"]
    proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=os.environ.copy())
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"omni serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("omni serve did not start within 300 s")


def run_lm_eval(venv: Path, port: int, tokenizer: Path, out: Path, concurrent: int) -> list[dict]:
    args = ",".join(["model=ar_text", f"base_url=http://127.0.0.1:{port}/v1/completions",
                     "tokenizer_backend=huggingface", f"tokenizer={tokenizer}", f"num_concurrent={concurrent}",
                     "max_retries=1", "tokenized_requests=True"])
    argv = [str(venv / "bin" / "lm_eval"), "--model", "local-completions", "--model_args", args, "--tasks",
            "omni_mc", "--include_path", str(TASK_DIR), "--log_samples", "--output_path", str(out)]
    subprocess.run(argv, cwd=TASK_DIR, check=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
    samples = sorted(out.rglob("samples_omni_mc_*.jsonl"))
    if not samples:
        raise RuntimeError(f"lm-eval wrote no samples under {out}")
    return [json.loads(line) for line in samples[-1].read_text().splitlines() if line.strip()]


def hf_scores(model_dir: Path, docs: list[dict]) -> list[list[float]]:
    """Each choice's loglikelihood under HF, with lm-eval's context/continuation split of the token ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    scores = []
    for doc in docs:
        context = f"Question: {doc['question']}\nAnswer:"
        row = []
        for choice in doc["choices"]:
            whole = tok.encode(context + " " + choice)
            ctx = tok.encode(context)
            ids = whole if whole[:len(ctx)] == ctx else ctx + tok.encode(" " + choice)
            with torch.no_grad():
                logprobs = model(torch.tensor([ids])).logits[0].log_softmax(-1)
            row.append(sum(logprobs[p - 1, ids[p]].item() for p in range(len(ctx), len(ids))))
        scores.append(row)
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm-eval", type=Path, default=Path(".venv-lmeval"), help="the venv with lm-eval 0.4.13")
    parser.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M-Instruct from the cache")
    parser.add_argument("--concurrent", type=int, default=4, help="lm-eval's num_concurrent")
    args = parser.parse_args()
    if args.model is None:
        from omni_qwen.registry_model import FETCH_COMMAND, SMOLLM2, cached

        args.model = cached(SMOLLM2)
        if args.model is None:
            sys.exit(f"the real {SMOLLM2.name} is not in omni's cache: `{FETCH_COMMAND}`")
    docs = [json.loads(line) for line in (TASK_DIR / "omni_mc.jsonl").read_text().splitlines() if line.strip()]
    with tempfile.TemporaryDirectory(prefix="omni-lmeval-") as tmp:
        port = free_port()
        server = start_server(args.model, port, Path(tmp) / "omni.log")
        try:
            started = time.perf_counter()
            samples = run_lm_eval(args.lm_eval.resolve(), port, args.model, Path(tmp) / "out", args.concurrent)
            lm_eval_s = time.perf_counter() - started
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    ref = hf_scores(args.model, docs)
    by_doc = {s["doc_id"]: s for s in samples}
    same_choice, max_diff, correct_omni, correct_hf = 0, 0.0, 0, 0
    for i, doc in enumerate(docs):
        served = [float(r[0][0]) for r in by_doc[i]["resps"]]
        pick_omni = max(range(len(served)), key=served.__getitem__)
        pick_hf = max(range(len(ref[i])), key=ref[i].__getitem__)
        same_choice += pick_omni == pick_hf
        correct_omni += pick_omni == doc["answer"]
        correct_hf += pick_hf == doc["answer"]
        max_diff = max(max_diff, *(abs(a - b) for a, b in zip(served, ref[i])))
        print(f"{i:2d} omni {pick_omni} hf {pick_hf} answer {doc['answer']} "
              f"max |dLL| {max(abs(a - b) for a, b in zip(served, ref[i])):.2e}  {doc['question']}", file=sys.stderr)
    acc = [float(s["acc"]) for s in samples]
    print(json.dumps({"items": len(docs), "lm_eval_acc": sum(acc) / len(acc), "omni_acc": correct_omni / len(docs),
                      "hf_acc": correct_hf / len(docs), "same_choice": same_choice,
                      "max_abs_loglikelihood_diff": max_diff, "lm_eval_seconds": round(lm_eval_s, 1)}))


if __name__ == "__main__":
    main()
