"""narrated_t2v with each stage in a worker process of its own (placement `process`: the join's inputs, the plan's
parameter routes and the mux cross the process boundary) gives the MP4 the pipeline gives in one process: the same
narration, frames and sound. The tiny demo Qwen writes the narration (noise the voice still speaks, at speed 4 to
keep it short)."""

from __future__ import annotations

import numpy as np
import pytest

from omni_kernel import Omni
from omni_workers.process_stage import ProcessStage

from narrated_media import audio_pcm, frames, streams

pytestmark = [pytest.mark.process]


def test_the_narrated_pipeline_in_worker_processes_matches_inproc(omni_cache, voice_dir, tmp_path):
    runs = {}
    for placement in ("inproc", "process"):
        with Omni("narrated_t2v", device="cpu", tts_device="cpu", placement=placement, worker_threads=1,
                  tts_model=str(voice_dir)) as omni:
            if placement == "process":
                assert all(isinstance(s, ProcessStage) for s in omni.graph.stages.values())
            runs[placement] = omni.generate("a lighthouse at dusk", seed=3, speed=4.0,
                                            output=str(tmp_path / f"{placement}.mp4"))
    want, got = runs["inproc"], runs["process"]
    assert got.trace["narration.text"] == want.trace["narration.text"]
    assert got.trace["mux.loops"] == want.trace["mux.loops"]
    assert streams(got.path) == [("Video", "h264"), ("Audio", "aac")]
    assert (frames(got.path) == frames(want.path)).all()
    # the same sound: the voice's float math in a one-thread worker differs from this process's in the last bits
    heard, expected = (np.frombuffer(audio_pcm(run.path, 22050), "<i2").astype(float) for run in (got, want))
    assert heard.shape == expected.shape and np.abs(heard - expected).mean() < 0.01 * 32767
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inproc.mp4", "process.mp4"]
