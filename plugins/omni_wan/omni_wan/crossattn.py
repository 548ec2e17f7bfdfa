"""Cross-attention keys and values projected once per text, not once per denoise step.

Every block of the Wan transformer projects the 512 text tokens to keys and values in every forward, although
the text never changes during a request. At small video sizes that projection is most of a forward (512 text
tokens against e.g. 80 latent tokens). `CrossKV.project` runs the text embedder and each block's `to_k`/
`norm_k`/`to_v` once, exactly as the block would; `CrossKV.use(rows)` then makes every block's cross-attention
read those rows' keys and values, so the forward gets a one-token placeholder text. Outside `use`, the blocks run
diffusers' own processor unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager

import attrs
import torch


@attrs.frozen(eq=False)
class TextKV:
    """One text's cross-attention keys and values, per block: (1, text_len, heads, head_dim)."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class CrossKV:
    """Installed on one transformer: a processor per block's attn2 that reads the current rows' keys and values."""

    def __init__(self, transformer):
        self.transformer = transformer
        self.rows: tuple[TextKV, ...] | None = None
        self._joined: tuple[tuple[TextKV, ...], list] | None = None  # the last rows and their concatenation
        for index, block in enumerate(transformer.blocks):
            if block.attn2.add_k_proj is not None:
                raise ValueError("the text key/value cache supports text-only cross-attention (Wan2.2 TI2V)")
            block.attn2.set_processor(_Processor(self, index, block.attn2.processor))

    @torch.no_grad()
    def project(self, embeds: torch.Tensor) -> list[TextKV]:
        """The keys and values every block computes from each row of these text embeddings
        (texts, text_len, text_dim): one TextKV per row."""
        context = self.transformer.condition_embedder.text_embedder(embeds)
        keys, values = [], []
        for block in self.transformer.blocks:
            attn = block.attn2
            keys.append(attn.norm_k(attn.to_k(context)).unflatten(2, (attn.heads, -1)))
            values.append(attn.to_v(context).unflatten(2, (attn.heads, -1)))
        return [TextKV(tuple(k[i:i + 1].clone() for k in keys), tuple(v[i:i + 1].clone() for v in values))
                for i in range(len(embeds))]

    def placeholder(self, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
        """What the forward gets as `encoder_hidden_states` while rows are in use: its dtype is the text's."""
        return torch.zeros(batch, 1, self.transformer.config.text_dim, dtype=dtype, device=device)

    @contextmanager
    def use(self, rows: list[TextKV]):
        self.rows = tuple(rows)
        try:
            yield
        finally:
            self.rows = None

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block `index`'s keys and values for the current rows; joined once per set of rows, reused while the
        batch stays the same from step to step."""
        if self._joined is None or self._joined[0] != self.rows:
            self._joined = (self.rows, [None] * len(self.transformer.blocks))
        joined = self._joined[1]
        if joined[index] is None:
            joined[index] = (torch.cat([r.keys[index] for r in self.rows]),
                             torch.cat([r.values[index] for r in self.rows]))
        return joined[index]

    def forget(self) -> None:
        self._joined = None


class _Processor:
    def __init__(self, owner: CrossKV, index: int, fallback):
        self.owner = owner
        self.index = index
        self.fallback = fallback

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if self.owner.rows is None:
            return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        key, value = self.owner.layer(self.index)
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        out = dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                    backend=getattr(self.fallback, "_attention_backend", None), parallel_config=None)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))
