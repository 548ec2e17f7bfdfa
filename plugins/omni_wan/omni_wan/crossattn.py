"""Cross-attention keys and values projected once per text, not once per denoise step, over its real tokens.

Every block of the Wan transformer projects the 512 text tokens to keys and values in every forward, although
the text never changes during a request, and then attends over all 512 although a prompt is a few dozen
tokens: the pipeline pads it with zero rows, which all project to one and the same key and value. At small
video sizes both are a large part of a forward (512 text tokens against e.g. 80 latent tokens).

`CrossKV.project` runs the text embedder and each block's `to_k`/`norm_k`/`to_v` once, exactly as the block
would, and keeps the keys and values of the real tokens plus one of the padding, with how many padding tokens it
stands for. Attention over n identical keys is attention over one of them with log(n) added to its score, so
`CrossKV.use(rows)` makes every block's cross-attention read those rows' keys and values with that additive
mask (and -inf for the slots a shorter text leaves empty in a batch): the same result, in float rounding, for a
fraction of the work. The forward gets a one-token placeholder text. Outside `use`, the blocks run diffusers' own
processor unchanged. The step cache (blocks.py) runs some blocks on a subset of the rows: it sets `rows` to
those while they run.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import attrs
import torch

MAX_JOINED = 4  # sets of rows kept joined: a batch's, and the subsets its step cache runs blocks on


@attrs.frozen(eq=False)
class TextKV:
    """One text's cross-attention keys and values, per block: (1, tokens, heads, head_dim). With `num_pad` > 0
    the last token is the padding's, standing for `num_pad` identical ones."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    num_pad: int = 0

    @property
    def num_tokens(self) -> int:
        return self.keys[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def num_pad(embeds: torch.Tensor) -> int:
    """How many rows at the end of one text's embeddings (text_len, dim) are all zero: the pipeline's padding."""
    nonzero = embeds.abs().amax(dim=-1).nonzero()
    return len(embeds) - (int(nonzero[-1]) + 1 if len(nonzero) else 0)


class CrossKV:
    """Installed on one transformer: a processor per block's attn2 that reads the current rows' keys and values."""

    def __init__(self, transformer):
        self.transformer = transformer
        self.rows: tuple[TextKV, ...] | None = None
        # the last sets of rows, joined: a step-cached forward runs its blocks on subsets of its rows
        self._joined: dict[tuple[TextKV, ...], tuple[list, torch.Tensor | None]] = {}
        for index, block in enumerate(transformer.blocks):
            if block.attn2.add_k_proj is not None:
                raise ValueError("the text key/value cache supports text-only cross-attention (Wan2.2 TI2V)")
            block.attn2.set_processor(_Processor(self, index, block.attn2.processor))

    @torch.no_grad()
    def project(self, embeds: torch.Tensor) -> list[TextKV]:
        """The keys and values every block computes from each row of these text embeddings
        (texts, text_len, text_dim), over its real tokens and one of its padding: one TextKV per row."""
        pads = [num_pad(row) for row in embeds]
        keep = [len(row) - pad + (1 if pad else 0) for row, pad in zip(embeds, pads)]
        context = self.transformer.condition_embedder.text_embedder(embeds[:, :max(keep)])
        keys, values = [], []
        for block in self.transformer.blocks:
            attn = block.attn2
            keys.append(attn.norm_k(attn.to_k(context)).unflatten(2, (attn.heads, -1)))
            values.append(attn.to_v(context).unflatten(2, (attn.heads, -1)))
        return [TextKV(tuple(k[i:i + 1, :n].clone() for k in keys), tuple(v[i:i + 1, :n].clone() for v in values),
                       pad) for i, (n, pad) in enumerate(zip(keep, pads))]

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

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Block `index`'s keys, values and additive mask for the current rows; joined once per set of rows, reused
        while the batch stays the same from step to step."""
        rows = self.rows
        if rows not in self._joined:
            if len(self._joined) >= MAX_JOINED:
                self._joined.clear()
            self._joined[rows] = ([None] * len(self.transformer.blocks), self._mask(rows))
        joined, mask = self._joined[rows]
        if joined[index] is None:
            width = max(r.num_tokens for r in rows)
            joined[index] = (torch.cat([_widen(r.keys[index], width) for r in rows]),
                             torch.cat([_widen(r.values[index], width) for r in rows]))
        return (*joined[index], mask)

    @staticmethod
    def _mask(rows: tuple[TextKV, ...]) -> torch.Tensor | None:
        """(rows, 1, 1, tokens): log(num_pad) on a padding token, -inf past a shorter text, 0 elsewhere."""
        width = max(r.num_tokens for r in rows)
        if all(r.num_pad <= 1 and r.num_tokens == width for r in rows):
            return None
        key = rows[0].keys[0]
        mask = torch.zeros(len(rows), 1, 1, width, dtype=key.dtype, device=key.device)
        for i, row in enumerate(rows):
            if row.num_pad:
                mask[i, ..., row.num_tokens - 1] = math.log(row.num_pad)
            mask[i, ..., row.num_tokens:] = float("-inf")
        return mask

    def forget(self) -> None:
        self._joined = {}


def _widen(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Zero slots after a shorter text's tokens (the mask gives them no weight)."""
    missing = width - tensor.shape[1]
    return tensor if not missing else torch.cat([tensor, tensor.new_zeros(1, missing, *tensor.shape[2:])], dim=1)


class _Processor:
    def __init__(self, owner: CrossKV, index: int, fallback):
        self.owner = owner
        self.index = index
        self.fallback = fallback

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if self.owner.rows is None:
            return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        key, value, mask = self.owner.layer(self.index)
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        out = dispatch_attention_fn(query, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False,
                                    backend=getattr(self.fallback, "_attention_backend", None), parallel_config=None)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))
