"""`narrated_t2v` (omni_bridge) with every stage in a worker process: the video and the voice run in their workers at
once and the mux, a join, gets its one merged input in its own worker, making the MP4 one process makes; a branch
that fails names its node and leaves no file. omni_bridge's fake AR, video and voice stages (its tests'
narrated_fakes.py) and the real mux (ffmpeg)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from omni_kernel import Omni
from omni_kernel.events import RequestFailed
from omni_kernel.testing import drain
from omni_workers import WorkersPlugin
from omni_workers.process_stage import ProcessStage

pytest.importorskip("omni_bridge")
pytest.importorskip("imageio_ffmpeg")
sys.path.insert(0, str(Path(__file__).parents[2] / "omni_bridge" / "tests"))
from narrated_fakes import SAMPLE_RATE, narrated_host  # noqa: E402
from narrated_media import audio_pcm, frames, streams  # noqa: E402

pytestmark = [pytest.mark.process]


def workers_host():
    """narrated_fakes' host with the placements; each worker rebuilds it with this (picklable) function."""
    host, _ = narrated_host()
    host.register(WorkersPlugin(), "omni_workers")
    host.rebuild = workers_host
    return host


def test_the_mux_joins_in_its_worker_what_it_joins_in_one_process(tmp_path):
    params = {"voice": "ben", "seed": 1}
    prompt = "a red fox in fresh snow"
    with Omni("narrated_t2v", host=workers_host()) as inproc:
        want = inproc.generate(prompt, output=str(tmp_path / "inproc.mp4"), **params)
    with Omni("narrated_t2v", host=workers_host(), placement="process") as o:
        assert all(isinstance(s, ProcessStage) for s in o.graph.stages.values())
        got = o.generate(prompt, output=str(tmp_path / "placed.mp4"), **params)
        bad = o.submit(o.request("a long story", output=str(tmp_path / "bad.mp4")))  # the voice stumbles
        failed = [e for e in drain(o) if isinstance(e, RequestFailed)]
    assert streams(got.path) == [("Video", "h264"), ("Audio", "aac")]
    assert (frames(got.path) == frames(want.path)).all()
    assert audio_pcm(got.path, SAMPLE_RATE) == audio_pcm(want.path, SAMPLE_RATE)
    for key in ("narration.text", "mux.loops", "mux.narration_seconds", "diffusion.prompt"):
        assert got.trace[key] == want.trace[key], key
    times = {k: v for k, v in got.trace.items() if k.startswith("node.")}  # the branches overlap in their workers
    assert times["node.video.start_ms"] < times["node.speak.end_ms"]
    assert times["node.speak.start_ms"] < times["node.video.end_ms"]
    assert [(e.request_id, e.node_id) for e in failed] == [(bad, "speak")] and "stumbled" in failed[0].error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inproc.mp4", "placed.mp4"]  # no video left beside them
