"""Video jobs (the OpenAI Videos API): each job is one engine request, followed by a task that updates the job
as its events arrive (progress every denoise step). Files live under the server's own output directory; the
client never names a path. Finished jobs and their files expire after the TTL.

Every state change is a write to the job store (store.py), committed before the job's new state is kept here and
so before any answer reports it: the jobs in memory are the store's rows as of their last commit. At start
(restore.py) the store's jobs come back: completed ones are listed and downloadable until their TTL, queued ones
run, in-progress ones run again or fail with `server_restarted` (--on-restart), and files are reconciled."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from omni_kernel.core.request import VIDEO
from omni_kernel.events import RequestFailed, RequestFinished, StageProgress
from omni_kernel.util.files import remove_atomic_leftovers

from .async_omni import AsyncOmni, Overloaded
from .protocol import APIError
from .store import JobStore, StoreWriteFailed
from .uploads import Uploads

log = logging.getLogger("omni")
JOB_FILE = re.compile(r"video_[0-9a-f]{32}\..+")  # a job's MP4 (video_<id>.mp4) and what is named after it
LIVE = ("queued", "in_progress")


def scrub(message: str, upload: Path) -> str:
    """`message` with the server's path of an uploaded image replaced by the field it came in."""
    path = str(upload)
    for shown, said in ((f"image {path!r}", "the input_reference image"), (repr(path), "input_reference"),
                        (path, "input_reference")):
        message = message.replace(shown, said)
    return message


def video_node(graph) -> str:
    """The node whose steps are a job's progress: its diffusion node (before the mux of a narrated pipeline), else
    the final node."""
    kinds = {n: getattr(graph.node_types.get(n), "kind", None) for n in graph.order}
    return next((n for n in graph.order if kinds[n] == "diffusion"), graph.final)


def store_error(exc: StoreWriteFailed) -> APIError:
    if exc.full:
        return APIError(507, f"{exc}; nothing was kept: free space on the server and retry", None,
                        "insufficient_storage", "server_error")
    return APIError(503, f"{exc}; retry later", None, "store_unavailable", retry_after=1)


@attrs.define
class VideoJobRecord:
    """One video job as the server keeps it (protocol.VideoJob is its answer's shape)."""

    id: str
    model: str
    created_at: int
    size: str | None
    seconds: str | None
    prompt: str | None = None
    status: str = "queued"
    progress: int = 0
    completed_at: int | None = None
    error: dict[str, Any] | None = None
    path: Path | None = None
    upload: Path | None = None
    task: asyncio.Task | None = attrs.field(default=None, repr=False)
    finished: float | None = None  # wall-clock time it completed or failed (for the TTL)
    pipeline: str = ""
    params: dict[str, Any] = attrs.Factory(dict)
    attempts: int = 1

    def to_json(self, ttl: float | None) -> dict[str, Any]:
        expires = None if self.completed_at is None or not ttl else int(self.completed_at + ttl)
        # `seconds` is a string in OpenAI's job object: what the request asked for, else (until the video is
        # rendered and its length known) "".
        return {"id": self.id, "object": "video", "status": self.status, "progress": self.progress,
                "model": self.model, "prompt": self.prompt, "size": self.size, "seconds": self.seconds or "",
                "remixed_from_video_id": None, "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": expires, "error": self.error}

    def row(self) -> dict[str, Any]:
        return {"id": self.id, "model": self.model, "pipeline": self.pipeline, "created_at": self.created_at,
                "prompt": self.prompt, "size": self.size, "seconds": self.seconds, "params": self.params,
                "upload": None if self.upload is None else str(self.upload), "path": str(self.path),
                "progress": self.progress, "attempts": self.attempts}

    @classmethod
    def of_row(cls, row: dict[str, Any]) -> VideoJobRecord:
        return cls(row["id"], row["model"], row["created_at"], row["size"], row["seconds"], row["prompt"],
                   row["status"], row["progress"], row["completed_at"], row["error"], Path(row["path"]),
                   Path(row["upload"]) if row["upload"] else None, finished=row["finished_at"],
                   pipeline=row["pipeline"], params=row["params"], attempts=row["attempts"])


