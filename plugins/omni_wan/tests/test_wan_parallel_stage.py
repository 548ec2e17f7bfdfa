"""The parallel Wan stage (ranks.py): `wan_cfg_parallel=2`, `wan_ulysses=2` and both (4 ranks) as a group of rank
processes on CPU with gloo, rank 0 in the stage's worker. A continuous batch of text and image rows (wan_i2v and
wan_t2v share the worker and its engine) with a request joining mid-way and one aborted gives each request the
frames of its single-rank solo run; a rank killed mid-request fails that request in one line naming the stage and
the rank, and the restarted group serves the next one."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest

from omni_kernel import Omni, RequestFailed, RequestFinished, StageProgress
from omni_kernel.testing import wait_until

pytestmark = [pytest.mark.process]

# 8 steps: a request submitted after another's first step still meets it, however loaded the machine
SIZE = {"preset": "smoke", "height": 64, "width": 96, "num_frames": 9, "num_inference_steps": 8}
REQUESTS = {"i": dict(prompt="a red fox in the snow", seed=1, guidance_scale=5.0),
            "late": dict(prompt="a kite over a field", seed=3, guidance_scale=4.0),
            "gone": dict(prompt="a boat", seed=2, guidance_scale=5.0)}


@pytest.fixture(scope="module")
def solo(omni, image_path, tmp_path_factory):
    """Each request alone on one rank, in this process: the frames to match."""
    tmp = tmp_path_factory.mktemp("solo")
    t2v = Omni("wan_t2v", host=omni.host, model=str(omni.graph.stages["wan"].engine.runner.layout.path),
               device="cpu")
    return {"i": omni.generate(**REQUESTS["i"], image=str(image_path), output=str(tmp / "i.mp4"), return_frames=True,
                               **SIZE).output.data["frames"],
            "late": t2v.generate(**REQUESTS["late"], output=str(tmp / "late.mp4"), return_frames=True,
                                 **SIZE).output.data["frames"]}


def ranks_of(worker_pid: int) -> list[int]:
    """The rank processes (1..N-1) a stage's worker started."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if ppid == worker_pid and b"omni_wan.ranks" in cmdline:
            found.append(int(entry.name))
    return sorted(found)


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def step_in_turn(omnis, events, until=None):
    while any(o.has_unfinished() for o in omnis) and not (until and until()):
        for o in omnis:
            if o.has_unfinished():
                events.extend(o.step())


@pytest.mark.parametrize("degrees", [{"wan_cfg_parallel": 2}, {"wan_ulysses": 2},
                                     {"wan_cfg_parallel": 2, "wan_ulysses": 2}], ids=["cfg2", "ulysses2", "both"])
def test_a_continuous_batch_over_ranks_matches_single_rank_solo_runs(omni, solo, image_path, tmp_path, degrees):
    config = dict(model=str(omni.graph.stages["wan"].engine.runner.layout.path), device="cpu", placement="process",
                  **degrees)
    i2v = Omni("wan_i2v", host=omni.host, **config)
    t2v = Omni("wan_t2v", host=omni.host, **config)
    try:
        worker = i2v.graph.stages["wan"].proc
        assert t2v.graph.stages["wan"].proc is worker  # one stage's worker, one engine, one group
        num_ranks = degrees.get("wan_cfg_parallel", 1) * degrees.get("wan_ulysses", 1)
        assert len(ranks_of(worker.pid)) == num_ranks - 1
        events: list = []
        i2v.submit(i2v.request(**REQUESTS["i"], image=str(image_path), request_id="i", output=str(tmp_path / "i.mp4"),
                               return_frames=True, **SIZE))
        t2v.submit(t2v.request(**REQUESTS["gone"], request_id="gone", output=str(tmp_path / "gone.mp4"), **SIZE))
        started = lambda: any(isinstance(e, StageProgress) and e.request_id == "i" for e in events)  # noqa: E731
        step_in_turn([i2v, t2v], events, until=started)
        t2v.submit(t2v.request(**REQUESTS["late"], request_id="late", output=str(tmp_path / "late.mp4"),
                               return_frames=True, **SIZE))
        step_in_turn([i2v, t2v], events, until=lambda: any(getattr(e, "request_id", "") == "late"
                                                           and isinstance(e, StageProgress) for e in events))
        t2v.abort("gone")
        step_in_turn([i2v, t2v], events)
        done = {e.request_id: e for e in events if isinstance(e, (RequestFinished, RequestFailed))}
        assert isinstance(done["gone"], RequestFailed) and done["gone"].kind == "aborted"
        assert not (tmp_path / "gone.mp4").exists()
        for rid in ("i", "late"):
            result = done[rid].result
            assert result.trace["diffusion.batch_size_max"] >= 2, result.trace
            diff = float(np.abs(result.output.data["frames"] - solo[rid]).max())
            print(f"{degrees} {rid}: frames vs single-rank solo, max abs diff {diff:.2e}")
            assert diff <= 1e-4
    finally:
        i2v.close()
        t2v.close()
    wait_until(lambda: not ranks_of(worker.pid), 30, "the ranks to stop with their stage's worker")


