"""The settings the `process` and `ray` placements declare (the kernel knows none of them: it takes their keys out
of a run's keywords, makes `omni run`/`omni serve` flags of them and hands the placement its instance), and what a
placed stage adds to its stats."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from omni_kernel.core.errors import InvalidParameter
from omni_kernel.core.params import integer, option, text
from omni_kernel.core.placement import INPROC, check_node_ids, per_node
from omni_kernel.core.request import StageStats

from .cores import SHARED


def _threads(value: Any) -> Any:
    """`--worker-threads` text to its value: an integer, or `shared` as it is."""
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return value


def _check_threads(instance, attribute, value) -> None:
    if value is None or value == SHARED:
        return
    if type(value) is not int or value < 1:
        raise InvalidParameter(attribute.name, f"{value!r} is not an integer >= 1 or 'shared'")


def _replica_count(text: str) -> int | None:
    if not text.isdigit() or int(text) < 1:
        return None
    return int(text)


def parse_replicas(value: Any) -> tuple[int | None, dict[str, int]]:
    """(run-wide count, {node id: count}) of a replicas setting: 2, "video=2", "1,video=2", or a mapping."""
    return per_node("replicas", value, "N", _replica_count, "an integer >= 1")


def _check_replicas(instance, attribute, value) -> None:
    parse_replicas(value)


RESOURCES_FORM = "NAME:AMOUNT[+NAME:AMOUNT...] with amounts >= 0 (e.g. GPU:1, CPU:2+node_a:1)"
RANK_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD")


def _amount(text: str) -> float | None:
    try:
        amount = float(text)
    except ValueError:
        return None
    return amount if 0 <= amount < float("inf") else None


def _resources(text: str) -> dict[str, float] | None:
    """`GPU:1+node_a:1` as Ray resources ({"GPU": 1.0, "node_a": 1.0}); None where it is not that form."""
    resources = {}
    for part in text.split("+"):
        name, sep, amount = (p.strip() for p in part.partition(":"))
        value = _amount(amount)
        if not sep or not name or not name.replace("_", "").replace("-", "").isalnum() or value is None:
            return None
        resources[name] = value
    return resources


def parse_ray_resources(value: Any) -> tuple[dict | None, dict[str, dict]]:
    """(run-wide resources, {node id: resources}) of a ray_resources setting: "video=GPU:1,bridge=CPU:2", or a
    mapping of node id to that text or to a mapping ({"video": {"GPU": 1}})."""
    if isinstance(value, Mapping):
        value = {k: "+".join(f"{n}:{a}" for n, a in v.items()) if isinstance(v, Mapping) else v
                 for k, v in value.items()}
    return per_node("ray_resources", value, "NAME:AMOUNT[+...]", _resources, RESOURCES_FORM)


def _check_ray_resources(instance, attribute, value) -> None:
    parse_ray_resources(value)




@attrs.frozen
class WorkersSettings:
    """How stage workers (processes or Ray actors) behave: docs/distributed.md."""

    replicas: Any = option(None, help="independent copies of a worker-placed stage, each request to the least "
                                      "loaded: N for every node, or per node as video=2 (docs/distributed.md)",
                           flag="--replicas", metavar="N|NODE=N,...", validator=_check_replicas)
    max_restarts: int = option(1, help="restarts of a stage worker that died, before its stage fails", type=int,
                               flag="--max-restarts", metavar="N", validator=integer(0))
    worker_threads: Any = option(None, help="torch threads in each stage worker: N, or shared (the worker processes "
                                            "lend each other their cores: one busy alone uses all of them); default: "
                                            "the library's", flag="--worker-threads", metavar="N|shared",
                                 converter=_threads, validator=_check_threads)
    ray_address: str | None = option(None, help="the Ray cluster for --placement ray, e.g. HEAD_IP:6379 (default: a "
                                                "local Ray)", flag="--ray-address", metavar="ADDRESS", validator=text)

    ray_resources: Any = option(None, help="the Ray resources of each Ray-placed stage's actor (each replica's, each "
                                           "rank's): NODE=NAME:AMOUNT[+NAME:AMOUNT...],... e.g. video=GPU:1,bridge="
                                           "node_a:1; CPU and GPU are num_cpus / num_gpus (default: the plan's, else "
                                           "CPU:1)", flag="--ray-resources", metavar="NODE=NAME:AMOUNT,...",
                                validator=_check_ray_resources)
    ray_rank_strategy: str = option("STRICT_PACK", help="the Ray placement strategy of a parallel stage's other "
                                                        "ranks: STRICT_PACK (one node, rank 0's where it has room), "
                                                        "PACK or SPREAD", flag="--ray-rank-strategy",
                                    choices=RANK_STRATEGIES)

    def resources_of(self, node) -> dict[str, float]:
        """The Ray resources of the node's actor: the run's for it, the run's for every node, the plan's, CPU:1."""
        run_wide, nodes = parse_ray_resources(self.ray_resources)
        return dict(nodes.get(node.id) or run_wide or node.resources or {"CPU": 1})

    def replicas_of(self, node) -> int:
        run_wide, nodes = parse_replicas(self.replicas)
        return nodes.get(node.id) or run_wide or 1

    def check(self, plan, placement_of) -> None:
        """Per-node replicas and Ray resources name nodes of the plan, only nodes placed in workers have replicas
        and only nodes placed on Ray have Ray resources."""
        _, nodes = parse_replicas(self.replicas)
        check_node_ids("replicas", nodes, plan)
        _, resources = parse_ray_resources(self.ray_resources)
        check_node_ids("ray_resources", resources, plan)
        for node_id in resources:
            placed = placement_of(next(n for n in plan.nodes if n.id == node_id))
            if placed != "ray":
                raise InvalidParameter("ray_resources", f"node {node_id!r} runs {placed}; Ray resources need "
                                                        "placement ray")
        for node in plan.nodes:
            if self.replicas_of(node) > 1 and placement_of(node) == INPROC:
                raise InvalidParameter("replicas", f"node {node.id!r} runs inproc; replicas need placement process "
                                                   "or ray")


@attrs.frozen
class WorkerStats:
    """What a worker-placed stage adds to its StageStats (`StageStats.placed`): its worker's restarts, whether a
    restarted worker is still building its stage (or, on Ray, waiting for a node with room), a replicated stage's
    replicas' own stats, in order, and the node its worker runs on."""

    restarts: int = 0
    restarting: bool = False
    replicas: tuple[StageStats, ...] = ()
    node: str | None = None  # where its worker runs, where the placement tells: a Ray actor's node id
