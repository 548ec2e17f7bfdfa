"""Ray placement groups, made and removed here only: for a stage's actor, a replicated stage's actors and a
parallel stage's other ranks (docs/distributed.md, "Across machines").

A `Reservation` is one placement group, a bundle per actor (each the node's resources), with its strategy:
`PACK` for a stage alone, `SPREAD` for the replicas of one stage (Ray puts the bundles on distinct nodes where it
can, and packs them where it cannot), `STRICT_PACK` for a rank group (one node). The actors that use it hold it
(`hold`); the last `drop` removes it. Its bundles live as long as it does: when a node dies, Ray places that
node's bundles again where the cluster has room (at once, or when a node joins), and an actor started again in
its bundle waits for that.

`RayRankLauncher` is the rank launcher the `ray` placement hands a stage built in its actor (on the node it builds,
`NodeSpec.ranks`: omni_kernel/core/ranks.py): a parallel stage starts its other ranks with it, here one actor per
rank in a placement group of their own.
"""

from __future__ import annotations

import json
import sys

PLACE_TIMEOUT_S = 300.0  # a placement group no node can hold fails its start after this
GONE_TIMEOUT_S = 10.0  # close() waits this long for each killed actor to be reported dead


def ray_options(resources: dict, reservation: Reservation | None = None, index: int = 0) -> dict:
    """An actor's options for `resources` ({"CPU": 1, "GPU": 1, "node_a": 1}), in bundle `index` of
    `reservation` when given."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options = {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0)}
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    if custom:
        options["resources"] = custom
    if reservation is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(reservation.group, index)
    return options


class Reservation:
    """One placement group of `count` bundles of `resources`, shared by the actors that hold it."""

    def __init__(self, ray, resources: dict, count: int, strategy: str, name: str, near: str | None = None):
        """`near`: a Ray node id where a STRICT_PACK group goes when it has room (Ray's soft target)."""
        from ray.util.placement_group import placement_group

        self.ray, self.resources, self.strategy = ray, dict(resources), strategy
        target = {"_soft_target_node_id": near} if near and strategy == "STRICT_PACK" else {}
        self.group = placement_group([dict(resources)] * count, strategy=strategy, name=name, **target)
        self.holders = 0

    def hold(self) -> Reservation:
        self.holders += 1
        return self

    def wait_placed(self, timeout: float = PLACE_TIMEOUT_S) -> bool:
        """True once Ray has placed every bundle (False after `timeout`)."""
        try:
            self.ray.get(self.group.ready(), timeout=timeout)
        except Exception:  # noqa: BLE001 - GetTimeoutError: no node has the room
            return False
        return True

    def drop(self) -> None:
        self.holders -= 1
        if self.holders <= 0:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.group)
            except Exception:  # noqa: BLE001 - Ray is gone already
                pass


def kill_all(ray, actors: list, timeout: float = GONE_TIMEOUT_S) -> None:
    """Kill `actors` and return once Ray reports each dead (a call on it fails), `timeout` seconds at most."""
    probes = []
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
            probes.append(actor.__ray_ready__.remote())
        except Exception:  # noqa: BLE001 - dead already, or Ray is gone
            continue
    if probes:
        ray.wait(probes, num_returns=len(probes), timeout=timeout)


def node_alive(ray, node_id: str | None) -> bool:
    """Whether the Ray node `node_id` is alive (True where it cannot be told)."""
    if node_id is None:
        return True
    try:
        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())
    except Exception:  # noqa: BLE001 - Ray is gone: the actor's death is what is known
        return True


class RayRankLauncher:
    """Starts a stage's other ranks as Ray actors, one bundle each with the stage's own resources, in one
    placement group (`STRICT_PACK`, the default: all on one node, rank 0's where it has room; `PACK`: one node
    where one has room; `SPREAD`: distinct nodes where there are), reaching rank 0 at its node's address. The
    rank launcher a stage's actor is given (`NodeSpec.ranks`)."""

    def __init__(self, resources: dict, strategy: str = "STRICT_PACK"):
        self.resources, self.strategy = dict(resources), strategy
        self.groups: list[RayRanks] = []

    def __call__(self) -> RayRanks:
        group = RayRanks(self.resources, self.strategy)
        self.groups.append(group)
        return group

    def stop_all(self) -> None:
        """Stop every rank group started here, returning once Ray reports their actors dead: the stage's actor
        calls it before the front kills it, since the rank actors it owns would otherwise die only later, with it."""
        for group in self.groups:
            group.stop()
        self.groups = []


class RayRanks:
    """One rank group's actors: `launch(target, specs)` (`target` is "module:function", called with each spec
    in an actor of its own), `address`, `gone()` and `stop()` (docs/distributed.md)."""

    def __init__(self, resources: dict, strategy: str):
        import ray

        self.ray, self.resources, self.strategy = ray, resources, strategy
        self.address = ray.util.get_node_ip_address()
        self.actors: list = []
        self.runs: list = []
        self.reservation: Reservation | None = None

    def launch(self, target: str, specs: list[dict]) -> None:
        ray = self.ray
        here = ray.get_runtime_context().get_node_id()
        self.reservation = Reservation(ray, self.resources, len(specs), self.strategy, "omni-ranks", here).hold()
        if not self.reservation.wait_placed():
            self.stop()
            raise TimeoutError(f"Ray could not place the {len(specs)} other rank(s) of the stage, {self.resources} "
                               f"each ({self.strategy}), within {PLACE_TIMEOUT_S:g}s (see `ray status`)")
        actor = ray.remote(RankActor)
        for index, spec in enumerate(specs):
            handle = actor.options(**ray_options(self.resources, self.reservation, index)).remote()
            self.actors.append(handle)
            self.runs.append(handle.run.remote(target, json.dumps(spec), list(sys.path)))

    def gone(self) -> list[str]:
        if not self.runs:
            return []
        ended, _ = self.ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        return [f"rank {self.runs.index(run) + 1} (its Ray actor ended)" for run in ended]

    def stop(self) -> None:
        kill_all(self.ray, self.actors)
        self.actors, self.runs = [], []
        if self.reservation is not None:
            self.reservation.drop()
            self.reservation = None


class RankActor:
    """A rank other than 0 in a Ray actor: what the front imports, then the rank's loop (`target`)."""

    def run(self, target: str, spec: str, sys_path: list[str]) -> None:
        import importlib

        sys.path.extend(p for p in sys_path if p not in sys.path)
        module, _, function = target.partition(":")
        getattr(importlib.import_module(module), function)(json.loads(spec))
