"""The parallel Wan stage placed on Ray: rank 0 is the stage's actor and starts rank 1 as a Ray actor in a
placement group of its own (a bundle per rank, rank 0's resources: here one CPU each of the two this local Ray
has), reached at its node's address; the frames equal the single-rank run. Skipped, with the reason, where Ray
is not installed or cannot start here."""

from __future__ import annotations

import numpy as np
import pytest

from omni_kernel import Omni

pytestmark = [pytest.mark.process]

SIZE = {"preset": "smoke", "height": 64, "width": 96, "num_frames": 9, "num_inference_steps": 3}


@pytest.fixture(scope="module")
def ray():
    try:
        import ray
    except ImportError as exc:
        pytest.skip(f"Ray is not installed here ({exc}); `pip install 'omni-workers[ray]'` (make test does)")
    try:
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=True)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"a local Ray could not start on this machine: {type(exc).__name__}: {exc}")
    yield ray
    ray.shutdown()


def test_a_parallel_stage_on_ray_runs_its_other_rank_as_an_actor(ray, omni, tmp_path):
    from ray.util.placement_group import placement_group_table

    model = str(omni.graph.stages["wan"].engine.runner.layout.path)
    alone = Omni("wan_t2v", host=omni.host, model=model, device="cpu")
    expected = alone.generate("a kite", seed=2, output=str(tmp_path / "a.mp4"), return_frames=True, **SIZE)
    with Omni("wan_t2v", host=omni.host, model=model, device="cpu", placement="ray", wan_ulysses=2) as o:
        groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
        assert sorted(len(g["bundles"]) for g in groups) == [1, 1]  # the stage's actor's, and its rank's
        assert sorted(g["strategy"] for g in groups) == ["PACK", "STRICT_PACK"]  # the rank group: one node
        got = o.generate("a kite", seed=2, output=str(tmp_path / "b.mp4"), return_frames=True, **SIZE)
    assert float(np.abs(got.output.data["frames"] - expected.output.data["frames"]).max()) <= 1e-4
