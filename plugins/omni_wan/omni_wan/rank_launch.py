"""How rank 0 of a parallel Wan stage starts its other ranks (ranks.py): as processes on its machine, or, where
rank 0 is itself a Ray actor (placement `ray`), as Ray actors in one placement group of a bundle per rank.

Each launcher gives `launch(specs)` (one spec per rank 1..N-1, whose "entry" is what the rank runs), `address`
(where the others reach rank 0), `gone()` (the ranks that ended, in words) and `stop()`.
"""

from __future__ import annotations

import json
import os
import sys

from omni_kernel.core.errors import UserError
from omni_kernel.util.launch import Child, start

LOOPBACK = "127.0.0.1"
PLACE_TIMEOUT_S = 300.0  # a placement group no node can hold fails the start after this


def in_ray_actor() -> bool:
    """This process is a Ray actor (rank 0 of a stage placed on Ray)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def launcher(resources: dict | None):
    return RayRanks(resources or {"CPU": 1}) if in_ray_actor() else ProcessRanks()


class ProcessRanks:
    """The ranks as fresh interpreters on this machine, started by the kernel's launcher (omni_kernel/util/
    launch.py): each dies with this process, and says how it ended."""

    address = LOOPBACK

    def __init__(self):
        self.children: list[Child] = []

    def launch(self, specs: list[dict]) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.children = [start(spec["entry"], spec, env=env) for spec in specs]

    def gone(self) -> list[str]:
        return [f"rank {i} ({c.cause()})" for i, c in enumerate(self.children, 1) if c.poll() is not None]

    def stop(self) -> None:
        for child in self.children:
            child.kill()
        self.children = []


class RayRanks:
    """The ranks as Ray actors, one bundle each (rank 0's own resources, e.g. {"GPU": 1}) in one placement group;
    they reach rank 0 at its node's address, so the group may span machines."""

    def __init__(self, resources: dict):
        import ray

        self.ray, self.resources = ray, dict(resources)
        self.address = ray.util.get_node_ip_address()
        self.actors: list = []
        self.runs: list = []
        self.pg = None

    def launch(self, specs: list[dict]) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, r = self.ray, self.resources
        self.pg = placement_group([r] * len(specs), strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=PLACE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - GetTimeoutError: no node has the resources
            self.stop()
            raise UserError(f"Ray could not place the {len(specs)} other rank(s) of the stage, {r} each, within "
                            f"{PLACE_TIMEOUT_S:g}s (see `ray status`)") from None
        actor = ray.remote(RankActor)
        custom = {k: v for k, v in r.items() if k not in ("CPU", "GPU")}
        for index, spec in enumerate(specs):
            handle = actor.options(num_cpus=r.get("CPU", 0), num_gpus=r.get("GPU", 0), resources=custom or None,
                                   scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, index)).remote()
            self.actors.append(handle)
            self.runs.append(handle.run.remote(json.dumps(spec), list(sys.path)))

    def gone(self) -> list[str]:
        if not self.runs:
            return []
        ended, _ = self.ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        return [f"rank {self.runs.index(run) + 1} (its Ray actor ended)" for run in ended]

    def stop(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for handle in self.actors:
            self.ray.kill(handle)
        self.actors, self.runs = [], []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


class RankActor:
    """A rank other than 0 in a Ray actor: what the front imports, then the rank's loop (ranks.rank_main)."""

    def run(self, spec: str, sys_path: list[str]) -> None:
        sys.path.extend(p for p in sys_path if p not in sys.path)
        from omni_wan.ranks import rank_main

        rank_main(json.loads(spec))
