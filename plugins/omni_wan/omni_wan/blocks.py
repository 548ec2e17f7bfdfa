"""CachedBlocks: the Wan transformer's block loop, each row of a forward deciding its step cache for itself.

Installed once on a transformer with diffusers' own hook registry (the mechanism of its cache hooks): block 0
gets a hook that, inside `use(rows)` (one BranchCache or None per row of the forward), runs the whole loop:

1. the `mag` rows decide before block 0 (step_cache.py); those that skip get their input plus their stored
   residual, and take no part in any block;
2. block 0 runs on every other row; the `first_block` rows decide on its residual, one signal each;
3. the rows that miss and the uncached rows are gathered and run through the remaining blocks (only they),
   then scattered back; a `first_block` row that hits gets block 0's output plus its stored residual.

The remaining blocks' hooks then hand their input on unchanged. A forward in which no row skips runs every
block on the whole batch: the uncached forward itself, bit for bit. Outside `use`, or with no cached row, the
blocks run diffusers' forward as it is. The text's projected keys and values (crossattn.py) follow the rows a
block runs on. Under Ulysses, `row_mean` is the sequence-parallel one: the signal of a row is reduced over
the ranks of its group, so they all decide alike.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from diffusers.hooks import HookRegistry, ModelHook

from .step_cache import BranchCache

HEAD_HOOK = "omni_step_cache_head"
PASS_HOOK = "omni_step_cache_pass"


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """Each row's mean over everything else, in float32: (rows,)."""
    return x.float().mean(dim=tuple(range(1, x.ndim)))


class CachedBlocks:
    def __init__(self, transformer, cross_kv=None):
        self.blocks = list(transformer.blocks)
        self.cross_kv = cross_kv
        self.rows: list[BranchCache | None] | None = None
        self.passing = False  # the rest of this forward's blocks already ran (on the rows that needed them)
        self.row_mean = row_mean
        HookRegistry.check_if_exists_or_initialize(self.blocks[0]).register_hook(_Head(self), HEAD_HOOK)
        for block in self.blocks[1:]:
            HookRegistry.check_if_exists_or_initialize(block).register_hook(_Pass(self), PASS_HOOK)

    @contextmanager
    def use(self, rows: list[BranchCache | None]):
        """The next forward's rows, each with its branch's cache or None (uncached)."""
        self.rows = rows if any(r is not None for r in rows) else None
        try:
            yield
        finally:
            self.rows, self.passing = None, False

    def forward(self, first_block, hidden, context, temb, rotary) -> torch.Tensor:
        rows = self.rows
        skipping = [r is not None and r.policy.method == "mag" and r.skips_every_block() for r in rows]
        run = [i for i, skip in enumerate(skipping) if not skip]
        first_in = take(hidden, run)
        first_out = self._run([first_block], first_in, context, temb, rotary, run) if run else first_in
        residual = first_out - first_in
        hits = self._first_block_hits(rows, run, residual)
        tail = [k for k in range(len(run)) if k not in hits]
        tail_rows = [run[k] for k in tail]
        tail_out = self._run(self.blocks[1:], take(first_out, tail), context, temb, rotary, tail_rows)
        self._keep(rows, run, hits, hidden, first_out, residual, tail_out)
        if len(tail_rows) == len(rows):
            return tail_out  # no row skipped: the forward's own output
        output = torch.empty_like(hidden)
        if tail_rows:
            output[tail_rows] = tail_out
        for k in hits:
            output[run[k]] = first_out[k] + rows[run[k]].tail_residual[0]
        for i in (i for i, skip in enumerate(skipping) if skip):
            output[i] = hidden[i] + rows[i].tail_residual[0]
        return output

    def _first_block_hits(self, rows, run: list[int], residual: torch.Tensor) -> set[int]:
        """The positions in `run` of the first_block rows that skip the remaining blocks: each row's relative L1
        change of block 0's residual against its own last one (FBCHeadBlockHook's signal)."""
        known = [k for k, i in enumerate(run) if rows[i] is not None and rows[i].policy.method == "first_block"
                 and rows[i].head_residual is not None]
        if not known:
            return set()
        current = take(residual, known)
        previous = torch.cat([rows[run[k]].head_residual for k in known])
        signals = (self.row_mean((current - previous).abs()) / self.row_mean(previous.abs())).tolist()
        return {k for k, signal in zip(known, signals) if rows[run[k]].skips_first_block(signal)}

    @staticmethod
    def _keep(rows, run, hits, hidden, first_out, residual, tail_out) -> None:
        """Each cached row's residuals of a forward that ran every block, and its counters."""
        position = 0
        for k, i in enumerate(run):
            row = rows[i]
            if k in hits:
                row.record(True)
                continue
            if row is not None:
                if row.policy.method == "first_block":
                    row.head_residual = residual[k:k + 1].clone()
                    row.tail_residual = tail_out[position:position + 1] - first_out[k:k + 1]
                else:
                    row.keep_mag(tail_out[position:position + 1] - hidden[i:i + 1])
                row.record(False)
            position += 1
        for i in set(range(len(rows))) - set(run):
            rows[i].record(True)

    def _run(self, blocks, hidden, context, temb, rotary, indices: list[int]) -> torch.Tensor:
        """`blocks` on the rows `indices` of the forward (`hidden` holds just those)."""
        if not indices:
            return hidden
        context, temb = take(context, indices), take(temb, indices)
        with self._text_of(indices):
            for block in blocks:
                hidden = block(hidden, context, temb, rotary)
        return hidden

    @contextmanager
    def _text_of(self, indices: list[int]):
        """The projected text keys and values of just these rows, while a block runs on them."""
        kv = self.cross_kv
        if kv is None or kv.rows is None or len(indices) == len(kv.rows):
            yield
            return
        rows = kv.rows
        kv.rows = tuple(rows[i] for i in indices)
        try:
            yield
        finally:
            kv.rows = rows


def take(x: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """The rows `indices` (ascending) of `x`; all of them: `x` itself."""
    if len(indices) == x.shape[0]:
        return x
    return x[torch.tensor(indices, device=x.device, dtype=torch.long)]


class _Head(ModelHook):
    def __init__(self, owner: CachedBlocks):
        super().__init__()
        self.owner = owner

    def new_forward(self, module, *args, **kwargs):
        owner = self.owner
        owner.passing = False
        if owner.rows is None or kwargs:
            return self.fn_ref.original_forward(*args, **kwargs)
        output = owner.forward(self.fn_ref.original_forward, *args)
        owner.passing = True
        return output


class _Pass(ModelHook):
    def __init__(self, owner: CachedBlocks):
        super().__init__()
        self.owner = owner

    def new_forward(self, module, *args, **kwargs):
        if self.owner.passing:
            return args[0]
        return self.fn_ref.original_forward(*args, **kwargs)
