"""Placement `ray` across nodes of a real Ray cluster (ray.cluster_utils.Cluster on this machine: a head with no
CPUs, one-CPU nodes with custom resources, ray_cluster.py): stages on the nodes their `ray_resources` name,
replicas on distinct nodes, a node removed without grace mid-burst (only its requests fail, its replica comes back
on a node that joins), and `omni serve --placement ray` against the cluster while a node goes and comes. Each
test starts its own cluster and checks that none of its Ray processes outlive it. Skipped where Ray is not
installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from omni_kernel import Omni
from omni_kernel.core.errors import RequestError
from omni_kernel.events import RequestFailed, RequestFinished
from omni_kernel.testing import drain, wait_until

sys.path.insert(0, str(Path(__file__).parent))
from multinode import no_ray_left, ray_cluster  # noqa: E402
from test_workers import within  # noqa: E402
from worker_fakes import make_host  # noqa: E402

pytestmark = [pytest.mark.process, pytest.mark.usefixtures(no_ray_left.__name__)]

IMAGE = Path(__file__).resolve().parents[3] / "examples" / "assets" / "image.png"
SIZE = {"height": 64, "width": 96, "num_frames": 9, "num_inference_steps": 4}
BACK_S = 120  # a lost replica is back within this once a node with room has joined (docs/distributed.md)


def finished(events) -> dict:
    return {e.request_id: e for e in events if isinstance(e, (RequestFinished, RequestFailed))}


def test_replicas_spread_over_nodes_where_one_could_hold_them_and_close_waits_for_their_end():
    """SPREAD: two replicas of one bundle each (slot:1) on distinct nodes although either node has four slots;
    close() returns once Ray reports every actor dead."""
    with ray_cluster({"a": {"slot": 4}, "b": {"slot": 4}}) as cluster:
        with Omni("fake_slow", host=make_host(), placement="words=ray", replicas="words=2",
                  ray_resources="words=slot:1") as o:
            words = o.graph.stages["words"]
            assert sorted(cluster.actor_nodes()) == sorted(node.node_id for node in cluster.nodes.values())
            assert sorted(r.where for r in words.replicas) == cluster.actor_nodes()
            assert o.generate("one two").text == "rendered 2 words"
        assert cluster.actor_nodes() == []


def test_a_stage_no_node_can_hold_fails_its_build_in_one_line_within_the_bound(monkeypatch):
    import omni_workers.ray_stage

    monkeypatch.setattr(omni_workers.ray_stage, "PLACE_TIMEOUT_S", 2.0)
    with ray_cluster({"a": {"slot": 1}}) as cluster:
        got = within(lambda: Omni("fake_slow", host=make_host(), placement="words=ray",
                                  ray_resources="words=slot:2"), timeout=60)
        assert isinstance(got, RequestError), got
        says = "stage 'words': Ray could not place it with resources {'slot': 2.0} (PACK) within 2s; see `ray status`"
        assert str(got) == says
        assert cluster.actor_nodes() == []


def test_qwen_to_wan_i2v_with_its_stages_on_two_nodes_matches_inproc(tmp_path):
    np = pytest.importorskip("numpy")
    params = dict(image=str(IMAGE), max_tokens=6, seed=3, return_frames=True, **SIZE)
    want = Omni("qwen_to_wan_i2v", device="cpu").generate("a fox in the snow", output=str(tmp_path / "a.mp4"),
                                                           **params)
    with ray_cluster({"a": {"node_a": 1}, "b": {"node_b": 1}}) as cluster:
        with Omni("qwen_to_wan_i2v", device="cpu", placement="ray", worker_threads=1,
                  ray_resources="bridge=node_a:1+CPU:1,video=node_b:1+CPU:1") as o:
            a, b = cluster.nodes["a"].node_id, cluster.nodes["b"].node_id
            assert cluster.actor_nodes() == sorted([a, b])  # one actor per stage, from the GCS's table
            assert (o.graph.stages["bridge"].where, o.graph.stages["video"].where) == (a, b)
            got = o.generate("a fox in the snow", output=str(tmp_path / "b.mp4"), **params)
        assert got.outputs["bridge"].text == want.outputs["bridge"].text
        assert np.allclose(got.output.data["frames"], want.output.data["frames"], atol=1e-4)


def _burst(o, tmp_path: Path, tag: str, steps: int = SIZE["num_inference_steps"]) -> tuple[list[str], dict]:
    """Six text-to-video requests submitted; (their ids, {id: the replica that holds it})."""
    size = {**SIZE, "num_inference_steps": steps}
    ids = [o.submit(o.request(f"a kite {tag} {i}", seed=i, output=str(tmp_path / f"{tag}{i}.mp4"), **size))
           for i in range(6)]
    wan = o.graph.stages["wan"]
    return ids, {rid: wan.owner[rid] for rid in ids}


def test_wan_replicas_on_two_nodes_a_node_dies_mid_burst_and_its_replica_comes_back(tmp_path):
    """Two Wan replicas (CPU:1 each, one per one-CPU node), a burst of 6: three each. Node b removed without
    grace before any finished: its three fail, naming the stage, the replica and its dead node, the other three
    finish; with no room left the replica waits; a node joins, the replica comes back there and the next burst
    uses both."""
    from omni_wan.demo import ensure_demo_model

    ensure_demo_model()
    with ray_cluster({"a": {"slot": 1}, "b": {"slot": 1}}) as cluster:
        with Omni("wan_t2v", device="cpu", placement="ray", replicas="wan=2", worker_threads=1,
                  ray_resources="wan=CPU:1", max_restarts=2) as o:
            wan = o.graph.stages["wan"]
            assert sorted(r.where for r in wan.replicas) == cluster.actor_nodes() == sorted(
                n.node_id for n in cluster.nodes.values())
            # 60 steps: seconds of work a replica, so node b goes while its three still run (at 4 steps a quiet
            # machine finished them before the removal took effect)
            ids, owner = _burst(o, tmp_path, "first", steps=60)
            assert sorted(sum(owner[rid] is r for rid in ids) for r in wan.replicas) == [3, 3]
            lost = next(r for r in wan.replicas if cluster.name_of(r.where) == "b")
            kept = next(r for r in wan.replicas if r is not lost)
            lost_node = lost.where
            cluster.remove("b")
            done = finished(within(lambda: drain(o), timeout=300))
            for rid in ids:
                if owner[rid] is lost:
                    failed = done[rid]
                    assert isinstance(failed, RequestFailed), failed
                    says = f"stage 'wan' replica {lost.replica}: its Ray node {lost_node[:12]} died (and its actor"
                    assert failed.error.startswith(says) and "\n" not in failed.error, failed.error
                else:
                    assert isinstance(done[rid], RequestFinished), done[rid]
            assert lost.restarting and kept.where == cluster.nodes["a"].node_id
            meanwhile = o.submit(o.request("a kite meanwhile", output=str(tmp_path / "meanwhile.mp4"), **SIZE))
            assert wan.owner[meanwhile] is kept  # the live replica takes it
            assert isinstance(finished(within(lambda: drain(o), timeout=300))[meanwhile], RequestFinished)
            c = cluster.add("c", {"slot": 1})
            group = o.graph.placed[0]
            wait_until(lambda: (group.watch(0.2), lost.ready)[1], BACK_S, "the lost replica back on node c")
            assert lost.where == c and sorted(cluster.actor_nodes()) == sorted([c, kept.where])
            ids, owner = _burst(o, tmp_path, "second")
            assert sorted(sum(owner[rid] is r for rid in ids) for r in wan.replicas) == [3, 3]
            done = finished(within(lambda: drain(o), timeout=300))
            assert all(isinstance(done[rid], RequestFinished) for rid in ids), done
            assert [r.restarts for r in wan.replicas if r is lost] == [1]


def _health(http) -> dict:
    r = http.get("/health")
    assert r.status_code == 200, r.text
    return r.json()


def _chat(http) -> str:
    r = http.post("/v1/chat/completions", json={"model": "ar_text", "max_tokens": 6, "temperature": 0,
                                                "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.server
def test_omni_serve_on_the_cluster_while_a_node_goes_and_another_joins(omni_cache, tmp_path):
    """`omni serve --placement ray --ray-address` on the cluster: the AR and the Wan actor on the two one-CPU nodes;
    the Wan node removed without grace while a video job runs: that job fails naming its node, a chat is served
    meanwhile, /health stays 200 and shows the Wan stage not alive; a node joins, the Wan stage comes back on it
    (/health, /metrics) and the next video job completes."""
    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "omni_serve" / "tests"))
    from omni_wan.demo import ensure_demo_model

    from serving import ServerProcess, video_done

    ensure_demo_model()
    with ray_cluster({"a": {"slot": 1}, "b": {"slot": 1}}) as cluster:
        server = ServerProcess(["--pipeline", "ar_text", "--pipeline", "wan_t2v", "--placement", "ray",
                                "--ray-address", cluster.address, "--worker-threads", "1", "--max-restarts", "2",
                                "--output-dir", str(tmp_path / "videos"), "--shutdown-timeout", "5"],
                               tmp_path / "server.log")
        try:
            server.wait_ready(240)
            with httpx.Client(base_url=server.url, timeout=120) as http:
                placed = _health(http)["placed"]
                (ar,), (wan,) = placed["ar_text/generate"], placed["wan_t2v/wan"]
                assert ar["alive"] and wan["alive"] and {ar["node"], wan["node"]} == {
                    n.node_id for n in cluster.nodes.values()}, placed
                expected = _chat(http)
                body = {"prompt": "a kite", "model": "wan_t2v", "size": "64x96", "num_frames": "9", "seed": "1"}
                # 256x256x17 at 200 steps: long enough that the node goes while it runs (at 64x96x9 a quiet
                # machine finished it before the removal took effect)
                long = {**body, "size": "256x256", "num_frames": "17", "num_inference_steps": "200"}
                job = http.post("/v1/videos", data=long).json()
                wait_until(lambda: http.get(f"/v1/videos/{job['id']}").json()["status"] == "in_progress", 60,
                           "the video job to run", interval=0.1)
                cluster.remove(cluster.name_of(wan["node"]))
                assert _chat(http) == expected  # its node is alive
                failed = video_done(http, job["id"], timeout=60)
                assert failed["status"] == "failed", failed
                assert f"its Ray node {wan['node'][:12]} died" in failed["error"]["message"], failed
                health = _health(http)
                assert health["placed"]["wan_t2v/wan"][0]["alive"] is False, health
                refused = http.post("/v1/videos", data={**body, "num_inference_steps": "2"})
                assert refused.status_code == 503 and "stage unavailable" in refused.text, refused.text
                joined = cluster.add("c", {"slot": 1})
                back = wait_until(lambda: [p for p in _health(http)["placed"]["wan_t2v/wan"] if p["alive"]],
                                  BACK_S, "the Wan stage back on the node that joined", interval=0.5)
                assert back == [{"alive": True, "restarts": 1, "node": joined}], back
                metric = f'omni_stage_node{{model="wan_t2v",node="{joined}",replica="",stage="wan"}} 1.0'
                assert metric in http.get("/metrics").text
                job = http.post("/v1/videos", data={**body, "num_inference_steps": "2"}).json()
                assert video_done(http, job["id"], timeout=120)["status"] == "completed"
                assert _chat(http) == expected
            assert server.stop() == 0, server.output()
        finally:
            server.kill()


def test_a_parallel_stages_ranks_share_rank_0s_node(tmp_path):
    """wan_ulysses=2 on Ray: rank 1's actor is placed by the rank launcher the placement handed the stage's actor
    (STRICT_PACK, near rank 0), so both ranks run on one node although the other node has room too."""
    from omni_wan.demo import ensure_demo_model

    ensure_demo_model()
    with ray_cluster({"a": {"slot": 2}, "b": {"slot": 2}}) as cluster:
        with Omni("wan_t2v", device="cpu", placement="ray", wan_ulysses=2, worker_threads=1,
                  ray_resources="wan=slot:1") as o:
            (stage,) = cluster.actor_nodes("StageActor")
            assert cluster.actor_nodes("RankActor") == [stage] == [o.graph.stages["wan"].where]
            got = o.generate("a kite", seed=1, output=str(tmp_path / "a.mp4"), **SIZE)
            assert Path(got.path).is_file()
        assert cluster.actor_nodes("RankActor") == cluster.actor_nodes("StageActor") == []
