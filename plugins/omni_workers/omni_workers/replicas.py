"""Replicas: independent copies of one stage, each in a worker of its own, behind one Stage (`--replicas video=2`).

Each new request (a submit, or a hand-off from an upstream stage) goes to the replica with the least outstanding work
(the requests it holds or has events of, then the fewest restarts), and stays there: its events come back from that
replica, its streamed input's chunks and its abort go there. A replica that dies fails only its own requests (its
proxy's fault handling) and is restarted as any worker is; while it restarts, or once it is dead, new requests go to
the others. The stage is dead only when every replica is (its `dead`). Its stats add the replicas' up and list each
one's (`StageStats.replicas`, which `/metrics` labels by replica). On a machine with GPUs, give the front
`CUDA_VISIBLE_DEVICES=0,1`: replica i of a process placement then sees the i-th of them only (spawn.py); a Ray
replica reserves its own bundle.
"""

from __future__ import annotations

from omni_kernel.core.errors import StageUnavailable
from omni_kernel.core.request import StageInput, StageStats, StreamChunk
from omni_kernel.events import StageFailed, StageFinished

from .proxy import RemoteEngine
from .settings import WorkerStats


class ReplicaStage:
    """The Stage contract over `replicas` (proxies of one node, each with its own worker; see the module)."""

    def __init__(self, replicas: list):
        self.replicas = replicas
        self.node_id = replicas[0].node_id
        self.kind = replicas[0].kind
        self.owner: dict[str, object] = {}  # request id -> the replica that holds it
        self.engine = RemoteEngine(self)  # what the StageScheduler steps: each replica's events, taken together

    @property
    def concurrent_inputs(self) -> bool:
        return self.replicas[0].concurrent_inputs

    @property
    def dead(self) -> str | None:
        """Why the stage takes no more requests (every replica is dead: the first one's reason), or None."""
        return self.replicas[0].dead if all(r.dead is not None for r in self.replicas) else None

    def pick(self):
        """The replica with the least outstanding work among those that take requests now; with none, one that is
        restarting (a call to it waits for its build, or, where the group fails fast, is refused here as
        `stage unavailable`), else any."""
        taking = [r for r in self.replicas if r.dead is None and r.ready]
        alive = [r for r in self.replicas if r.dead is None]
        if not taking and alive and alive[0].group.fail_fast:
            raise StageUnavailable(f"stage unavailable: stage {self.node_id!r} has no replica that takes requests now "
                                   f"({len(alive)} restarting, {len(self.replicas) - len(alive)} dead)", None)
        return min(taking or alive or self.replicas, key=lambda r: (len(r.request_ids()), r.restarts))

    # The Stage contract.

    def events_for(self, outputs: list) -> list:
        return outputs

    def check(self, item: StageInput) -> None:
        self.pick().check(item)

    def submit(self, item: StageInput) -> None:
        replica = self.pick()
        replica.submit(item)
        self.owner[item.request_id] = replica

    def hand_off(self, item: StageInput) -> None:
        replica = self.pick()
        self.owner[item.request_id] = replica
        replica.hand_off(item)

    def append(self, chunk: StreamChunk) -> None:
        """A streamed input's next chunk, to the replica its hand-off went to."""
        replica = self.owner.get(chunk.request_id)
        if replica is not None:
            replica.append(chunk)

    def take_events(self) -> list:
        events = []
        for replica in self.replicas:
            if replica.has_unfinished():
                events += replica.take_events()
        for event in events:
            if isinstance(event, (StageFinished, StageFailed)):
                self.owner.pop(event.request_id, None)
        return events

    def abort(self, request_id: str) -> None:
        replica = self.owner.pop(request_id, None)
        for r in [replica] if replica is not None else self.replicas:
            r.abort(request_id)

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    def request_ids(self) -> set[str]:
        return set().union(*(r.request_ids() for r in self.replicas))

    def wait(self, timeout: float | None = None) -> bool:
        return self.replicas[0].wait(timeout)  # the group's wait: every worker of the graph, replicas included

    def wait_ready(self, timeout: float | None = None) -> None:
        for replica in self.replicas:
            replica.wait_ready(timeout)

    def stats(self) -> StageStats:
        each = tuple(r.stats() for r in self.replicas)
        kv = [s for s in each if s.kv_blocks_total is not None]
        placed = WorkerStats(restarts=sum(s.placed.restarts for s in each),
                             restarting=all(s.placed.restarting for s in each), replicas=each)
        return StageStats(
            running=sum(s.running for s in each), waiting=sum(s.waiting for s in each),
            kv_blocks_total=_total(s.kv_blocks_total for s in kv) if kv else None,
            kv_blocks_used=_total(s.kv_blocks_used for s in kv) if kv else None,
            prefix_hit_tokens=_total(s.prefix_hit_tokens for s in kv) if kv else None,
            model=_summed(s.model for s in each),
            dead=self.dead, placed=placed)

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()



def _total(values) -> int:
    return sum(v or 0 for v in values)


def _summed(models) -> dict[str, int | float]:
    """The replicas' model counters (StageStats.model), each summed over the replicas that count it."""
    total: dict[str, int | float] = {}
    for model in models:
        for name, value in model.items():
            total[name] = total.get(name, 0) + value
    return total
