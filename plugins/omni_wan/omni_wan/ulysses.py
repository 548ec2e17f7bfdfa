"""Ulysses sequence parallelism of diffusers' WanTransformer3DModel: each of N ranks carries 1/N of the latent
tokens through every block, and only self-attention, which needs every token, communicates.

`Ulysses(transformer, mesh)` installs itself on the model with hooks and one attention processor, leaving
diffusers' forward as it is:
- the model's input: the per-token timestep (TI2V, `(rows, tokens)`) is cut to this rank's shard, so the time
  embedding and its projection are computed for the shard's tokens only;
- the rotary tables (`rope`'s output) and the hidden states entering block 0 are cut the same way;
- each block's self-attention projects, normalizes (RMS over all heads, per token: local) and rotates its
  tokens, then all-to-all turns sequence shards into head shards: attention over every token for H/N heads,
  and back;
- cross-attention is left alone: each token's query against the full text keys and values, no communication;
- `proj_out`'s output is gathered, so the unpatchify sees every token.

The tokens are zero-padded to a multiple of N. Padded tokens never reach a real one: they are cut off after the
all-to-all, before attention (the only place tokens meet), and the output is padded back for the return trip;
everything else in a block is per token. The gather cuts them off the result.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .comm import Mesh, gather_sequence, heads_to_sequence, pad, padded_length, sequence_to_heads, shard

SEQUENCE_DIM = 1  # of the hidden states (rows, tokens, dim), the timesteps (rows, tokens), the rotary tables


class Ulysses:
    """Installed once on one transformer that only this rank uses; `num_tokens` is the running forward's."""

    def __init__(self, transformer, mesh: Mesh):
        heads = transformer.config.num_attention_heads
        if heads % mesh.ulysses:
            raise ValueError(f"ulysses degree {mesh.ulysses} does not divide the transformer's {heads} attention heads")
        if any(getattr(block.attn1, "fused_projections", False) for block in transformer.blocks):
            raise ValueError("sequence parallelism needs the attention's unfused q/k/v projections")
        self.mesh = mesh
        self.patch_size = tuple(transformer.config.patch_size)
        self.num_tokens = 0
        self.hooks = [transformer.register_forward_pre_hook(self._split_input, with_kwargs=True),
                      transformer.rope.register_forward_hook(self._split_rotary),
                      transformer.blocks[0].register_forward_pre_hook(self._split_hidden),
                      transformer.proj_out.register_forward_hook(self._gather_output)]
        self.processors = [block.attn1.processor for block in transformer.blocks]
        for block in transformer.blocks:
            block.attn1.set_processor(_SelfAttention(self, block.attn1.processor))
        self.transformer = transformer

    def remove(self) -> None:
        """The transformer as it was: diffusers' single-device forward."""
        for hook in self.hooks:
            hook.remove()
        for block, processor in zip(self.transformer.blocks, self.processors):
            block.attn1.set_processor(processor)

    @property
    def num_padded(self) -> int:
        return padded_length(self.num_tokens, self.mesh.ulysses)

    def row_mean(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's mean over every rank's real tokens of `x` (rows, shard tokens, ...), the same on every rank of
        the branch: this rank's sum over its tokens (the padding left out), summed over the ranks."""
        length = x.shape[SEQUENCE_DIM]
        real = max(0, min(length, self.num_tokens - self.mesh.seq_rank * length))
        sums = x[:, :real].float().sum(dim=tuple(range(1, x.ndim)))
        dist.all_reduce(sums, group=self.mesh.seq_group)
        return sums / (self.num_tokens * math.prod(x.shape[2:]))

    def _split_input(self, module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        sizes = hidden.shape[2:]
        self.num_tokens = math.prod(size // patch for size, patch in zip(sizes, self.patch_size))
        timestep = kwargs.get("timestep", args[1] if len(args) > 1 else None)
        if timestep is not None and timestep.ndim == 2:  # per token (TI2V): (rows, tokens)
            if "timestep" in kwargs:
                kwargs["timestep"] = shard(timestep, SEQUENCE_DIM, self.mesh)
            else:
                args = (args[0], shard(timestep, SEQUENCE_DIM, self.mesh), *args[2:])
        return args, kwargs

    def _split_rotary(self, module, args, output):
        return tuple(shard(table, SEQUENCE_DIM, self.mesh) for table in output)

    def _split_hidden(self, module, args):
        return (shard(args[0], SEQUENCE_DIM, self.mesh), *args[1:])

    def _gather_output(self, module, args, output):
        return gather_sequence(output, SEQUENCE_DIM, self.num_tokens, self.mesh)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding of (rows, tokens, heads, dim) by its interleaved tables (1, tokens, 1, dim): each
    pair (x[2i], x[2i+1]) turned by the pair's angle."""
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    return torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(-2).type_as(x)


class _SelfAttention:
    """A block's self-attention over this rank's tokens, all-to-all around the attention itself."""

    def __init__(self, owner: Ulysses, original):
        self.owner = owner
        self.original = original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("the sequence-parallel self-attention takes no context and no mask")
        owner, mesh = self.owner, self.owner.mesh
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = rotate(query, *rotary_emb), rotate(key, *rotary_emb)
        rows = query.shape[0]
        # q, k and v travel in one all-to-all; the padding is cut before any token sees another
        qkv = sequence_to_heads(torch.cat([query, key, value]), mesh)[:, :owner.num_tokens]
        query, key, value = qkv.split(rows)
        out = dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                    backend=getattr(self.original, "_attention_backend", None),
                                    parallel_config=None)
        out = heads_to_sequence(pad(out, SEQUENCE_DIM, owner.num_padded).contiguous(), mesh)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))
