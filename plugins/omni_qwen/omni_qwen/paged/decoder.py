"""PagedDecoder: the project's own decoder forward over a HF Qwen2ForCausalLM's or LlamaForCausalLM's weights
and a KVPool (SmolLM2 is a Llama).

The two families share one layer structure (RMSNorm, rotary attention with grouped K/V heads, SiLU-gated MLP);
they differ in which projections carry a bias (Qwen2: q/k/v; Llama: all attention projections with
`attention_bias`, the MLP's with `mlp_bias`), in tied embeddings and in rope parameters, which come from the
HF model's own rotary module. `supports` names what this forward does not implement, so those models take
the dynamic_cache backend.

Every linear layer runs once over the flattened tokens of the whole step. q/k/v and gate/up are merged into
one matmul each; the HF modules are re-pointed at views of the merged weights, so nothing is duplicated and
the HF model keeps working. Attention writes this step's K/V into the pool, then reads each request's context
back through its block table: all one-token chunks in one batched call, each longer chunk on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch import StepBatch
from .linear import Linear
from .pool import KVPool


def _merge(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([m.weight.data for m in linears])
    bias = torch.cat([m.bias.data for m in linears]) if linears[0].bias is not None else None
    row = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = weight[row:row + rows]
        if bias is not None:
            m.bias.data = bias[row:row + rows]
        row += rows
    return weight, bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As HF: normalize in fp32, cast back, then scale."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
         head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (rotated) and v of a merged q/k/v matmul's output."""
    split = (num_heads + num_kv_heads) * head_dim
    qk = qkv[:, :split].view(-1, num_heads + num_kv_heads, head_dim)
    half = head_dim // 2
    qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
    return qk[:, :num_heads], qk[:, num_heads:], qkv[:, split:].view(-1, num_kv_heads, head_dim)


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """The step's K/V into their slots (block * block_size + offset) of one layer's pool."""
    k_pool.view(-1, k.shape[1], k.shape[2]).index_copy_(0, slots, k)
    v_pool.view(-1, v.shape[1], v.shape[2]).index_copy_(0, slots, v)


