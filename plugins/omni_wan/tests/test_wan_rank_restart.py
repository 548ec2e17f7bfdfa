"""A rank group restarts off the step (ranks.py), ordered by events rather than by time: a rank's transformer load
is held while a gate file exists (a `sitecustomize` on the ranks' PYTHONPATH, which they take from the front's
sys.path, wraps `Wan22I2VPipeline.load_transformer`, what a rank other than 0 loads), until the test removes it.
The step that noticed the death returns (its request fails in one line naming the stage and the rank) while the
new rank's load is held; a request submitted meanwhile waits and is served once the test releases the load; past
`wan_rank_restart_wait` such a request is refused as stage unavailable."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_wan_parallel_stage import alive, ranks_of

from omni_kernel import Omni, RequestFailed, RequestFinished, StageProgress
from omni_kernel.testing import wait_until

pytestmark = [pytest.mark.process]

SIZE = {"preset": "smoke", "height": 64, "width": 96, "num_frames": 9}

SITECUSTOMIZE = textwrap.dedent("""
    import time
    from pathlib import Path

    from omni_wan.model import Wan22I2VPipeline

    GATE, HELD = Path(__file__).with_name("gate"), Path(__file__).with_name("held")
    load = Wan22I2VPipeline.load_transformer.__func__

    def held_load(cls, path, device):
        if GATE.exists():
            HELD.touch()
        while GATE.exists():
            time.sleep(0.05)
        return load(cls, path, device)

    Wan22I2VPipeline.load_transformer = classmethod(held_load)
""")


class HeldLoad:
    """The gate of the sitecustomize above: `hold()` holds the next rank loads, `release()` lets them go."""

    def __init__(self, folder: Path):
        folder.mkdir()
        (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.folder, self.gate, self.held = folder, folder / "gate", folder / "held"
        sys.path.insert(0, str(folder))  # the worker takes the front's sys.path, and its ranks the worker's

    def hold(self) -> None:
        self.gate.touch()

    def release(self) -> None:
        self.gate.unlink(missing_ok=True)

    def close(self) -> None:
        self.release()
        sys.path.remove(str(self.folder))


@pytest.fixture
def held(tmp_path):
    gate = HeldLoad(tmp_path / "site")
    yield gate
    gate.close()


def events_until(o, done, timeout: float = 120) -> list:
    events: list = []

    def step() -> bool:
        events.extend(o.step() if o.has_unfinished() else [])
        return done(events)

    wait_until(step, timeout, "the events", interval=0)
    return events


def kill_rank_mid_request(o, tmp_path):
    """Kill the stage's rank during a request's denoise; returns (the request id, the dead rank's pid)."""
    worker = o.graph.stages["wan"].proc
    (rank,) = ranks_of(worker.pid)
    victim = o.submit(o.request(prompt="a kite", seed=3, output=str(tmp_path / "victim.mp4"), num_inference_steps=30,
                                **SIZE))
    events_until(o, lambda events: any(isinstance(e, StageProgress) for e in events))
    os.kill(rank, signal.SIGKILL)
    return victim, rank


def test_the_step_that_sees_a_rank_die_returns_before_the_new_rank_loads_and_a_request_meanwhile_waits(
        tiny_model, held, tmp_path):
    with Omni("wan_t2v", model=str(tiny_model), device="cpu", placement="process", wan_ulysses=2) as o:
        worker = o.graph.stages["wan"].proc
        held.hold()
        victim, dead = kill_rank_mid_request(o, tmp_path)
        events = events_until(o, lambda events: any(isinstance(e, RequestFailed) for e in events))
        (failed,) = [e for e in events if isinstance(e, RequestFailed)]
        assert failed.request_id == victim and "\n" not in failed.error, failed
        assert "stage 'wan'" in failed.error and "rank 1" in failed.error and "restarted" in failed.error
        assert held.gate.exists()  # the step returned while the new rank's load is held
        (new,) = ranks_of(worker.pid)
        assert new != dead and alive(new)
        wait_until(held.held.exists, 60, "the new rank to reach its transformer load")
        late = o.submit(o.request(prompt="a boat", seed=2, output=str(tmp_path / "late.mp4"), num_inference_steps=3,
                                  **SIZE))
        given = time.monotonic() + 3  # time for a wrong answer to come: neither refused nor served yet
        waited = events_until(o, lambda events: time.monotonic() > given, 30)
        assert not [e for e in waited if isinstance(e, (RequestFailed, RequestFinished))], waited
        held.release()
        events = events_until(o, lambda events: not o.has_unfinished())
        (done,) = [e for e in events if isinstance(e, (RequestFailed, RequestFinished))]
        assert isinstance(done, RequestFinished) and done.request_id == late, done
        assert (tmp_path / "late.mp4").stat().st_size > 0


def test_a_request_past_the_restart_wait_is_refused_as_stage_unavailable_then_served(tiny_model, held, tmp_path):
    with Omni("wan_t2v", model=str(tiny_model), device="cpu", placement="process", wan_ulysses=2,
              wan_rank_restart_wait=1.0) as o:
        held.hold()
        kill_rank_mid_request(o, tmp_path)
        events_until(o, lambda events: any(isinstance(e, RequestFailed) for e in events))
        late = o.submit(o.request(prompt="a boat", seed=2, output=str(tmp_path / "late.mp4"), num_inference_steps=3,
                                  **SIZE))
        events = events_until(o, lambda events: not o.has_unfinished())
        (refused,) = [e for e in events if isinstance(e, RequestFailed)]
        assert refused.request_id == late and refused.kind == "unavailable", refused
        assert "stage unavailable" in refused.error and "wan_rank_restart_wait" in refused.error
        assert held.gate.exists() and not (tmp_path / "late.mp4").exists()
        held.release()

        def served():
            last = list(o.generate_stream(o.request(prompt="a boat", seed=2, num_inference_steps=3,
                                                    output=str(tmp_path / "again.mp4"), **SIZE)))[-1]
            return isinstance(last, RequestFinished) and last

        wait_until(served, 120, "a request served once the group is back", interval=0.5)
