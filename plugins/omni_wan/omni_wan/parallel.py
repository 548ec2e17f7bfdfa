"""WanParallel: one rank's part in a Wan stage whose denoise forwards run over a group of `cfg x ulysses` ranks.

Every rank holds the same transformer and the same DenoiseStates, and calls `Wan22I2VPipeline.denoise_batch` on
the same batch at each step. Guidance-parallel (`cfg` 2): the rank computes one branch, cond (branch 0) for every
row or uncond (branch 1) for the guided rows, and the branches are gathered, so every rank combines the same
predictions and steps each request's scheduler to the same latents. Ulysses (`ulysses` N): each forward is split
by sequence over the N ranks of a branch (ulysses.py). Both: 2 x N ranks, branch-major (comm.Mesh).

A batch with no guided row has no uncond branch: each rank computes the cond rows, alike.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

from omni_kernel.core.errors import InvalidParameter, UserError

from .blocks import row_mean
from .comm import Mesh, gather_branches
from .inputs import check_guidance
from .ulysses import Ulysses

NUM_BRANCHES = 2  # classifier-free guidance: cond and uncond


def check_degrees(cfg: int, ulysses: int, num_heads: int, device: str, guidance_scale: float,
                  count_devices: bool = True) -> None:
    """A stage's parallel degrees against its model, device and default guidance (its preset's), in one line
    each: Ulysses splits the attention heads, guidance-parallel needs the uncond branch, and on CUDA each rank
    has a GPU of its own among those this process sees (`count_devices`; on Ray each rank's actor reserves its
    own)."""
    if num_heads % ulysses:
        divisors = [str(d) for d in range(1, num_heads + 1) if not num_heads % d]
        raise InvalidParameter("wan_ulysses", f"{ulysses} does not divide the transformer's {num_heads} attention "
                                              f"heads (each rank attends with a share of them): use "
                                              f"{', '.join(divisors[:8])}{' ...' if len(divisors) > 8 else ''}")
    if cfg == NUM_BRANCHES:
        check_guidance(guidance_scale, cfg)
    if count_devices and device == "cuda" and cfg * ulysses > torch.cuda.device_count():
        raise UserError(f"wan_cfg_parallel {cfg} x wan_ulysses {ulysses} = {cfg * ulysses} ranks, one GPU each, "
                        f"but {torch.cuda.device_count()} CUDA device(s) are visible")



@attrs.define(eq=False)
class WanParallel:
    mesh: Mesh
    ulysses: Ulysses | None = None

    @classmethod
    def install(cls, model, mesh: Mesh) -> WanParallel:
        """Make `model` (a Wan22I2VPipeline that only this rank uses) run its forwards as this rank of `mesh`."""
        if mesh.cfg not in (1, NUM_BRANCHES):
            raise ValueError(f"guidance-parallel degree {mesh.cfg}: there are {NUM_BRANCHES} branches")
        if model.wan_device.offloaded:
            raise ValueError("a parallel forward keeps the transformer on its device: CPU offload is off")
        ulysses = Ulysses(model.pipe.transformer, mesh) if mesh.ulysses > 1 else None
        if ulysses is not None:
            model.blocks.row_mean = ulysses.row_mean  # a row's step-cache signal, over every rank's tokens
        model.parallel = cls(mesh, ulysses)
        return model.parallel

    def uninstall(self, model) -> None:
        """`model` as it was: single-device forwards."""
        if self.ulysses is not None:
            self.ulysses.remove()
            model.blocks.row_mean = row_mean
        model.parallel = None

    def branch(self, cond: tuple, uncond: tuple) -> tuple:
        """The pass (name, latents, timesteps, texts) this rank computes of a guided batch: its branch's."""
        return (cond, uncond)[self.mesh.cfg_rank]

    def gather(self, noise: list[torch.Tensor], num_rows: list[int]) -> list[torch.Tensor]:
        """Each row's prediction, cond rows then uncond rows, as one device's forwards give them, from this
        rank's branch (`noise`, one tensor a row; branch i has `num_rows[i]`) and the other's."""
        branches = gather_branches(torch.cat(noise), num_rows, self.mesh)
        return [row for branch in branches for row in branch.split(1)]

    def share_hits(self, cond: list, uncond: list) -> None:
        """Count the other branch's step-cache decisions into each request's cache too (`cond`: one BranchCache
        or None per row, `uncond` per guided row), so that rank 0 reports both branches."""
        mine, other = (cond, uncond)[self.mesh.cfg_rank], (cond, uncond)[1 - self.mesh.cfg_rank]
        flags = torch.tensor([[float(bool(b and b.last_hit))] for b in mine])
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        branches = gather_branches(flags.to(device), [len(cond), len(uncond)], self.mesh)
        for branch, flag in zip(other, branches[1 - self.mesh.cfg_rank].flatten().tolist()):
            if branch is not None:
                branch.record(bool(flag))
