"""Export off the engine step (the default with a GPU, turned on here on the CPU): a finished video is encoded on
the runner's export thread while the other requests denoise; the scheduler holds the request until its MP4 is
written, the stage blocks in `wait` (not `step`) on it, fails a request whose export fails alone, and leaves no
MP4 for a request aborted during its export. On a CPU the export runs in its step."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest

from omni_kernel import RequestFailed, RequestFinished, StageProgress

from wan_mp4 import read_mp4

SIZE = {"preset": "smoke", "height": 64, "width": 96, "num_frames": 9}


@contextmanager
def held_export(omni, rid: str, fail: Exception | None = None):
    """Hold `rid`'s export on the export thread until the context's `release` is set (or it exits); `fail` makes
    that export raise instead of writing."""
    runner = omni.graph.stages["wan"].engine.runner
    real = runner.export
    started, release = threading.Event(), threading.Event()

    def export(job):
        if job.item.request_id == rid:
            started.set()
            release.wait(30)
            if fail is not None:
                raise fail
        return real(job)

    runner.export, runner.export_in_background = export, True
    try:
        yield started, release
    finally:
        release.set()
        runner.export, runner.export_in_background = real, False


def _submit(omni, rid, steps, image_path, tmp_path):
    omni.submit(omni.request(f"a kite, take {rid}", image=str(image_path), request_id=rid, **SIZE,
                             num_inference_steps=steps, seed=1, output=str(tmp_path / f"{rid}.mp4")))


def assert_video(path):
    assert read_mp4(path)[1].shape == (9, 64, 96, 3)


def exporting(stage) -> set[str]:
    """The requests the stage's scheduler holds on a running export."""
    return {j.request_id for j in stage.engine.scheduler.queue if j.pending is not None}


def _drain(omni, events):
    while omni.has_unfinished():
        events += omni.step()


def test_other_requests_denoise_while_a_video_is_exported(omni, image_path, tmp_path):
    stage = omni.graph.stages["wan"]
    events = []

    def long_steps():
        return [e.step for e in events if isinstance(e, StageProgress) and e.request_id == "long"]

    with held_export(omni, "short", None) as (started, release):
        _submit(omni, "short", 1, image_path, tmp_path)
        _submit(omni, "long", 6, image_path, tmp_path)
        while not started.is_set():
            events += omni.step()
        before = len(long_steps())
        while 6 not in long_steps():
            events += omni.step()
        assert len(long_steps()) > before, "the long request denoised while the short one's export was held"
        assert not any(isinstance(e, (RequestFinished, RequestFailed)) for e in events)
        assert not (tmp_path / "short.mp4").exists()
        while exporting(stage) != {"short", "long"}:  # its decode, then its export queued behind the held one
            events += omni.step()
        assert stage.engine.request_ids() == {"short", "long"} and stage.engine.has_unfinished()
        # only exports left, the first held: wait blocks and reports no progress
        assert stage.engine.wait(0.05) is False
        release.set()
        assert stage.engine.wait(30) is True
    _drain(omni, events)
    assert [e.request_id for e in events if isinstance(e, RequestFinished)] == ["short", "long"]
    assert_video(tmp_path / "short.mp4")
    assert_video(tmp_path / "long.mp4")
    assert not stage.engine.has_unfinished()


def test_a_failing_export_fails_its_request_alone(omni, image_path, tmp_path):
    events = []
    with held_export(omni, "broken", OSError(28, "No space left on device")) as (_, release):
        _submit(omni, "broken", 1, image_path, tmp_path)
        _submit(omni, "fine", 2, image_path, tmp_path)
        release.set()
        _drain(omni, events)
    failed = [e for e in events if isinstance(e, RequestFailed)]
    assert [e.request_id for e in failed] == ["broken"]
    assert "no space left on device" in str(failed[0].error).lower()
    assert [e.request_id for e in events if isinstance(e, RequestFinished)] == ["fine"]
    assert_video(tmp_path / "fine.mp4")


@pytest.mark.parametrize("when", ["queued", "running"])
def test_an_aborted_export_leaves_no_mp4(omni, image_path, tmp_path, when):
    """Aborted while its export waits behind another (cancelled) or while ffmpeg runs (the MP4 is removed)."""
    events = []
    with held_export(omni, "first", None) as (started, release):
        _submit(omni, "first", 1, image_path, tmp_path)
        _submit(omni, "second", 1, image_path, tmp_path)
        stage = omni.graph.stages["wan"]
        while exporting(stage) != {"first", "second"}:
            events += omni.step()
        assert started.wait(30)
        victim = "second" if when == "queued" else "first"
        omni.abort(victim)
        assert victim not in stage.engine.request_ids()
        release.set()
        _drain(omni, events)
        stage.engine.runner.exports.submit(lambda: None).result(30)  # the export thread is done with both
    survivor = "first" if victim == "second" else "second"
    assert [(e.request_id, e.error) for e in events if isinstance(e, RequestFailed)] == [(victim, "aborted")]
    assert [e.request_id for e in events if isinstance(e, RequestFinished)] == [survivor]
    assert not (tmp_path / f"{victim}.mp4").exists()
    assert_video(tmp_path / f"{survivor}.mp4")


def test_on_a_cpu_the_export_runs_in_its_step(omni, image_path, tmp_path):
    """torch's threads use every core there: an encoder beside them would only slow them."""
    stage = omni.graph.stages["wan"]
    assert stage.engine.runner.export_in_background is False
    events, pending = [], []
    _submit(omni, "inline", 1, image_path, tmp_path)
    while omni.has_unfinished():
        events += omni.step()
        pending.append(bool(exporting(stage)))
    assert not any(pending)
    assert [e.request_id for e in events if isinstance(e, RequestFinished)] == ["inline"]
    assert_video(tmp_path / "inline.mp4")
