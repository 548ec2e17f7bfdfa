"""Video jobs (the OpenAI Videos API): each job is one engine request, followed by a task that updates the job
as its events arrive (progress every denoise step). Files live under the server's own output directory; the
client never names a path. Finished jobs and their files expire after the TTL."""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import re
import time
import uuid
from pathlib import Path
from typing import Any

import attrs

from omni_kernel.events import RequestFailed, RequestFinished, StageProgress
from omni_kernel.util.files import remove_atomic_leftovers

from .engine import AsyncOmni
from .protocol import APIError

log = logging.getLogger("omni")
DATA_URL = re.compile(r"^data:image/[A-Za-z0-9.+-]+;base64,(.*)$", re.S)
JOB_FILE = re.compile(r"video_[0-9a-f]{32}\..+")  # a job's MP4 (video_<id>.mp4) and what is named after it


def scrub(message: str, upload: Path) -> str:
    """`message` with the server's path of an uploaded image replaced by the field it came in."""
    path = str(upload)
    for shown, said in ((f"image {path!r}", "the input_reference image"), (repr(path), "input_reference"),
                        (path, "input_reference")):
        message = message.replace(shown, said)
    return message


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
    finished: float | None = None  # monotonic time it completed or failed (for the TTL)

    def to_json(self, ttl: float | None) -> dict[str, Any]:
        expires = None if self.completed_at is None or not ttl else int(self.completed_at + ttl)
        # `seconds` is a string in OpenAI's job object: what the request asked for, else (until the video is
        # rendered and its length known) "".
        return {"id": self.id, "object": "video", "status": self.status, "progress": self.progress,
                "model": self.model, "prompt": self.prompt, "size": self.size, "seconds": self.seconds or "",
                "remixed_from_video_id": None, "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": expires, "error": self.error}


class VideoJobs:
    def __init__(self, async_omni: AsyncOmni, output_dir: Path, ttl: float | None, metrics=None):
        self.async_omni = async_omni
        self.output_dir = output_dir
        self.uploads = output_dir / ".uploads"
        self.ttl = ttl
        self.metrics = metrics
        self.jobs: dict[str, VideoJobRecord] = {}

    def counts(self) -> dict[str, int]:
        counts = {s: 0 for s in ("queued", "in_progress", "completed", "failed")}
        for job in list(self.jobs.values()):
            counts[job.status] = counts.get(job.status, 0) + 1
        return counts

    def save_upload(self, job_id: str, data: bytes, filename: str | None) -> Path:
        self.uploads.mkdir(parents=True, exist_ok=True)
        suffix = Path(filename or "").suffix.lower()
        suffix = suffix if re.fullmatch(r"\.[a-z0-9]{1,5}", suffix) else ".img"
        path = self.uploads / f"{job_id}{suffix}"
        path.write_bytes(data)
        return path

    @staticmethod
    def decode_data_url(text: str) -> bytes:
        match = DATA_URL.match(text.strip())
        if not match:
            raise APIError(400, "invalid input_reference: upload an image file or send a data:image/...;base64 URL "
                                "(the server fetches no URLs)", "input_reference")
        try:
            return base64.b64decode(match.group(1), validate=False)
        except (binascii.Error, ValueError):
            raise APIError(400, "invalid input_reference: the data URL is not valid base64", "input_reference") from None

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

    async def create(self, job_id: str, model: str, prompt: str, image: Path | None, params: dict[str, Any],
                     size: str | None, seconds: str | None) -> VideoJobRecord:
        """Submit the job's request; a UserError raises here (answered 400), nothing is left behind."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.output_dir / f"{job_id}.mp4"
        job = VideoJobRecord(job_id, model, int(time.time()), size, seconds, prompt or None, path=path, upload=image)
        try:
            stream = await self.async_omni.open(model, prompt, image=None if image is None else str(image),
                                                request_id=job_id, output=str(path), **params)
        except BaseException:
            self._remove_files(job)
            raise
        self.jobs[job_id] = job
        job.task = asyncio.create_task(self._follow(job, stream), name=f"omni-{job_id}")
        return job

    async def _follow(self, job: VideoJobRecord, stream) -> None:
        last = time.perf_counter()  # when the final node's last progress came (a denoise step's time)
        final = self.async_omni.omnis[job.model].graph.final
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
                        job.status = "in_progress"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the job fails, the server goes on
            log.exception("video job %s failed", job.id)
            job.error = {"code": "runtime", "message": f"{type(exc).__name__}: {exc}", "param": None}
            self._end(job, "failed")
        finally:
            if job.upload is not None:
                job.upload.unlink(missing_ok=True)
                job.upload = None

    def _progress(self, job: VideoJobRecord, event: StageProgress, last: float) -> float:
        """A step of the final node: the job's progress, and the step's time into the metrics; returns now."""
        now = time.perf_counter()
        if self.metrics is not None and event.step > 0:
            self.metrics.denoise.labels(job.model).observe(now - last)
        job.status = "in_progress"
        job.progress = min(99, int(100 * event.step / max(event.total, 1)))
        return now

    def _completed(self, job: VideoJobRecord, result) -> None:
        """The video's size and length as rendered, where the request did not say them."""
        trace = result.trace
        if job.size is None and "diffusion.width" in trace:
            job.size = f"{trace['diffusion.width']}x{trace['diffusion.height']}"
        if job.seconds is None and "diffusion.num_frames" in trace:
            fps = trace.get("diffusion.fps") or 24
            job.seconds = f"{trace['diffusion.num_frames'] / fps:g}"
        job.path = Path(result.path) if result.path else job.path
        self._end(job, "completed")
        job.progress = 100

    def _failed(self, job: VideoJobRecord, event: RequestFailed) -> None:
        self._remove_files(attrs.evolve(job, upload=None))  # no partial output of a failed job
        error = self.about_upload(APIError.of_failure(event.kind, event.error, event.field), job.upload)
        param = "input_reference" if error.param == "image" else error.param  # the API's name
        job.error = {"code": event.kind, "message": error.message, "param": param}
        self._end(job, "failed")

    def _end(self, job: VideoJobRecord, status: str) -> None:
        job.status = status
        job.completed_at = int(time.time())
        job.finished = time.monotonic()

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
        """Cancel a running job (it stops between denoise steps) and delete its file."""
        job = self.get(job_id)
        del self.jobs[job_id]
        if job.task is not None and not job.task.done():
            job.task.cancel()
            try:
                await job.task
            except BaseException:  # noqa: BLE001 - cancelled as asked
                pass
        self._remove_files(job)
        # A step that was writing the file when the abort arrived finishes first: remove it again after that.
        self.async_omni.call(lambda: self._remove_files(job))

    def _remove_files(self, job: VideoJobRecord) -> None:
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
        now = time.monotonic()
        old = [j for j in self.jobs.values() if j.finished is not None and now - j.finished > self.ttl]
        for job in old:
            del self.jobs[job.id]
            self._remove_files(job)
        return len(old)

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
        if self.uploads.is_dir():
            for leftover in self.uploads.iterdir():
                leftover.unlink(missing_ok=True)
            self.uploads.rmdir()
        self.sweep()
