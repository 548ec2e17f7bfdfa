"""The C++ decode attention kernel (paged/kernel.py, decode_attention.cpp) against the SDPA path it replaces on a
CPU in the compiled decode step: the same pool afterwards, the same attention, for shapes its loops specialize
(head_dim 64) and the generic one, grouped and plain K/V heads, block tables padded with block 0."""

from __future__ import annotations

import pytest
import torch
from torch._inductor import config as inductor_config

from omni_qwen.paged import kernel
from omni_qwen.paged.decoder import attend_decodes, write_kv

pytestmark = pytest.mark.real_model  # not a real model, but a C++ build (about 10 s): outside the fast tier

BLOCK_SIZE, NUM_BLOCKS, NUM_LAYERS = 16, 64, 3


def _step(num_decodes: int, max_position: int, generator: torch.Generator):
    """Positions (one at 0, one at a block's last slot, one at the next block's first), padded block tables of
    distinct blocks (block 0 never used, as the scheduler keeps it), and each decode's slot."""
    positions = torch.randint(1, max_position, (num_decodes,), generator=generator)
    positions[:3] = torch.tensor([0, BLOCK_SIZE - 1, BLOCK_SIZE])
    max_blocks = int(positions.max()) // BLOCK_SIZE + 1
    order = torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1
    tables = torch.zeros(num_decodes, max_blocks, dtype=torch.long)
    used = 0
    for i, position in enumerate(positions.tolist()):
        count = position // BLOCK_SIZE + 1
        tables[i, :count] = order[used:used + count]
        used += count
    slots = torch.tensor([int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                          for i, p in enumerate(positions.tolist())])
    return positions, tables.reshape(-1), slots


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32)])
@pytest.mark.parametrize("views", [False, True])
def test_kernel_writes_and_attends_as_sdpa(dtype, atol, num_heads, num_kv_heads, head_dim, views):
    """views: q, k and v are views of one wider row per decode, as the compiled step passes them (read in
    place)."""
    kernel.load()
    generator = torch.Generator().manual_seed(head_dim)
    kv = torch.randn(NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, generator=generator).to(dtype)
    expected_kv = kv.clone()
    num_decodes, layer = 6, 1
    positions, blocks, slots = _step(num_decodes, 40, generator)
    q, k, v = (torch.randn(num_decodes, heads, head_dim, generator=generator).to(dtype)
               for heads in (num_heads, num_kv_heads, num_kv_heads))
    if views:
        q, k, v = torch.cat((q, k, v), dim=1).split((num_heads, num_kv_heads, num_kv_heads), dim=1)
        assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()

    out = torch.ops.omni_qwen_cpu.decode_attention(q, k, v, kv, layer, slots, blocks, positions)

    k_pool, v_pool = expected_kv[layer, 0], expected_kv[layer, 1]
    write_kv(k_pool, v_pool, slots, k, v)
    context = torch.arange(blocks.shape[0] // num_decodes * BLOCK_SIZE)
    bias = torch.zeros(num_decodes, context.shape[0], dtype=dtype).masked_fill(context > positions[:, None],
                                                                              float("-inf"))
    expected = attend_decodes(q, k_pool, v_pool, blocks, bias[:, None, None, :])
    assert torch.equal(kv, expected_kv)  # this step's K/V in their slots, nothing else touched
    assert out.shape == (num_decodes, num_heads * head_dim) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)
    # the decode at position 0 attends to itself alone: its output is its own V, per query head's group
    group = num_heads // num_kv_heads
    own = v[0].repeat_interleave(group, dim=0).reshape(-1)
    torch.testing.assert_close(out[0].float(), own.float(), atol=atol, rtol=0)


def test_loading_the_kernel_keeps_denormals():
    """Linked with -ffast-math, gcc < 13 adds crtfastmath.o, which sets flush-to-zero for the whole process when the
    library loads (inductor's kernels ran 5x slower, and every op's numerics changed); kernel.py links without it."""
    kernel.load()
    tiny = torch.tensor([1e-40])  # a denormal in fp32
    assert (tiny * 1.0).item() > 0


def test_inputs_outside_the_pool_are_refused_not_read():
    """A position past its block table, a block or slot outside the pool, a layer the pool lacks: an error, not
    a read or write of memory that is not the pool's."""
    kernel.load()
    kv = torch.zeros(2, 2, 4, BLOCK_SIZE, 1, 32)
    q, k, v = torch.zeros(1, 1, 32), torch.zeros(1, 1, 32), torch.zeros(1, 1, 32)
    good = {"layer": 1, "slots": torch.tensor([17]), "blocks": torch.tensor([2, 1]), "positions": torch.tensor([17])}
    torch.ops.omni_qwen_cpu.decode_attention(q, k, v, kv, *good.values())
    for name, value, says in (("positions", torch.tensor([32]), "beyond its block table"),
                              ("blocks", torch.tensor([2, 4]), "a block outside the pool"),
                              ("slots", torch.tensor([64]), "a slot outside the pool"),
                              ("layer", 2, "no layer 2")):
        with pytest.raises(RuntimeError, match=says):
            torch.ops.omni_qwen_cpu.decode_attention(q, k, v, kv, *{**good, name: value}.values())


def test_a_missing_compiler_is_one_line(tmp_path):
    with inductor_config.patch({"cpp.cxx": (None, str(tmp_path / "no-such-compiler"))}), \
            pytest.raises(kernel.KernelBuildError) as raised:
        kernel.built(tmp_path / "kernels")
    message = str(raised.value)
    assert "\n" not in message and "needs a C++ compiler" in message and "no-such-compiler" in message


def test_a_failing_compiler_is_one_line_and_leaves_nothing(tmp_path):
    """A compiler that runs but fails: the error names it and its first error line; no partial library stays."""
    fake = tmp_path / "cxx"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'fake 1.0' && exit 0\n"
                    "echo 'x.cpp:1: error: no such thing' >&2\nexit 1\n")
    fake.chmod(0o755)
    says = r"could not build the C\+\+ decode attention kernel: x\.cpp:1: error: no such thing$"
    with inductor_config.patch({"cpp.cxx": (None, str(fake))}), pytest.raises(kernel.KernelBuildError, match=says):
        kernel.built(tmp_path / "kernels")
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == []
