"""paged/linear.py: the decoder's matmuls over oneDNN's prepacked weights on a CPU, against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omni_qwen.paged.linear import Linear


@pytest.mark.parametrize("rows", [1, 7, 32, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_matmuls_match_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(96, 64, generator=gen), torch.randn(rows, 64, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    fp32 = Linear(weight, bias)
    assert fp32.packed is not None  # this CPU build has oneDNN
    torch.testing.assert_close(fp32(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    bf16 = Linear(weight.bfloat16(), None if bias is None else bias.bfloat16())
    assert torch.equal(bf16(x.bfloat16()), F.linear(x.bfloat16(), weight.bfloat16(), bf16.bias))


def test_unpacked_where_asked_or_where_onednn_does_not_pack():
    weight, x = torch.randn(8, 4), torch.randn(2, 4)
    assert Linear(weight, prepack=False).packed is None
    assert torch.equal(Linear(weight, prepack=False)(x), F.linear(x, weight))
    half = Linear(weight.half())
    assert half.packed is None and torch.equal(half(x.half()), F.linear(x.half(), weight.half()))
