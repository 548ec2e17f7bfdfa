"""What the engine thread publishes after each step for /metrics and /health: a `StageStats` per stage and the
engine-wide `Snapshot`, read from each stage's scheduler by `stage_stats`. Frozen, so a thread that reads
`AsyncOmni.snapshot` never sees one half-built."""

from __future__ import annotations

from collections.abc import Mapping

import attrs


@attrs.frozen
class StageStats:
    pipeline: str
    node: str
    kind: str
    running: int
    waiting: int
    dead: str | None = None
    kv_blocks_total: int | None = None
    kv_blocks_used: int | None = None
    prefix_hit_tokens: int | None = None
    restarts: int = 0  # of its worker process or Ray actor (placement process or ray)
    restarting: bool = False  # that worker is building its stage again: requests to it get 503 meanwhile


@attrs.frozen
class Snapshot:
    stages: tuple[StageStats, ...] = ()
    in_flight: int = 0
    dead: str | None = None
    steps: int = 0
    errors: Mapping[tuple[str, str, str], int] = attrs.Factory(dict)  # (pipeline, node, kind) -> count
    aborted: int = 0

    def pipeline_dead(self, pipeline: str) -> str | None:
        return self.dead or next((s.dead for s in self.stages if s.pipeline == pipeline and s.dead), None)


def stage_stats(pipeline: str, node_id: str, stage) -> StageStats:
    engine = getattr(stage, "engine", None)
    scheduler = getattr(engine, "scheduler", None)
    dead = getattr(engine, "dead", None)
    if scheduler is not None and hasattr(scheduler, "running") and hasattr(scheduler, "waiting"):
        running, waiting = len(scheduler.running), len(scheduler.waiting)
    else:
        held = len(stage.request_ids()) if dead is None else 0
        batch = getattr(scheduler, "max_batch", held) or held
        running, waiting = min(held, batch), max(held - batch, 0)
    blocks = getattr(scheduler, "blocks", None)
    kv = {}
    if blocks is not None and hasattr(blocks, "num_used"):
        kv = {"kv_blocks_total": blocks.num_blocks, "kv_blocks_used": blocks.num_used,
              "prefix_hit_tokens": getattr(blocks, "hit_tokens", None)}
    return StageStats(pipeline, node_id, stage.kind, running, waiting, None if dead is None else str(dead),
                      restarts=getattr(stage, "restarts", 0), restarting=bool(getattr(stage, "restarting", False)),
                      **kv)
