"""DecodeGraph: the paged decoder's decode step compiled by torch.compile (inductor), behind `ar_compile`.

Eager, a batch-32 decode step spends a sixth of its time in the ~20 small ops of each layer between the matmuls
(norms, rope, residuals, SiLU), one kernel launch each; inductor fuses them into a few C++ loops a layer and,
with freezing, packs the weights for oneDNN as paged/linear.py does. The whole step is one graph: regions of a
layer measured slower than eager, dynamo's per-call cost exceeding what fusing saved (docs/qwen-measurements.md).

Only steps whose every row is a one-token decode that samples run here (a batch's steady state, or one
request's); a step with a prefill chunk or prompt logprobs runs eager (PagedDecoder.forward). Each layer's
attention, the K/V write included, is one opaque op: traced as plain ops, the write into the pool (an input of
the graph) would be functionalized into a copy of the whole pool every step. On a CPU that op is the C++ kernel
`omni_qwen_cpu::decode_attention` (paged/kernel.py: it reads the blocks in place, where SDPA needs them
gathered); elsewhere `omni_qwen::decode_attention` below (the write, the gather, SDPA). Batch and context
are dynamic, so the compiles at load (batches of two or more; a lone decode, but in fp32 on a CPU; tens of
seconds) serve a process; inductor's on-disk cache makes the next load's shorter.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config

from . import kernel
from .batch import StepBatch
from .decoder import attend_decodes, rms_norm, rope, write_kv
from .pool import KVPool


@torch.library.custom_op("omni_qwen::decode_attention", mutates_args=("kv",))
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, layer: int,
                     slots: torch.Tensor, blocks: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One layer's attention of a decode-only step, as PagedDecoder._attend runs it: write the step's K/V into
    the pool, gather each request's blocks, SDPA with each K/V group's query heads as its query rows (the mask
    from each decode's position). It mutates the whole pool and picks the layer itself: an op that mutated views
    of a graph input (`kv[layer, 0]`) gave wrong logits under torch 2.13's functionalization. On a CPU the
    compiled step calls the C++ kernel of the same signature instead (paged/kernel.py)."""
    k_pool, v_pool = kv[layer, 0], kv[layer, 1]
    write_kv(k_pool, v_pool, slots, k, v)
    context = torch.arange(blocks.shape[0] // q.shape[0] * k_pool.shape[1], device=q.device)
    bias = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(context > positions[:, None], float("-inf"))
    return attend_decodes(q, k_pool, v_pool, blocks, bias[:, None, None, :])


@decode_attention.register_fake
def _decode_attention_shape(q, k, v, kv, layer, slots, blocks, positions):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def _frozen(tensor: torch.Tensor | None) -> torch.nn.Parameter | None:
    return None if tensor is None else torch.nn.Parameter(tensor, requires_grad=False)


class _LayerWeights(torch.nn.Module):
    """One decoder layer's weights as parameters (inductor's freezing folds parameters, not plain attributes)."""

    def __init__(self, layer):
        super().__init__()
        for name in ("qkv", "o", "gate_up", "down"):
            linear = getattr(layer, name)
            self.register_parameter(f"{name}_weight", _frozen(linear.weight))
            self.register_parameter(f"{name}_bias", _frozen(linear.bias))
        self.ln1, self.ln2 = _frozen(layer.ln1), _frozen(layer.ln2)


# Positions up to this many get rotary tables in the compiled step (64k x head_dim 128 in bf16: 32 MiB for both).
MAX_TABLE_POSITIONS = 1 << 16


def rope_tables(decoder) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos and sin of every position of the context window, (positions, head_dim) in the model's dtype, computed
    once by the HF model's own rotary module (elementwise in the position, so a row equals what the module gives
    for that position alone); None where they change with the sequence (dynamic and longrope scaling) or the
    window is too long to tabulate."""
    rotary = decoder.rotary
    rope_type = str(getattr(rotary, "rope_type", "default"))
    window = getattr(getattr(rotary, "config", None), "max_position_embeddings", None)
    if "dynamic" in rope_type or rope_type == "longrope" or not window or window > MAX_TABLE_POSITIONS:
        return None
    with torch.inference_mode():
        cos, sin = rotary(decoder.embed[:1], torch.arange(window, device=decoder.device)[None])
    return cos[0].clone(), sin[0].clone()


class DecodeStep(torch.nn.Module):
    """PagedDecoder.forward for a decode-only step, written for tracing: the same functions (decoder.py's
    rms_norm and rope; attend_decodes inside the attention op off a CPU), the same weights (shared, not copied),
    every row's logits."""

    def __init__(self, decoder, attention):
        """attention: the op of one layer's attention (decode_attention's signature)."""
        super().__init__()
        self.attention = attention
        self.num_heads, self.num_kv_heads, self.head_dim = decoder.num_heads, decoder.num_kv_heads, decoder.head_dim
        self.eps = decoder.eps
        self.embed, self.norm = _frozen(decoder.embed), _frozen(decoder.norm)
        self.lm_head = _frozen(decoder.lm_head.weight)
        self.layers = torch.nn.ModuleList(_LayerWeights(layer) for layer in decoder.layers)
        tables = rope_tables(decoder)
        self.cos, self.sin = (None, None) if tables is None else (_frozen(tables[0]), _frozen(tables[1]))

    def forward(self, input_ids, positions, kv, slots, blocks, cos=None, sin=None) -> torch.Tensor:
        """cos, sin: the rotary angles of `positions`, where the step has no tables of them (`rope_tables`)."""
        if cos is None:
            cos, sin = F.embedding(positions, self.cos)[:, None, :], F.embedding(positions, self.sin)[:, None, :]
        x = F.embedding(input_ids, self.embed)
        for index, layer in enumerate(self.layers):
            h = rms_norm(x, layer.ln1, self.eps)
            qkv = F.linear(h, layer.qkv_weight, layer.qkv_bias)
            q, k, v = rope(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
            attn = self.attention(q, k, v, kv, index, slots, blocks, positions)
            x = x + F.linear(attn, layer.o_weight, layer.o_bias)
            h = rms_norm(x, layer.ln2, self.eps)
            gate, up = F.linear(h, layer.gate_up_weight, layer.gate_up_bias).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down_weight, layer.down_bias)
        return F.linear(rms_norm(x, self.norm, self.eps), self.lm_head)


