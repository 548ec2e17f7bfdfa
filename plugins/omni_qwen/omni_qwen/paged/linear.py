"""Linear: one weight's matmul as the paged decoder runs it, over oneDNN's prepacked copy on a CPU.

F.linear on a CPU hands the weight to its GEMM as it is on every call, and the library reorders it into its own
blocked layout each time (on a 2-core EPYC, fp32 at 32 rows took 2.1x and bf16 1.45x the prepacked time;
benchmarks/ar_step_profile.py). Packing once at load, as vLLM's CPU build and torch.compile's CPU backend do,
removes that. The packed copy is extra memory (the HF model keeps its own weights, which the dynamic_cache
backend and HF itself use). bf16 results are bitwise those of F.linear; fp32 ones differ in the last bits (a
different reduction order, not a different precision).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """oneDNN's packed copy of `weight`, or None where oneDNN cannot run it (a CPU without the instructions its
    bf16 kernels need, say): tried once on one row."""
    if not can_pack(weight):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        torch.ops.mkldnn._linear_pointwise(weight.new_zeros(1, weight.shape[1]), packed, bias, "none", [], "")
    except RuntimeError:
        return None
    return packed


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = True):
        self.weight, self.bias = weight, bias
        self.packed = pack(weight, bias) if prepack else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
