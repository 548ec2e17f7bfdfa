"""The compiled decode step's attention on a CPU: the C++ kernel (omni_qwen_cpu::decode_attention) against the
path it replaced (the K/V write, the block gather and SDPA: paged/decoder.py's write_kv and attend_decodes), alone.

SmolLM2-135M's attention shape (9 query heads over 3 K/V heads, head_dim 64, blocks of 16), `--batch` decodes
at positions within 16 of `--context`, random block tables over a pool of `--layers` layers; each call takes the
next layer's pool, so the K/V come from memory rather than the cache, as in a step of a 30-layer model. The two
alternate (A B A B) for `--rounds` rounds; the figures are the medians of the rounds' microseconds per call, with
the `lscpu` model and the CPU's bf16/AMX flags. The last line is one JSON object.

    .venv/bin/python benchmarks/decode_attention.py [--batch 32] [--contexts 80 160] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from ar_step_profile import machine

from omni_qwen.paged import kernel
from omni_qwen.paged.decoder import attend_decodes, write_kv

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def per_call_us(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def compare(dtype: torch.dtype, batch: int, context: int, layers: int, rounds: int, calls: int) -> dict:
    generator = torch.Generator().manual_seed(context)
    max_blocks = context // BLOCK_SIZE
    num_blocks = batch * max_blocks + 1  # block 0 is scratch: this step's K/V go there, read by neither side
    blocks = torch.randperm(num_blocks - 1, generator=generator)[:batch * max_blocks] + 1
    positions = torch.randint(context - BLOCK_SIZE, context, (batch,), generator=generator)
    kv = torch.randn(layers, 2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    q, k, v = (torch.randn(batch, heads, HEAD_DIM, generator=generator).to(dtype)
               for heads in (HEADS, KV_HEADS, KV_HEADS))
    slots = torch.arange(batch) % BLOCK_SIZE
    mask = torch.arange(context) > positions[:, None]
    bias = torch.zeros(batch, context, dtype=dtype).masked_fill(mask, float("-inf"))[:, None, None, :]
    gathered = (torch.empty(batch * max_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype),
                torch.empty(batch * max_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype))
    layer = [0]

    def next_layer() -> int:
        layer[0] = (layer[0] + 1) % layers
        return layer[0]

    def sdpa():
        index = next_layer()
        write_kv(kv[index, 0], kv[index, 1], slots, k, v)
        return attend_decodes(q, kv[index, 0], kv[index, 1], blocks, bias, *gathered)

    def cpp():
        return torch.ops.omni_qwen_cpu.decode_attention(q, k, v, kv, next_layer(), slots, blocks, positions)

    old, new = [], []
    for _ in range(rounds):
        old.append(per_call_us(sdpa, calls))
        new.append(per_call_us(cpp, calls))
    return {"batch": batch, "context": context, "sdpa_us": round(statistics.median(old)),
            "kernel_us": round(statistics.median(new)),
            "speedup": round(statistics.median(old) / statistics.median(new), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[80, 160])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=150)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel.load()
    rows = []
    for name in args.dtypes:
        for context in args.contexts:
            row = {"dtype": name, **compare(DTYPES[name], args.batch, context, args.layers, args.rounds, args.calls)}
            print(f"{name} batch {row['batch']} context {context}: write + gather + SDPA {row['sdpa_us']} us, "
                  f"kernel {row['kernel_us']} us ({row['speedup']}x)", file=sys.stderr)
            rows.append(row)
    print(json.dumps({"benchmark": "decode_attention", "threads": args.threads, "machine": machine(), "rows": rows}))


if __name__ == "__main__":
    main()
