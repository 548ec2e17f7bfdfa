"""The communication of one Wan forward split over ranks under torch.distributed (gloo on a CPU, NCCL on CUDA).

A group of `cfg x ulysses` ranks runs one forward: rank `cfg_rank * ulysses + seq_rank` computes guidance branch
`cfg_rank` (0: cond, 1: uncond) on sequence shard `seq_rank`. Its `Mesh` holds the two process groups it talks in:
the ranks of its branch (sequence parallel: all-to-all, gather) and the ranks of its shard (the branches' gather).
A sequence that does not divide the ranks is zero-padded at its end to the next multiple, and cut back after
the gather. Every function here is an exact data movement: no arithmetic touches a value.
"""

from __future__ import annotations

import datetime
from typing import Any

import attrs
import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 600  # a rank that never arrives fails its peers' collectives after this, not never


@attrs.frozen(eq=False)
class Mesh:
    """One rank's place in a parallel forward; a group of one (`None`) never communicates."""

    cfg: int
    ulysses: int
    cfg_rank: int
    seq_rank: int
    seq_group: Any = None  # the ranks of this guidance branch, by sequence shard
    cfg_group: Any = None  # the ranks of this sequence shard, by guidance branch

    @property
    def num_ranks(self) -> int:
        return self.cfg * self.ulysses

    @classmethod
    def build(cls, cfg: int, ulysses: int) -> Mesh:
        """This rank's mesh over the default process group, whose size is a multiple of `cfg x ulysses`: each
        block of that many consecutive ranks is one independent group (one replica of the stage). Every rank of
        the world must call it with the same degrees (new_group is collective)."""
        world, rank, size = dist.get_world_size(), dist.get_rank(), cfg * ulysses
        if world % size:
            raise ValueError(f"{world} ranks do not split into groups of cfg {cfg} x ulysses {ulysses}")
        seq_group = cfg_group = None
        for base in range(0, world, size):
            for branch in range(cfg if ulysses > 1 else 0):
                ranks = [base + branch * ulysses + index for index in range(ulysses)]
                group = dist.new_group(ranks)
                seq_group = group if rank in ranks else seq_group
            for index in range(ulysses if cfg > 1 else 0):
                ranks = [base + branch * ulysses + index for branch in range(cfg)]
                group = dist.new_group(ranks)
                cfg_group = group if rank in ranks else cfg_group
        local = rank % size
        return cls(cfg, ulysses, local // ulysses, local % ulysses, seq_group, cfg_group)


def open_store(address: str, port: int = 0, num_ranks: int = 1,
               timeout_s: float = COLLECTIVE_TIMEOUT_S) -> dist.TCPStore:
    """The group's rendezvous store. `port` 0: host it on a port the OS assigns (`store.port`, which the other
    ranks are told), so no port is picked free and then raced for; otherwise reach the one hosted there."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if port == 0:
        return dist.TCPStore(address, 0, num_ranks, is_master=True, timeout=timeout, wait_for_workers=False)
    return dist.TCPStore(address, port, num_ranks, is_master=False, timeout=timeout)


def init_ranks(rank: int, num_ranks: int, store: dist.Store, device: str = "cpu",
               timeout_s: float = COLLECTIVE_TIMEOUT_S) -> torch.device:
    """Join the default process group as `rank` through `store` (open_store); NCCL and GPU `rank` (modulo the
    visible GPUs) on CUDA, gloo on a CPU. The device this rank computes on."""
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, store=store, rank=rank, world_size=num_ranks,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def padded_length(length: int, num_ranks: int) -> int:
    """The length of a sequence padded to a multiple of the ranks (-(-a // b) is the ceiling)."""
    return -(-length // num_ranks) * num_ranks


def pad(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """`x` with zeros after its end along `dim` up to `length`."""
    missing = length - x.shape[dim]
    if not missing:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def shard(x: torch.Tensor, dim: int, mesh: Mesh) -> torch.Tensor:
    """This rank's shard of a sequence along `dim`, the sequence padded to a multiple of the ranks."""
    if mesh.ulysses == 1:
        return x
    full = pad(x, dim, padded_length(x.shape[dim], mesh.ulysses))
    return full.chunk(mesh.ulysses, dim=dim)[mesh.seq_rank].contiguous()


def gather_sequence(x: torch.Tensor, dim: int, length: int, mesh: Mesh) -> torch.Tensor:
    """The whole sequence from every rank's shard (the inverse of `shard`): gathered, then cut to `length`."""
    if mesh.ulysses == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(mesh.ulysses)]
    dist.all_gather(parts, x.contiguous(), group=mesh.seq_group)
    return torch.cat(parts, dim=dim).narrow(dim, 0, length)


def sequence_to_heads(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """(batch, tokens / N, heads, dim) on each of N ranks -> (batch, tokens, heads / N, dim): all the tokens of
    this rank's share of the heads (rank i: heads [i H/N, (i+1) H/N))."""
    if mesh.ulysses == 1:
        return x
    n, (batch, tokens, heads, dim) = mesh.ulysses, x.shape
    send = x.reshape(batch, tokens, n, heads // n, dim).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)  # received[i]: rank i's tokens, this rank's heads
    dist.all_to_all_single(received, send, group=mesh.seq_group)
    return received.permute(1, 0, 2, 3, 4).reshape(batch, n * tokens, heads // n, dim)


def heads_to_sequence(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """The inverse of `sequence_to_heads`: (batch, tokens, heads / N, dim) -> (batch, tokens / N, heads, dim)."""
    if mesh.ulysses == 1:
        return x
    n, (batch, tokens, heads, dim) = mesh.ulysses, x.shape
    send = x.reshape(batch, n, tokens // n, heads, dim).transpose(0, 1).contiguous()
    received = torch.empty_like(send)  # received[i]: this rank's tokens, rank i's heads
    dist.all_to_all_single(received, send, group=mesh.seq_group)
    return received.permute(1, 2, 0, 3, 4).reshape(batch, tokens // n, n * heads, dim)


def gather_branches(x: torch.Tensor, num_rows: list[int], mesh: Mesh) -> list[torch.Tensor]:
    """Every guidance branch's rows (branch i has `num_rows[i]`, known on every rank), from this rank's branch
    `x`: padded to the most rows for the gather, then cut."""
    if mesh.cfg == 1:
        return [x]
    most = max(num_rows)
    parts = [x.new_empty((most, *x.shape[1:])) for _ in range(mesh.cfg)]
    dist.all_gather(parts, pad(x, 0, most).contiguous(), group=mesh.cfg_group)
    return [part[:rows] for part, rows in zip(parts, num_rows)]
