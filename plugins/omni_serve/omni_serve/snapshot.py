"""What the serving loop publishes after each step for /metrics and /health: a `StageSnapshot` per stage (its
`Stage.stats()`, labelled with its pipeline and node) and the engine-wide `Snapshot`. Frozen, so a thread that
reads `AsyncOmni.snapshot` never sees one half-built.

What a placement adds to a stage's stats (`StageStats.placed`, an attrs value of the placement plugin's own) is
read by field name with a default, so this plugin imports no placement plugin: `restarts` (of the stage's worker
process or Ray actor), `restarting` (that worker is building its stage again: requests to it get 503 meanwhile)
`replicas` (a replicated stage's: each replica's own StageStats) and `node` (where its worker runs: a Ray actor's node
id). A stage in this process has none of them.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from omni_kernel.core.request import StageStats


def restarts_of(stats: StageStats) -> int:
    return int(getattr(stats.placed, "restarts", 0))


def restarting_of(stats: StageStats) -> bool:
    return bool(getattr(stats.placed, "restarting", False))


def replicas_of(stats: StageStats) -> tuple[StageStats, ...]:
    return tuple(getattr(stats.placed, "replicas", ()))


def node_of(stats: StageStats) -> str | None:
    return getattr(stats.placed, "node", None)


def placed_of(stats: StageStats) -> dict:
    """For /health: a placed stage's (or replica's) worker: alive (taking requests), its restarts, its node."""
    alive = stats.dead is None and not restarting_of(stats)
    return {"alive": alive, "restarts": restarts_of(stats), "node": node_of(stats)}


@attrs.frozen
class StageSnapshot:
    """One stage's `StageStats` (omni_kernel/core/request.py), with the pipeline, node and kind it belongs to."""

    pipeline: str
    node: str
    kind: str
    stats: StageStats = StageStats()

    @classmethod
    def of(cls, pipeline: str, node_id: str, stage) -> StageSnapshot:
        return cls(pipeline, node_id, stage.kind, stage.stats())

    @property
    def restarts(self) -> int:
        return restarts_of(self.stats)

    @property
    def restarting(self) -> bool:
        return restarting_of(self.stats)

    @property
    def replicas(self) -> tuple[StageStats, ...]:
        return replicas_of(self.stats)


@attrs.frozen
class Snapshot:
    stages: tuple[StageSnapshot, ...] = ()
    in_flight: int = 0
    dead: str | None = None
    steps: int = 0
    errors: Mapping[tuple[str, str, str], int] = attrs.Factory(dict)  # (pipeline, node, kind) -> count
    aborted: int = 0

    def pipeline_dead(self, pipeline: str) -> str | None:
        return self.dead or next((s.stats.dead for s in self.stages if s.pipeline == pipeline and s.stats.dead), None)
