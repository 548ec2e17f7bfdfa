"""Whisper's forward passes for a batch of windows of many requests: the encoder over every new window at once,
the decoder's first tokens of new windows (their decoder prompt), and one decoder step for every window in flight,
with each window's own keys and values in a slot of a KV pool.

The decoder runs the loaded `WhisperForConditionalGeneration`'s own modules (its weights, layer norms, projections)
with attention over the pool: a window's self-attention sees its own first `length` positions only, so windows of
different lengths share one forward. The arithmetic is transformers' (queries scaled before the dot product, as
WhisperAttention does), so greedy decoding gives `generate`'s tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


class KVPool:
    """Per decoder layer: the self-attention keys/values [slots, heads, positions, head_dim] and the cross-attention
    keys/values of each slot's window [slots, heads, frames, head_dim]. A window in flight holds one slot; the pool
    grows (doubling) up to `max_slots`."""

    def __init__(self, layers: int, heads: int, head_dim: int, positions: int, frames: int, dtype, device,
                 max_slots: int):
        self.shape = (layers, heads, head_dim, positions, frames)
        self.dtype, self.device = dtype, device
        self.max_slots = max_slots
        self.capacity = 0
        self.free: list[int] = []
        self.used: set[int] = set()
        self.self_k: list[torch.Tensor] = []
        self.self_v: list[torch.Tensor] = []
        self.cross_k: list[torch.Tensor] = []
        self.cross_v: list[torch.Tensor] = []

    def take(self) -> int:
        if not self.free:
            self._grow()
        slot = min(self.free)
        self.free.remove(slot)
        self.used.add(slot)
        return slot

    def give(self, slot: int) -> None:
        if slot in self.used:
            self.used.remove(slot)
            self.free.append(slot)

    def _grow(self) -> None:
        new = min(max(1, self.capacity * 2), self.max_slots)
        if new <= self.capacity:
            raise RuntimeError(f"the KV pool is full ({self.max_slots} windows)")
        layers, heads, head_dim, positions, frames = self.shape

        def grown(old: list[torch.Tensor], length: int) -> list[torch.Tensor]:
            out = []
            for i in range(layers):
                tensor = torch.zeros(new, heads, length, head_dim, dtype=self.dtype, device=self.device)
                if old:
                    tensor[: self.capacity] = old[i]
                out.append(tensor)
            return out

        self.self_k, self.self_v = grown(self.self_k, positions), grown(self.self_v, positions)
        self.cross_k, self.cross_v = grown(self.cross_k, frames), grown(self.cross_v, frames)
        self.free.extend(range(self.capacity, new))
        self.capacity = new


class WhisperForward:
    """The batched forward passes over one loaded model (eval mode, no gradients)."""

    def __init__(self, model, max_slots: int):
        self.model = model
        config = model.config
        self.decoder = model.model.decoder
        self.encoder = model.model.encoder
        self.heads = config.decoder_attention_heads
        self.head_dim = config.d_model // self.heads
        self.max_positions = config.max_target_positions
        self.frames = config.max_source_positions
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.pool = KVPool(len(self.decoder.layers), self.heads, self.head_dim, self.max_positions, self.frames,
                           self.dtype, self.device, max_slots)

    @torch.inference_mode()
    def encode(self, features: torch.Tensor, slots: Sequence[int]) -> None:
        """The encoder over windows' log-mel features [windows, mels, 3000] (one forward), each window's cross-
        attention keys/values written to its slot."""
        hidden = self.encoder(features.to(self.device, self.dtype)).last_hidden_state
        index = torch.tensor(list(slots), device=self.device)
        for i, layer in enumerate(self.decoder.layers):
            attention = layer.encoder_attn
            self.pool.cross_k[i][index] = self._heads(attention.k_proj(hidden))
            self.pool.cross_v[i][index] = self._heads(attention.v_proj(hidden))

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], slots: Sequence[int]) -> torch.Tensor:
        """The decoder over each new window's decoder prompt (its tokens at positions 0..n-1, padded to the longest),
        keys/values written to its slot; the logits [windows, vocab] after each prompt's last token."""
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int(lengths.max())
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(list(prompt), dtype=torch.long)
        index = torch.tensor(list(slots), device=self.device)
        positions = torch.arange(width, device=self.device)
        # query q sees key k when k <= q and k is one of its row's tokens (padded queries see key 0)
        mask = (positions[None, :] <= positions[:, None])[None] & (positions[None, None, :] < lengths[:, None, None])
        mask[:, :, 0] = True
        x = self.decoder.embed_tokens(ids) + self.decoder.embed_positions.weight[positions][None]
        for i, layer in enumerate(self.decoder.layers):
            attention = layer.self_attn
            hidden = layer.self_attn_layer_norm(x)
            keys, values = self._heads(attention.k_proj(hidden)), self._heads(attention.v_proj(hidden))
            self.pool.self_k[i][index, :, :width] = keys
            self.pool.self_v[i][index, :, :width] = values
            x = x + self._attend(attention, hidden, keys, values, mask[:, None])
            x = self._cross_and_mlp(layer, i, x, index)
        logits = self._logits(x)
        return logits[torch.arange(len(prompts), device=self.device), lengths - 1]

    @torch.inference_mode()
    def step(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int]) -> torch.Tensor:
        """One decoder step: each slot's token at its position (its window's length so far), attending to its own
        keys/values; the logits [len(slots), vocab] of each slot's next token. The forward runs over the pool's
        slots 0..max(slots) at once (a slot between them that is idle computes a row nobody reads)."""
        rows = max(slots) + 1
        token = torch.zeros(rows, dtype=torch.long, device=self.device)
        position = torch.zeros(rows, dtype=torch.long, device=self.device)
        index = torch.tensor(list(slots), device=self.device)
        token[index] = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        position[index] = torch.tensor(list(positions), dtype=torch.long, device=self.device)
        width = int(position.max()) + 1
        mask = torch.arange(width, device=self.device)[None, :] <= position[:, None]  # [rows, width]
        every = torch.arange(rows, device=self.device)
        x = (self.decoder.embed_tokens(token) + self.decoder.embed_positions.weight[position])[:, None]
        for i, layer in enumerate(self.decoder.layers):
            attention = layer.self_attn
            hidden = layer.self_attn_layer_norm(x)
            self.pool.self_k[i][every, :, position] = self._heads(attention.k_proj(hidden))[:, :, 0]
            self.pool.self_v[i][every, :, position] = self._heads(attention.v_proj(hidden))[:, :, 0]
            keys = self.pool.self_k[i][:rows, :, :width]
            values = self.pool.self_v[i][:rows, :, :width]
            x = x + self._attend(attention, hidden, keys, values, mask[:, None, None])
            x = self._cross_and_mlp(layer, i, x, slice(0, rows))
        return self._logits(x)[index, 0]

    def _cross_and_mlp(self, layer, i: int, x: torch.Tensor, index) -> torch.Tensor:
        hidden = layer.encoder_attn_layer_norm(x)
        x = x + self._attend(layer.encoder_attn, hidden, self.pool.cross_k[i][index], self.pool.cross_v[i][index])
        hidden = layer.final_layer_norm(x)
        return x + layer.fc2(layer.activation_fn(layer.fc1(hidden)))

    def _attend(self, attention, hidden: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        query = self._heads(attention.q_proj(hidden) * attention.scaling)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=1.0)
        return attention.out_proj(out.transpose(1, 2).reshape(hidden.shape))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, length, d_model] -> [batch, heads, length, head_dim]."""
        return x.view(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.proj_out(self.decoder.layer_norm(x)).float()
