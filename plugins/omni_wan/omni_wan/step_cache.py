"""A request's step cache: what it remembers of its own transformer forwards, and how it decides each one.

The decisions are diffusers' own (0.42, `diffusers.hooks`), made per request instead of once per batch:

- `first_block` (FirstBlockCache): after the first block, the relative L1 change of that block's residual
  against the one of the last forward that ran every block, `mean(|r - r_prev|) / mean(|r_prev|)`; at or
  below the threshold the remaining blocks are skipped and their stored residual is added instead.
- `mag` (MagCache): before the first block, the calibrated magnitude ratio of this step is multiplied into
  an accumulated ratio whose distance from 1 accumulates into an error; while that error is at or below the
  threshold (at most `MAG_MAX_SKIP_STEPS` forwards in a row, never in the first `MAG_RETENTION_RATIO` of the
  steps) every block is skipped and the stored residual of all of them is added to the input.

Each guidance branch (cond, uncond) keeps its own BranchCache, as diffusers keeps one state per cache context.
A threshold of 0 never skips. The forward that applies the decisions is blocks.py. Imports no torch: the
params declare METHODS and DEFAULT_THRESHOLDS.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import torch

METHODS = ("none", "first_block", "mag")
DEFAULT_THRESHOLDS = {"first_block": 0.05, "mag": 0.06}  # FirstBlockCacheConfig's and MagCacheConfig's defaults
MAG_MAX_SKIP_STEPS = 3  # MagCacheConfig.max_skip_steps
MAG_RETENTION_RATIO = 0.2  # MagCacheConfig.retention_ratio


@attrs.frozen
class CachePolicy:
    """How one request caches: its method, threshold and steps; `mag` also its checkpoint's ratios, one per step
    (diffusers' nearest interpolation of the calibrated ones); `calibrate`: never skip, record the ratios."""

    method: str
    threshold: float
    steps: int
    ratios: tuple[float, ...] | None = None
    calibrate: bool = False

    @property
    def retention_steps(self) -> int:
        return int(MAG_RETENTION_RATIO * self.steps + 0.5)


@attrs.define(eq=False)
class BranchCache:
    """One guidance branch of one request: the residuals of its last full forward and its counters."""

    policy: CachePolicy
    head_residual: torch.Tensor | None = None  # first_block: the first block's residual (output - input)
    tail_residual: torch.Tensor | None = None  # the skipped blocks' residual: after the first (first_block), all (mag)
    step_index: int = 0
    accumulated_ratio: float = 1.0
    accumulated_err: float = 0.0
    accumulated_steps: int = 0
    num_forwards: int = 0
    num_skipped: int = 0
    last_hit: bool = False
    margin: float = math.inf  # the smallest |signal - threshold| of its decisions
    ratios: list[float] = attrs.Factory(list)  # calibration: the magnitude ratio of each forward

    def record(self, hit: bool) -> None:
        self.num_forwards += 1
        self.num_skipped += hit
        self.last_hit = hit

    def skips_first_block(self, signal: float) -> bool:
        """first_block, after the first block: skip the rest (FBCHeadBlockHook: `diff > threshold` computes)."""
        threshold = self.policy.threshold
        self.margin = min(self.margin, abs(signal - threshold))
        return threshold > 0 and not signal > threshold

    def skips_every_block(self) -> bool:
        """mag, before the first block (MagCacheHeadHook's accumulators, advanced on every forward)."""
        policy, step = self.policy, self.step_index
        self.step_index += 1
        if policy.calibrate or step < policy.retention_steps:
            return False
        self.accumulated_ratio *= policy.ratios[step] if step < len(policy.ratios) else 1.0
        self.accumulated_steps += 1
        self.accumulated_err += abs(1.0 - self.accumulated_ratio)
        self.margin = min(self.margin, abs(self.accumulated_err - policy.threshold))
        if (self.tail_residual is not None and policy.threshold > 0 and self.accumulated_err <= policy.threshold
                and self.accumulated_steps <= MAG_MAX_SKIP_STEPS):
            return True
        self.accumulated_ratio, self.accumulated_steps, self.accumulated_err = 1.0, 0, 0.0
        return False

    def keep_mag(self, residual: torch.Tensor) -> None:
        """mag after a full forward: its residual, and with `calibrate` its magnitude ratio to the last one."""
        if self.policy.calibrate:
            self.ratios.append(1.0 if self.tail_residual is None else magnitude_ratio(residual, self.tail_residual))
        self.tail_residual = residual


def magnitude_ratio(current: torch.Tensor, previous: torch.Tensor) -> float:
    """MagCache's calibration formula: the mean over tokens of |current| / |previous| (norms over channels)."""
    import torch

    current_norm = torch.linalg.norm(current.float(), dim=-1)
    previous_norm = torch.linalg.norm(previous.float(), dim=-1)
    return (current_norm / (previous_norm + 1e-8)).mean().item()


@attrs.define(eq=False)
class RequestCache:
    """A request's step cache (its DenoiseState's `step_cache`), one BranchCache per guidance branch."""

    policy: CachePolicy
    branches: dict[str, BranchCache] = attrs.Factory(dict)

    def branch(self, name: str) -> BranchCache:
        if name not in self.branches:
            self.branches[name] = BranchCache(self.policy)
        return self.branches[name]

    @property
    def num_forwards(self) -> int:
        return sum(b.num_forwards for b in self.branches.values())

    @property
    def num_skipped(self) -> int:
        return sum(b.num_skipped for b in self.branches.values())

    @property
    def margin(self) -> float:
        return min((b.margin for b in self.branches.values()), default=math.inf)

    def step_hit(self) -> bool:
        """Whether every transformer forward of its last step skipped its blocks."""
        return bool(self.branches) and all(b.last_hit for b in self.branches.values())


def interpolate(ratios: list[float], steps: int) -> tuple[float, ...]:
    """Calibrated ratios for `steps` denoise steps, as MagCacheConfig interpolates them (nearest)."""
    import torch
    from diffusers.hooks.mag_cache import nearest_interp

    table = torch.tensor(ratios)  # float32, as the config holds them
    return tuple((table if len(table) == steps else nearest_interp(table, steps)).tolist())
