"""--on-restart rerun gives a job restore.MAX_ATTEMPTS starts: a job found in progress at a restart runs again
until then, and fails after (in process, on a real job store; test_server_jobs.py restarts real servers)."""

from __future__ import annotations

import asyncio
import time

from omni_serve.restore import MAX_ATTEMPTS, restore
from omni_serve.store import JobStore
from omni_serve.videos import VideoJobRecord, VideoJobs


class _NoEngine:
    """restore() resubmits queued jobs; these tests only look at what it decided, so nothing runs."""


def _restored(tmp_path, attempts: int) -> VideoJobRecord:
    out = tmp_path / "videos"
    store = JobStore(out / "jobs.sqlite", out)
    try:
        job = VideoJobRecord("video_1", "wan_t2v", int(time.time()), "96x64", None, "a kite", status="in_progress",
                             path=out / "video_1.mp4", pipeline="wan_t2v", attempts=attempts)
        store.insert(job.row())
        store.update("in_progress", job.id, status="in_progress")
        jobs = VideoJobs(_NoEngine(), out, ttl=None, store=store, on_restart="rerun")
        jobs.resume = _record_resume  # the engine's part is not under test
        asyncio.run(restore(jobs, store.rows()))
        return jobs.jobs["video_1"]
    finally:
        store.close()


async def _record_resume(job):
    job.params["resumed"] = True


def test_a_job_in_progress_at_a_restart_runs_again_before_its_last_attempt(tmp_path):
    job = _restored(tmp_path, attempts=MAX_ATTEMPTS - 1)
    assert job.status == "queued" and job.attempts == MAX_ATTEMPTS
    assert job.params.get("resumed")


def test_a_job_in_progress_at_its_last_attempt_fails_at_the_restart(tmp_path):
    job = _restored(tmp_path, attempts=MAX_ATTEMPTS)
    assert job.status == "failed" and job.error["code"] == "server_restarted", job
    assert f"attempt {MAX_ATTEMPTS} of at most {MAX_ATTEMPTS}" in job.error["message"]
    assert not job.params.get("resumed")
