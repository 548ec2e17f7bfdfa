"""What the engine thread publishes after each step for /metrics and /health: a `StageSnapshot` per stage (its
`Stage.stats()`, labelled with its pipeline and node) and the engine-wide `Snapshot`. Frozen, so a thread that
reads `AsyncOmni.snapshot` never sees one half-built."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from omni_kernel.core.request import StageStats


@attrs.frozen
class StageSnapshot:
    """One stage's `StageStats` (see omni_kernel/request.py), with the pipeline, node and kind it belongs to."""

    pipeline: str
    node: str
    kind: str
    running: int = 0
    waiting: int = 0
    dead: str | None = None
    kv_blocks_total: int | None = None
    kv_blocks_used: int | None = None
    prefix_hit_tokens: int | None = None
    restarts: int = 0  # of its worker process or Ray actor (placement process or ray)
    restarting: bool = False  # that worker is building its stage again: requests to it get 503 meanwhile
    replicas: tuple[StageStats, ...] = ()  # a replicated stage's (--replicas): each replica's own stats

    @classmethod
    def of(cls, pipeline: str, node_id: str, stage) -> StageSnapshot:
        stats: StageStats = stage.stats()
        return cls(pipeline, node_id, stage.kind, **attrs.asdict(stats, recurse=False))


@attrs.frozen
class Snapshot:
    stages: tuple[StageSnapshot, ...] = ()
    in_flight: int = 0
    dead: str | None = None
    steps: int = 0
    errors: Mapping[tuple[str, str, str], int] = attrs.Factory(dict)  # (pipeline, node, kind) -> count
    aborted: int = 0

    def pipeline_dead(self, pipeline: str) -> str | None:
        return self.dead or next((s.dead for s in self.stages if s.pipeline == pipeline and s.dead), None)
