"""Benchmark (not in CI): Wan replicas on two Ray nodes against one replica, on a real multi-node Ray cluster on this
machine (ray.cluster_utils.Cluster: a head with no CPUs and two nodes, as the tests' plugins/omni_workers/tests/
multinode.py).

Text-to-video requests (different prompts and seeds) go to `wan_t2v` on the tiny demo checkpoint, placement `ray`,
one torch thread per actor (`worker_threads=1`), each actor reserving one `slot` of its node (each node has two):

- two: `replicas="wan=2"`: two actors in one SPREAD placement group, one on each node; each request goes to the one
  with less outstanding work;
- one: one actor (a node of its own choosing), every request batched there.

Both are built once and kept loaded (three actors); a burst (all requests sent at once) runs on each in turn, rounds
alternating the order (A B, B A, ...); `ratio` is the median over rounds of one's burst time over two's. The bound:
the nodes are processes of this one machine, so two one-thread replicas can at best use two of its cores at once:
`min(2, cores)` over one replica at one thread (`ratio_bound`), less where one batches the burst's requests into
fewer forwards than two replicas' halves, and less when other work shares the cores (the load average is printed).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/ray_nodes.py [--requests N] [--steps N] [--rounds N]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from wan_devices import burst  # noqa: E402 - the same burst as the devices benchmark (its prompts too)

STORE = 80 << 20
HEALTH = {"health_check_period_ms": 200, "health_check_timeout_ms": 200, "health_check_failure_threshold": 5,
          "health_check_initial_delay_ms": 0}


def actor_nodes(stage) -> list[str]:
    """The Ray node ids of a stage's actors (each replica's)."""
    return [r.where for r in getattr(stage, "replicas", [stage])]


def start_cluster():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "object_store_memory": STORE, "_system_config": HEALTH})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"slot": 2}, object_store_memory=STORE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return ray, cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--num-frames", type=int, default=17)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4, help="rounds, alternating which side goes first")
    args = parser.parse_args()

    from omni_kernel import Omni
    from omni_wan.demo import ensure_demo_model

    ensure_demo_model()
    params = {"height": args.height, "width": args.width, "num_frames": args.num_frames,
              "num_inference_steps": args.steps, "preset": "smoke"}
    ray, cluster = start_cluster()
    config = {"device": "cpu", "placement": "ray", "worker_threads": 1, "ray_resources": "wan=slot:1"}
    try:
        with tempfile.TemporaryDirectory(prefix="omni-ray-nodes-") as tmp:
            work = Path(tmp)
            sides = {"two": Omni("wan_t2v", **config, replicas="wan=2"), "one": Omni("wan_t2v", **config)}
            nodes = {name: sorted(set(actor_nodes(o.graph.stages["wan"]))) for name, o in sides.items()}
            try:
                for omni in sides.values():  # warm-up: first forwards, the prepare cache's text encoder
                    burst(omni, 2, params, work)
                times: dict[str, list[float]] = {name: [] for name in sides}
                loads = []
                for i in range(args.rounds):
                    for name in list(sides) if i % 2 == 0 else list(sides)[::-1]:
                        times[name].append(burst(sides[name], args.requests, params, work))
                    loads.append(os.getloadavg()[0])
                    print(f"round {i}: two {times['two'][-1]:.2f} s, one {times['one'][-1]:.2f} s, load "
                          f"{loads[-1]:.1f}", file=sys.stderr, flush=True)
            finally:
                for omni in sides.values():
                    omni.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
    ratios = [one / two for one, two in zip(times["one"], times["two"])]
    print(json.dumps({
        "requests": args.requests, "steps": args.steps, "size": f"{args.height}x{args.width}x{args.num_frames}",
        "rounds": args.rounds, "nodes": {k: len(v) for k, v in nodes.items()},
        "burst_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
        "median_s": {k: round(statistics.median(v), 3) for k, v in times.items()},
        "ratio": round(statistics.median(ratios), 3), "ratios": [round(r, 3) for r in ratios],
        "cores": len(os.sched_getaffinity(0)), "ratio_bound": min(2, len(os.sched_getaffinity(0))),
        "load_avg_1m": [round(x, 1) for x in loads]}))


if __name__ == "__main__":
    main()