def attend_decodes(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor,
                   bias: torch.Tensor, k_buf: torch.Tensor | None = None,
                   v_buf: torch.Tensor | None = None) -> torch.Tensor:
    """The attention of `q`'s one-token decodes over their blocks (gathered into k_buf/v_buf when given), in one
    SDPA call: a decode's query heads of one KV group ride as that group's query rows, so K/V are not repeated."""
    num_decodes, num_heads, head_dim = q.shape[0], q.shape[1], q.shape[2]
    num_kv_heads = k_pool.shape[2]
    keys = torch.index_select(k_pool, 0, blocks, out=k_buf) if k_buf is not None else k_pool.index_select(0, blocks)
    values = torch.index_select(v_pool, 0, blocks, out=v_buf) if v_buf is not None else v_pool.index_select(0, blocks)
    keys = keys.view(num_decodes, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = values.view(num_decodes, -1, num_kv_heads, head_dim).transpose(1, 2)
    queries = q.reshape(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias)
    return out.reshape(num_decodes, num_heads * head_dim)


class _Layer:
    def __init__(self, layer, prepack: bool):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = Linear(*_merge([attn.q_proj, attn.k_proj, attn.v_proj]), prepack=prepack)
        self.o = Linear(attn.o_proj.weight, attn.o_proj.bias, prepack=prepack)
        self.gate_up = Linear(*_merge([mlp.gate_proj, mlp.up_proj]), prepack=prepack)
        self.down = Linear(mlp.down_proj.weight, mlp.down_proj.bias, prepack=prepack)
        self.ln1, self.ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight


# The model types whose HF decoder layer is exactly the structure above (no q/k norms, no sliding window).
FAMILIES = ("qwen2", "llama")


class PagedDecoder:
    @staticmethod
    def supports(config) -> str | None:
        """Why this forward cannot run a model with `config` (None: it can)."""
        model_type = getattr(config, "model_type", None)
        if model_type not in FAMILIES:
            return f"it implements the {' and '.join(FAMILIES)} architectures, not {model_type!r}"
        if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
            return "it does not implement sliding-window attention"
        if getattr(config, "hidden_act", "silu") != "silu":
            return f"it implements the SiLU-gated MLP, not hidden_act {config.hidden_act!r}"
        if getattr(config, "pretraining_tp", 1) not in (None, 1):
            return "it does not implement pretraining_tp > 1"
        return None

    def __init__(self, model, prepack: bool = True):
        """prepack: run the matmuls over oneDNN's prepacked weights on a CPU (paged/linear.py)."""
        config = model.config
        reason = self.supports(config)
        if reason:
            raise ValueError(f"the paged backend cannot run this model: {reason}")
        inner = model.model
        self.dtype = inner.embed_tokens.weight.dtype
        self.device = inner.embed_tokens.weight.device
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        self.embed = inner.embed_tokens.weight
        self.layers = [_Layer(layer, prepack) for layer in inner.layers]
        self.norm = inner.norm.weight
        self.lm_head = Linear(model.lm_head.weight, prepack=prepack)
        self.rotary = inner.rotary_emb

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps)

    @torch.inference_mode()
    def forward(self, step: StepBatch, pool: KVPool) -> torch.Tensor:
        """Run the step; write its K/V into the pool; return the logits of the sampled rows (model dtype:
        argmax needs no fp32 copy of a vocabulary-wide row)."""
        x = F.embedding(step.input_ids, self.embed)
        cos, sin = self.rotary(x, step.positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]
        workspace = self._workspace(step, pool)
        hd = self.head_dim
        for index, layer in enumerate(self.layers):
            h = self._norm(x, layer.ln1)
            q, k, v = rope(self._linear(h, layer.qkv), cos, sin, self.num_heads, self.num_kv_heads, hd)
            k_pool, v_pool = pool.layer(index)
            write_kv(k_pool, v_pool, step.slots, k, v)
            attn = self._attend(step, q, k_pool, v_pool, workspace)
            x = x + self._linear(attn, layer.o)
            h = self._norm(x, layer.ln2)
            gate, up = self._linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + self._linear(F.silu(gate) * up, layer.down)
        h = self._norm(x.index_select(0, step.sample_rows), self.norm)
        return self._linear(h, self.lm_head)

    def _linear(self, x: torch.Tensor, linear: Linear) -> torch.Tensor:
        """Every matmul of the step goes through here (benchmarks/ar_step_profile.py times them)."""
        return linear(x)

    def _workspace(self, step: StepBatch, pool: KVPool):
        """Gather buffers reused by every layer, so the per-layer gathers allocate nothing."""
        shape = (step.decode_blocks.shape[0], pool.block_size, self.num_kv_heads, self.head_dim)
        return (torch.empty(shape, dtype=pool.kv.dtype, device=pool.device),
                torch.empty(shape, dtype=pool.kv.dtype, device=pool.device))

    def _attend(self, step: StepBatch, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                workspace) -> torch.Tensor:
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        d, hd = step.num_decodes, self.head_dim
        if d:
            out[:d] = attend_decodes(q[:d], k_pool, v_pool, step.decode_blocks, step.decode_bias, *workspace)
        for span in step.prefills:
            rows = slice(span.row, span.row + span.num_tokens)
            length = span.context_len
            k = k_pool.index_select(0, span.blocks).view(1, -1, self.num_kv_heads, hd)[:, :length]
            v = v_pool.index_select(0, span.blocks).view(1, -1, self.num_kv_heads, hd)[:, :length]
            qp = q[rows].transpose(0, 1)[None]
            # enable_gqa: each K/V head serves its group of query heads in the kernel, no repeated copy of K/V.
            o = F.scaled_dot_product_attention(qp, k.transpose(1, 2), v.transpose(1, 2), attn_mask=span.mask,
                                               is_causal=span.mask is None, enable_gqa=True)
            out[rows] = o[0].transpose(0, 1).reshape(span.num_tokens, -1)
        return out