class DecodeGraph:
    """The compiled DecodeStep of one PagedDecoder, and which steps it runs."""

    def __init__(self, decoder):
        self.decoder = decoder
        step = DecodeStep(decoder, self._attention(decoder.device))
        self.tables = step.cos is not None
        self.compiled = torch.compile(step)
        # Freezing (weights as constants, packed for oneDNN) is a global inductor setting; scoped to our calls,
        # so it holds for a recompile too. `options=` of torch.compile did not reach it (torch 2.13).
        self.settings = inductor_config.patch(freezing=True)
        # A lone decode gets its own graph except in fp32 on a CPU: there inductor packs the weights for MKL,
        # which at one row measured slower than the eager step's oneDNN packing (docs/qwen-measurements.md).
        self.lone = not (decoder.dtype == torch.float32 and decoder.device.type == "cpu")

    @staticmethod
    def _attention(device: torch.device):
        """The C++ kernel on a CPU (built now, or taken from the cache), the SDPA op elsewhere."""
        if device.type != "cpu":
            return torch.ops.omni_qwen.decode_attention
        kernel.load()
        return torch.ops.omni_qwen_cpu.decode_attention

    def runs(self, step: StepBatch) -> bool:
        """A step of one-token decodes, each sampled, nothing else, over more than one block in all (a lone
        decode within its first block would be a size-1 dimension, which dynamo specializes: a third compile);
        a lone decode only where it has its graph."""
        return (step.num_decodes == step.num_tokens and not step.prefills and not step.every_rows
                and step.sample_rows.shape[0] == step.num_tokens and step.decode_blocks.shape[0] >= 2
                and (step.num_decodes > 1 or self.lone))

    @torch.inference_mode()
    def forward(self, step: StepBatch, pool: KVPool) -> torch.Tensor:
        inputs = [step.input_ids, step.positions, pool.kv, step.slots, step.decode_blocks]
        if not self.tables:
            cos, sin = self.decoder.rotary(self.decoder.embed[:1], step.positions[None])
            inputs += [cos[0, :, None, :], sin[0, :, None, :]]
        for dynamic in (*inputs[:2], *inputs[3:]):  # the batch (the blocks' count for decode_blocks)
            torch._dynamo.maybe_mark_dynamic(dynamic, 0)
        with self.settings:
            return self.compiled(*inputs)

    def warm_up(self, pool: KVPool) -> float:
        """Compile now rather than at the first batch (seconds taken): one graph for batches of two or more,
        traced on five decodes over three blocks each (sizes that differ, so dynamo ties none to another), and
        one for a lone decode (`lone`; dynamo specializes a dimension of size 1), on scratch steps over block 0: block 0
        is scratch until the scheduler hands it out, and a block's K/V is always written before it is read."""
        start = time.perf_counter()
        for num_decodes in (5, 1) if self.lone else (5,):
            self.forward(self._scratch_step(num_decodes, 3, pool), pool)
        return time.perf_counter() - start

    def _scratch_step(self, num_decodes: int, num_blocks: int, pool: KVPool) -> StepBatch:
        device = pool.device
        positions = torch.arange(num_decodes, device=device)
        return StepBatch(input_ids=torch.zeros(num_decodes, dtype=torch.long, device=device), positions=positions,
                         slots=positions.clone(), num_decodes=num_decodes,
                         decode_blocks=torch.zeros(num_decodes * num_blocks, dtype=torch.long, device=device),
                         decode_bias=torch.zeros(num_decodes, 1, 1, num_blocks * pool.block_size,
                                                 dtype=self.decoder.dtype, device=device),
                         prefills=(), sample_rows=positions,
                         sample_ids=tuple(f"warm-up-{i}" for i in range(num_decodes)))
