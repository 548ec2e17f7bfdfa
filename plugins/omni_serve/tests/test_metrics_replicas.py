"""/metrics of a replicated stage (`--replicas video=2`): the stage's gauges add its replicas up, and each replica
has its own series, labelled by its index, with its requests, restarts and whether it takes requests."""

from __future__ import annotations

import attrs
from prometheus_client.parser import text_string_to_metric_families

from omni_kernel.core.request import StageStats
from omni_serve.metrics import Metrics
from omni_serve.snapshot import Snapshot, StageSnapshot


@attrs.frozen
class PlacedStats:
    """A placement's own part of a StageStats (`placed`), shaped as omni-workers' WorkerStats; omni_serve reads it
    by field name, importing no placement plugin."""

    restarts: int = 0
    restarting: bool = False
    replicas: tuple[StageStats, ...] = ()


@attrs.frozen
class Replicated:
    """What a ReplicaStage reports (omni_workers/replicas.py): the sum, and each replica's stats."""

    kind: str = "diffusion"

    def stats(self) -> StageStats:
        each = (StageStats(running=2, waiting=1, placed=PlacedStats()),
                StageStats(dead="stage 'video': its worker died", placed=PlacedStats(restarts=1)))
        return StageStats(running=2, waiting=1, placed=PlacedStats(restarts=1, replicas=each))


def samples(metrics: Metrics) -> dict:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_replicated_stage_has_a_series_per_replica():
    snap = Snapshot(stages=(StageSnapshot.of("wan_i2v", "video", Replicated()),))
    got = samples(Metrics(lambda: snap, dict))

    def at(name, replica=None):
        labels = {"model": "wan_i2v", "stage": "video", **({"replica": replica} if replica else {})}
        return got[(name, tuple(sorted(labels.items())))]

    assert at("omni_requests_running") == 2 and at("omni_requests_waiting") == 1
    assert at("omni_stage_restarts_total") == 1 and at("omni_stage_restarting") == 0
    assert [at("omni_replica_requests_running", r) for r in "01"] == [2, 0]
    assert [at("omni_replica_requests_waiting", r) for r in "01"] == [1, 0]
    assert [at("omni_replica_restarts_total", r) for r in "01"] == [0, 1]
    assert [at("omni_replica_alive", r) for r in "01"] == [1, 0]


def test_a_stage_without_replicas_has_no_replica_series():
    snap = Snapshot(stages=(StageSnapshot.of("ar_text", "generate", attrs.evolve(Replicated(), kind="ar")),))
    in_process = attrs.evolve(snap.stages[0].stats, placed=None)  # a stage in this process: no placed stats
    plain = Snapshot(stages=(attrs.evolve(snap.stages[0], stats=in_process),))
    got = samples(Metrics(lambda: plain, dict))
    assert not [k for k in got if k[0].startswith("omni_replica_")]
    labels = (("model", "ar_text"), ("stage", "generate"))
    assert got[("omni_stage_restarts_total", labels)] == 0 and got[("omni_stage_restarting", labels)] == 0


@attrs.frozen
class OnNodes:
    """Ray-placed replicas (omni-workers' WorkerStats has `node`): one on node n1, one restarting with no node."""

    kind: str = "diffusion"

    def stats(self) -> StageStats:
        each = (StageStats(placed=PlacedOnNode(node="n1")), StageStats(placed=PlacedOnNode(1, True)))
        return StageStats(placed=PlacedOnNode(1, False, each))


@attrs.frozen
class PlacedOnNode:
    restarts: int = 0
    restarting: bool = False
    replicas: tuple[StageStats, ...] = ()
    node: str | None = None


def test_a_replica_restarting_is_not_alive_and_each_replica_names_its_node():
    from omni_serve.snapshot import placed_of

    snap = Snapshot(stages=(StageSnapshot.of("wan_t2v", "wan", OnNodes()),))
    got = samples(Metrics(lambda: snap, dict))
    alive = {dict(k[1])["replica"]: v for k, v in got.items() if k[0] == "omni_replica_alive"}
    assert alive == {"0": 1, "1": 0}
    nodes = [dict(k[1]) for k, v in got.items() if k[0] == "omni_stage_node" and v == 1]
    assert nodes == [{"model": "wan_t2v", "stage": "wan", "replica": "0", "node": "n1"}]
    assert [placed_of(r) for r in snap.stages[0].replicas] == [{"alive": True, "restarts": 0, "node": "n1"},
                                                               {"alive": False, "restarts": 1, "node": None}]
