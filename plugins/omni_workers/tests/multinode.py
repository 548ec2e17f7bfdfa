"""A real multi-node Ray cluster on this machine for the tests (`ray.cluster_utils.Cluster`, FACTS.md "Ray across
nodes on one machine"): a head with no CPUs (it runs the GCS, never a stage), one-CPU nodes with custom
resources, small object stores and Ray's fast health checks (a node removed without grace is known dead within
about a second); `no_ray_left`, the fixture that checks that no Ray process a test started outlives it."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest

from omni_kernel.testing import wait_until

STORE = 80 << 20
HEALTH = {"health_check_period_ms": 200, "health_check_timeout_ms": 200, "health_check_failure_threshold": 5,
          "health_check_initial_delay_ms": 0}
GONE_S = 30  # Ray's processes of a cluster shut down end within this


def _parent(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def _ours(pid: int) -> bool:
    """Started under this process, or orphaned (its parent gone): not another test run's Ray on this machine."""
    me = os.getpid()
    while pid > 1:
        pid = _parent(pid)
        if pid == me:
            return True
    return pid == 1


def _descendants(root: int) -> list[int]:
    """Every process under `root` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            children.setdefault(_parent(int(entry.name)), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        below = children.get(todo.pop(), [])
        found.extend(below)
        todo.extend(below)
    return found


def ray_pids() -> dict[int, str]:
    """The Ray processes of this test process, or orphaned: {pid: command line} (GCS, raylets, workers and actors,
    agents)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        ray = cmdline.startswith("ray::") or "/ray/" in cmdline or "gcs_server" in cmdline or "raylet" in cmdline
        if ray and _ours(int(entry.name)):
            found[int(entry.name)] = cmdline
    return found


class NodeCluster:
    """The cluster, its driver connected (this process), and `add` / `remove` of worker nodes."""

    def __init__(self, ray, cluster):
        self.ray, self.cluster = ray, cluster
        self.nodes: dict[str, object] = {}  # our name -> Cluster's node

    @property
    def address(self) -> str:
        return self.cluster.address

    def add(self, name: str, resources: dict) -> str:
        """A one-CPU node with `resources`; returns its Ray node id."""
        node = self.cluster.add_node(num_cpus=1, resources=resources, object_store_memory=STORE)
        self.cluster.wait_for_nodes()
        self.nodes[name] = node
        return node.node_id

    def remove(self, name: str) -> None:
        """A hard node failure: its raylet and every process under it (workers, actors and their children) killed
        at once, no grace. Ray's own remove_node kills only the raylet and lets its workers notice, and an actor
        that kept running that long finished work a dead machine could not have."""
        from ray._private import ray_constants

        node = self.nodes.pop(name)
        raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
        for pid in [raylet, *_descendants(raylet)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.cluster.remove_node(node, allow_graceful=False)

    def name_of(self, node_id: str | None) -> str | None:
        return next((name for name, node in self.nodes.items() if node.node_id == node_id), None)

    def actor_nodes(self, class_name: str = "StageActor") -> list[str]:
        """The Ray node ids of the live actors of `class_name`, from the GCS's own table."""
        from ray._private import state

        actors = state.actors().values()
        return sorted(a["Address"]["NodeID"] for a in actors
                      if a["ActorClassName"] == class_name and a["State"] == "ALIVE")


@pytest.fixture
def no_ray_left():
    """After the test: every Ray process it started (GCS, raylets, workers, actors, agents) has ended, within
    GONE_S, else the test fails naming them."""
    before = set(ray_pids())
    yield
    left: dict[int, str] = {}

    def gone() -> bool:
        left.clear()
        left.update({p: c for p, c in ray_pids().items() if p not in before})
        return not left

    try:
        wait_until(gone, GONE_S, "the test's Ray processes to end", interval=0.2)
    except AssertionError:
        pytest.fail(f"Ray processes outlived the test: {sorted(left.items())}")


@contextmanager
def ray_cluster(nodes: dict[str, dict], connect: bool = True):
    """A head and `nodes` ({name: custom resources}); the driver connected when `connect`. On exit Ray is shut
    down (the `no_ray_left` fixture checks that its processes end)."""
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError as exc:
        pytest.skip(f"Ray is not installed here ({exc}); `pip install 'omni-workers[ray]'` (make test does)")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "object_store_memory": STORE, "_system_config": HEALTH})
    try:
        made = NodeCluster(ray, cluster)
        for name, resources in nodes.items():
            made.add(name, resources)
        if connect:
            ray.init(address=cluster.address, log_to_driver=True)
        yield made
    finally:
        ray.shutdown()
        cluster.shutdown()