class VideoJobs:
    def __init__(self, async_omni: AsyncOmni, output_dir: Path, ttl: float | None, metrics=None,
                 store: JobStore | None = None, on_restart: str = "fail"):
        self.async_omni = async_omni
        self.output_dir = output_dir
        self.uploads = Uploads(output_dir / ".uploads")
        self.ttl = ttl
        self.metrics = metrics
        self.store = store
        self.on_restart = on_restart
        self.jobs: dict[str, VideoJobRecord] = {}
        self.stopping = False  # the exit signal came: a job the drain aborts goes back to the queue
        self.waiting: list[VideoJobRecord] = []  # restored jobs the engine had no room for yet

    def counts(self) -> dict[str, int]:
        counts = {s: 0 for s in ("queued", "in_progress", "completed", "failed")}
        for job in list(self.jobs.values()):
            counts[job.status] = counts.get(job.status, 0) + 1
        return counts

    def save(self, job: VideoJobRecord, kind: str, **fields: Any) -> None:
        """Commit the job's new state (StoreWriteFailed: nothing changed), then keep it here."""
        if self.store is not None:
            self.store.update(kind, job.id, **{("finished_at" if k == "finished" else k):
                                               (str(v) if isinstance(v, Path) else v) for k, v in fields.items()})
        for name, value in fields.items():
            setattr(job, name, value)

    @staticmethod
    def about_upload(error: APIError, upload: Path | None) -> APIError:
        """An error about the uploaded image as the client knows it: `input_reference`, never the server's path."""
        if upload is not None and str(upload) in error.message:
            error.message, error.param = scrub(error.message, upload), "input_reference"
            error.args = (error.message,)
        return error

    @staticmethod
    def new_id() -> str:
        return f"video_{uuid.uuid4().hex}"

    # A new job.

    async def create(self, job_id: str, model: str, prompt: str, image: Path | None, params: dict[str, Any],
                     size: str | None, seconds: str | None, shown: str | None = None) -> VideoJobRecord:
        """Record the job (queued), then submit its request; a UserError raises here (answered 400) and nothing
        is left behind, in the store or on disk. `shown`: the model name the client used."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.output_dir / f"{job_id}.mp4"
        job = VideoJobRecord(job_id, shown or model, int(time.time()), size, seconds, prompt or None, path=path,
                             upload=image, pipeline=model, params=params)
        if self.store is not None:
            try:
                self.store.insert(job.row())
            except StoreWriteFailed as exc:
                raise store_error(exc) from None
        try:
            stream = await self._open(job)
        except BaseException:
            self._forget(job)
            raise
        self.jobs[job_id] = job
        job.task = asyncio.create_task(self._follow(job, stream), name=f"omni-{job_id}")
        return job

    async def _open(self, job: VideoJobRecord):
        image = None if job.upload is None else str(job.upload)
        return await self.async_omni.open(job.pipeline, job.prompt or "", image=image, request_id=job.id,
                                          output=str(job.path), **job.params)

    def _forget(self, job: VideoJobRecord) -> None:
        """A job refused at submit: its files and its row go."""
        self._purge(job, "was refused but its row stays in the store (it fails at the next start)")

    # Following a job's events.

    async def _follow(self, job: VideoJobRecord, stream) -> None:
        last = time.perf_counter()  # when the video node's last progress came (a denoise step's time)
        final = video_node(self.async_omni.omnis[job.pipeline].graph)
        try:
            async with stream:
                async for event in stream:
                    if isinstance(event, StageProgress) and event.node_id == final:
                        last = self._progress(job, event, last)
                    elif isinstance(event, RequestFinished):
                        self._completed(job, event.result)
                    elif isinstance(event, RequestFailed):
                        self._failed(job, event)
                    elif job.status == "queued":
                        self.save(job, "in_progress", status="in_progress")
        except asyncio.CancelledError:
            raise
        except StoreWriteFailed as exc:  # its state can no longer be recorded: the job fails (the stream aborts)
            log.error("video job %s failed: %s", job.id, exc)
            self._end_unrecorded(job, {"code": "insufficient_storage" if exc.full else "store_unavailable",
                                       "message": str(exc), "param": None})
        except Exception as exc:  # noqa: BLE001 - the job fails, the server goes on
            log.exception("video job %s failed", job.id)
            self._end_unrecorded(job, {"code": "runtime", "message": f"{type(exc).__name__}: {exc}", "param": None})
        finally:
            if job.status not in LIVE and job.upload is not None:  # kept while the job may still run
                job.upload.unlink(missing_ok=True)

    def _progress(self, job: VideoJobRecord, event: StageProgress, last: float) -> float:
        """A step of the final node: the job's progress, and the step's time into the metrics; returns now."""
        now = time.perf_counter()
        if self.metrics is not None and event.step > 0:
            self.metrics.denoise.labels(job.model).observe(now - last)
        if event.step == 0 and job.status == "queued":  # prepared, waiting for its first denoise step: queued
            return now
        progress = min(99, int(100 * event.step / max(event.total, 1)))
        if job.status != "in_progress":
            self.save(job, "in_progress", status="in_progress", progress=progress)
        elif progress != job.progress:
            self.save(job, "progress", progress=progress)
        return now

    def _completed(self, job: VideoJobRecord, result) -> None:
        """The video's size and length as rendered, where the request did not say them."""
        data = result.output.data
        video = data.get(VIDEO) if isinstance(data, Mapping) else None
        size, seconds = job.size, job.seconds
        if size is None and video is not None:
            size = f"{video.width}x{video.height}"
        if seconds is None and video is not None:
            seconds = f"{video.seconds:g}"
        path = Path(result.path) if result.path else job.path
        self.save(job, "completed", status="completed", progress=100, size=size, seconds=seconds, path=path,
                  completed_at=int(time.time()), finished=time.time())

    def _failed(self, job: VideoJobRecord, event: RequestFailed) -> None:
        if self.stopping and event.kind == "aborted":  # the server stopped it: it runs again at the next start
            self.remove_files(attrs.evolve(job, upload=None))
            self.save(job, "requeued", status="queued", progress=0)
            log.info("video job %s goes back to the queue: the server is stopping", job.id)
            return
        self.remove_files(attrs.evolve(job, upload=None))  # no partial output of a failed job
        error = self.about_upload(APIError.of_failure(event.kind, event.error, event.field), job.upload)
        param = "input_reference" if error.param == "image" else error.param  # the API's name
        self.fail(job, {"code": event.kind, "message": error.message, "param": param})

    def fail(self, job: VideoJobRecord, error: dict[str, Any]) -> None:
        self.save(job, "failed", status="failed", error=error, completed_at=int(time.time()), finished=time.time())

    def _end_unrecorded(self, job: VideoJobRecord, error: dict[str, Any]) -> None:
        """The job fails; try to record it (if that fails too, the next start finds it unfinished)."""
        self.remove_files(attrs.evolve(job, upload=None))
        try:
            self.fail(job, error)
        except StoreWriteFailed:
            job.status, job.error, job.completed_at, job.finished = "failed", error, int(time.time()), time.time()

    # Reading, deleting, expiring.

    def get(self, job_id: str) -> VideoJobRecord:
        job = self.jobs.get(job_id)
        if job is None:
            raise APIError(404, f"no video {job_id!r} (never created, deleted, or expired)", "video_id", "not_found")
        return job

    def list(self, after: str | None, limit: int, order: str) -> tuple[list[VideoJobRecord], bool]:
        jobs = list(self.jobs.values())  # in creation order: created_at has whole seconds, ids are random
        if order == "desc":
            jobs.reverse()
        if after is not None:
            ids = [j.id for j in jobs]
            if after not in ids:
                raise APIError(400, f"invalid after: no video {after!r}", "after")
            jobs = jobs[ids.index(after) + 1:]
        return jobs[:limit], len(jobs) > limit

    async def delete(self, job_id: str) -> None:
        """Cancel a running job (it stops between denoise steps) and delete its file: `deleted` is committed
        first (its files are removed at the next start if the server dies before), its row goes once they are."""
        job = self.get(job_id)
        try:
            self.save(job, "deleted", status="deleted")
        except StoreWriteFailed as exc:
            raise store_error(exc) from None
        del self.jobs[job_id]
        if job.task is not None and not job.task.done():
            job.task.cancel()
            try:
                await job.task
            except BaseException:  # noqa: BLE001 - cancelled as asked
                pass
        self.drop(job)
        # A step that was writing the file when the abort arrived finishes first: remove it again after that.
        self.async_omni.call(lambda: self.remove_files(job))

    def drop(self, job: VideoJobRecord) -> None:
        """A deleted or expired job (`deleted` committed): its files, then its row."""
        self._purge(job, "its row stays in the store as deleted (removed at the next start)")

    def _purge(self, job: VideoJobRecord, if_it_stays: str) -> None:
        """A job's files, then its row; a row that cannot be removed is logged (`if_it_stays`) and left for the
        next start to reconcile."""
        self.remove_files(job)
        if self.store is None:
            return
        try:
            self.store.purge(job.id)
        except StoreWriteFailed:
            log.warning("video job %s: %s", job.id, if_it_stays, exc_info=True)

    def remove_files(self, job: VideoJobRecord) -> None:
        for path in (job.path, job.upload):
            if path is not None:
                path.unlink(missing_ok=True)
        if job.path is not None:  # a stage worker killed while it wrote the MP4 leaves its temporary file
            remove_atomic_leftovers(job.path.parent, re.compile(re.escape(job.path.stem) + r"\..+"))

    def sweep(self) -> list[str]:
        """Remove the temporary files of video writes that never finished (a worker killed mid-export, a server
        killed before): at start and at shutdown. Only the server's own job files (video_<id>...) are touched."""
        removed = remove_atomic_leftovers(self.output_dir, JOB_FILE)
        if removed:
            log.info("removed %d unfinished video file(s) from %s", len(removed), self.output_dir)
        return removed

    def expire(self) -> int:
        if not self.ttl:
            return 0
        now = time.time()
        old = [j for j in self.jobs.values() if j.finished is not None and now - j.finished > self.ttl]
        for job in old:
            try:
                self.save(job, "deleted", status="deleted")
            except StoreWriteFailed:
                log.warning("video job %s expired but could not be marked deleted; retried later", job.id)
                continue
            del self.jobs[job.id]
            self.drop(job)
        return len(old)

    # At start, and at the end.

    async def resume(self, job: VideoJobRecord) -> None:
        """Submit a queued job again (at start); one the engine has no room for waits for the janitor."""
        try:
            stream = await self._open(job)
        except Overloaded:
            if job not in self.waiting:
                self.waiting.append(job)
            return
        except Exception as exc:  # noqa: BLE001 - the job fails with the request's error
            from .handlers import api_error

            error = self.about_upload(api_error(exc), job.upload)
            self._end_unrecorded(job, {"code": error.code, "message": error.message, "param": error.param})
            if job.upload is not None:
                job.upload.unlink(missing_ok=True)
            return
        job.task = asyncio.create_task(self._follow(job, stream), name=f"omni-{job.id}")

    async def resume_waiting(self) -> None:
        waiting, self.waiting = self.waiting, []
        for job in waiting:
            if self.jobs.get(job.id) is job and job.status == "queued" and job.task is None:
                await self.resume(job)

    async def close(self) -> None:
        for job in list(self.jobs.values()):
            if job.task is not None and not job.task.done():
                job.task.cancel()
        for job in list(self.jobs.values()):
            if job.task is not None:
                try:
                    await job.task
                except BaseException:  # noqa: BLE001
                    pass
        await self._requeue_unfinished()
        self.uploads.clean(keep={j.upload for j in self.jobs.values() if j.status in LIVE})
        self.sweep()

    async def _requeue_unfinished(self) -> None:
        """A job still in progress at the end (the server stopped it): back to the queue, to run at the next start."""
        for job in self.jobs.values():
            if job.status == "in_progress":
                try:
                    self.save(job, "requeued", status="queued", progress=0)
                except StoreWriteFailed:
                    log.warning("video job %s stays in_progress in the store (--on-restart decides)", job.id)
