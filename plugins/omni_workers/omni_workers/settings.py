"""The settings the `process` and `ray` placements declare (the kernel knows none of them: it takes their keys out
of a run's keywords, makes `omni run`/`omni serve` flags of them and hands the placement its instance), and what a
placed stage adds to its stats."""

from __future__ import annotations

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

    def replicas_of(self, node) -> int:
        run_wide, nodes = parse_replicas(self.replicas)
        return nodes.get(node.id) or run_wide or 1

    def check(self, plan, placement_of) -> None:
        """Per-node replicas name nodes of the plan, and only nodes placed in workers have replicas."""
        _, nodes = parse_replicas(self.replicas)
        check_node_ids("replicas", nodes, plan)
        for node in plan.nodes:
            if self.replicas_of(node) > 1 and placement_of(node) == INPROC:
                raise InvalidParameter("replicas", f"node {node.id!r} runs inproc; replicas need placement process "
                                                   "or ray")


@attrs.frozen
class WorkerStats:
    """What a worker-placed stage adds to its StageStats (`StageStats.placed`): its worker's restarts, whether a
    restarted worker is still building its stage, and a replicated stage's replicas' own stats, in order."""

    restarts: int = 0
    restarting: bool = False
    replicas: tuple[StageStats, ...] = ()