def test_a_killed_rank_fails_the_request_in_one_line_and_the_group_restarts(omni, solo, tmp_path):
    config = dict(model=str(omni.graph.stages["wan"].engine.runner.layout.path), device="cpu", placement="process",
                  wan_ulysses=2)
    with Omni("wan_t2v", host=omni.host, **config) as t2v:
        worker = t2v.graph.stages["wan"].proc
        (rank,) = ranks_of(worker.pid)
        rid = t2v.submit(t2v.request(**REQUESTS["late"], output=str(tmp_path / "a.mp4"),
                                     **{**SIZE, "num_inference_steps": 30}))
        events: list = []
        step_in_turn([t2v], events, until=lambda: any(isinstance(e, StageProgress) for e in events))
        os.kill(rank, signal.SIGKILL)
        step_in_turn([t2v], events)
        (failed,) = [e for e in events if isinstance(e, RequestFailed)]
        assert failed.request_id == rid and "\n" not in failed.error, failed
        assert "stage 'wan'" in failed.error and "rank 1" in failed.error and "restarted" in failed.error
        assert worker.poll() is None and ranks_of(worker.pid) not in ([], [rank])
        again = t2v.generate(**REQUESTS["late"], output=str(tmp_path / "b.mp4"), return_frames=True, **SIZE)
        assert float(np.abs(again.output.data["frames"] - solo["late"]).max()) <= 1e-4


def test_a_rank_that_cannot_start_fails_the_build_in_one_line(tiny_model, monkeypatch):
    """A rank that exits before it joins (here: an interpreter that is not Python) fails the stage's build at
    once, naming the rank, instead of leaving rank 0 waiting for the collective timeout."""
    import time

    from omni_kernel.core.errors import ModelError
    from omni_wan import rank_launch

    monkeypatch.setattr(rank_launch.sys, "executable", "/bin/false")
    start = time.monotonic()
    with pytest.raises(ModelError, match=r"stage 'wan': rank 1 \(exit code 1\) exited before it joined its group"):
        Omni("wan_t2v", model=str(tiny_model), device="cpu", wan_ulysses=2)
    assert time.monotonic() - start < 60


FRONT = """
import sys
from omni_kernel import Omni
o = Omni("wan_t2v", model=sys.argv[1], device="cpu", placement="process", wan_ulysses=2)
print(o.graph.stages["wan"].proc.pid, flush=True)
sys.stdin.read()
"""


def test_no_rank_outlives_a_front_killed_with_sigkill(tiny_model, tmp_path):
    """kill -9 of the front: its worker (rank 0) dies with it, and the worker's rank with the worker."""
    import subprocess
    import sys

    script = tmp_path / "front.py"
    script.write_text(FRONT)
    front = subprocess.Popen([sys.executable, str(script), str(tiny_model)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        worker = int(front.stdout.readline())
        (rank,) = wait_until(lambda: ranks_of(worker), 60, "the worker's rank to start")
        front.kill()
        front.wait(10)
        wait_until(lambda: not alive(worker) and not alive(rank), 30, "the worker and its rank to die with the front")
    finally:
        if front.poll() is None:
            front.kill()
