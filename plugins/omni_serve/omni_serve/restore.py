"""At start (the server's lifespan): the store's jobs back into a VideoJobs, each reaching a state the API can
report, and the output directory reconciled with them. One log line for each job or file this changes:

- `deleted` (the server died while it removed a job's files): its files go, then its row;
- `completed`: listed and downloadable until its TTL; one whose MP4 is gone fails (`output_missing`);
- `failed`: kept until its TTL; a partial output or an upload it left is removed;
- `queued`: submitted again; one whose stored upload is gone fails (`upload_missing`);
- `in_progress`: by --on-restart, `rerun` (queued again from the start, `attempts` + 1; a job that was in
  progress at MAX_ATTEMPTS restarts fails instead, as a job that kills its server would otherwise do so at every
  start) or `fail` (`server_restarted`), its partial output removed either way;
- a file in `.uploads` that no queued job names is removed; a `video_<id>` file in the output directory that no
  job of the store names is left alone (the server did not write it, as far as this store knows) and logged.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import attrs

from .store import StoreWriteFailed
from .videos import JOB_FILE, LIVE, VideoJobRecord, VideoJobs

log = logging.getLogger("omni")
MAX_ATTEMPTS = 3  # --on-restart rerun: how many times a job may start before a restart that finds it running fails it


async def restore(jobs: VideoJobs, rows: list[dict[str, Any]]) -> None:
    counts: dict[str, int] = {}
    for row in rows:
        job = VideoJobRecord.of_row(row)
        try:
            outcome = _reconcile(jobs, job)
        except StoreWriteFailed as exc:
            log.error("video job %s: %s; left as it was in the store", job.id, exc)
            outcome = job.status
            if job.status in LIVE:
                continue  # not run: its state could not be recorded
        counts[outcome] = counts.get(outcome, 0) + 1
        if job.status != "deleted":
            jobs.jobs[job.id] = job
    for job in list(jobs.jobs.values()):
        if job.status == "queued":
            await jobs.resume(job)
    _reconcile_files(jobs, {r["id"] for r in rows})
    if rows:
        log.info("job store %s: %d job(s) restored (%s)", jobs.store.path, len(rows),
                 ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))


def _reconcile(jobs: VideoJobs, job: VideoJobRecord) -> str:
    """Bring one restored job to a state the API can report; returns what became of it."""
    if job.status == "deleted":
        jobs.drop(job)
        log.info("video job %s: deleted before the restart; its files are removed now", job.id)
        return "deleted"
    if job.status == "completed":
        if job.path is None or not job.path.is_file():
            jobs.fail(job, {"code": "output_missing", "message": f"the video of job {job.id} is no longer in the "
                            "server's output directory; submit it again", "param": None})
            log.warning("video job %s: completed, but its file %s is gone; now failed (output_missing)", job.id,
                        job.path)
            return "failed"
        return "completed"
    if job.status == "failed":
        _remove_leftovers(jobs, job)
        return "failed"
    if job.status == "in_progress":
        return _interrupted(jobs, job)
    return _queued(jobs, job)


def _interrupted(jobs: VideoJobs, job: VideoJobRecord) -> str:
    jobs.remove_files(attrs.evolve(job, upload=None))  # its partial output
    if jobs.on_restart == "rerun" and job.attempts < MAX_ATTEMPTS:
        jobs.save(job, "requeued", status="queued", progress=0, attempts=job.attempts + 1)
        log.info("video job %s: in progress when the server stopped; runs again from the start (--on-restart "
                 "rerun, attempt %d)", job.id, job.attempts)
        return _queued(jobs, job)
    why = ("--on-restart fail" if jobs.on_restart == "fail" else
           f"--on-restart rerun, and this was its attempt {job.attempts} of at most {MAX_ATTEMPTS}")
    jobs.fail(job, {"code": "server_restarted", "message": f"the server restarted while this job was in progress "
                    f"({why}); submit it again", "param": None})
    _remove_leftovers(jobs, job)
    log.info("video job %s: in progress when the server stopped; failed (server_restarted, %s)", job.id, why)
    return "failed"


def _queued(jobs: VideoJobs, job: VideoJobRecord) -> str:
    if job.upload is not None and not job.upload.is_file():
        jobs.fail(job, {"code": "upload_missing", "message": "the input_reference image stored with this job is "
                        "gone from the server; submit it again", "param": "input_reference"})
        log.warning("video job %s: queued, but its stored upload is gone; now failed (upload_missing)", job.id)
        return "failed"
    return "queued"


def _remove_leftovers(jobs: VideoJobs, job: VideoJobRecord) -> None:
    """A failed job has no output and no upload: what it left (the server died before removing them) goes."""
    for path in (job.path, job.upload):
        if path is not None and path.is_file():
            path.unlink(missing_ok=True)
            log.info("video job %s: failed; removed its leftover %s", job.id, path.name)
    job.upload = None


def _reconcile_files(jobs: VideoJobs, known: set[str]) -> None:
    keep = {j.upload for j in jobs.jobs.values() if j.status in LIVE and j.upload is not None}
    for path in jobs.uploads.clean(keep):
        log.info("removed %s: an upload no queued job names (the server stopped before its job was recorded "
                 "or after it ended)", path)
    try:
        entries = sorted(jobs.output_dir.iterdir())
    except OSError:
        return
    now = time.time()
    for entry in entries:
        if JOB_FILE.fullmatch(entry.name) and entry.name.split(".")[0] not in known and entry.is_file():
            age = (now - entry.stat().st_mtime) / 3600
            log.warning("%s is named like a video job's file, but no job of the store %s has it: left alone "
                        "(%.1f h old; remove it if it is not yours)", entry, jobs.store.path, age)

