"""WanRunner: per-request Wan2.2 state (a WanJob in the scheduler's record), advanced one phase per engine step.

The DiffusionScheduler owns each request's record, phase and step index: prepare -> denoise (one step per engine
step) -> decode -> export. The runner only runs what it is given; a request can be aborted between any two
steps (the engine calls `free`), and nothing is written before export, which writes the MP4 atomically.
A denoise batch (requests of one shape, each at its own step, text-to-video and image-to-video rows alike) is one
transformer forward: `denoise`; requests
that reach decode at the same step share one VAE decode; prepare runs batched too. With the model on a GPU,
export (ffmpeg) runs on the runner's export thread and its step's result is the Future of it, which the scheduler
holds the request on until it is done, so the GPU denoises on while a finished video is encoded; on a CPU it runs
in the step, because torch's threads already use every core and an encoder beside them only slows them.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
from omni_hf import Loaded

from omni_kernel.core.errors import RequestError
from omni_kernel.core.request import StageInput
from omni_kernel.core.scheduler import DiffusionSchedulerOutput, StepJob

from . import prepare_cache
from .device import WanDevice
from .inputs import WanInput
from .layout import ModelLayout
from .model import TextEmbeds
from .outputs import Progress
from .profiler import Profiler, profile_path
from .video import write_mp4

log = logging.getLogger("omni")


@attrs.define
class WanJob:
    """What the runner keeps of one request (`StepJob.state`): its profile, model state, frames and trace."""

    item: StageInput
    profiler: Profiler
    start: float = attrs.Factory(time.perf_counter)
    denoise: Any = None  # the model's DenoiseState, from prepare to decode
    frames: Any = None
    export: Future | None = None
    trace: dict = attrs.Factory(dict)
    batch_sizes: list[int] = attrs.Factory(list)  # requests in each of its denoise forwards

    @property
    def input(self) -> WanInput:
        return self.item.processed


class WanRunner:
    def __init__(self, node_id: str, layout: ModelLayout, placement: WanDevice, loaded: Loaded,
                 cache: prepare_cache.PrepareCache, video_preset: str = "veryfast"):
        self.node_id = node_id
        self.layout = layout
        self.placement = placement
        self.loaded = loaded  # the model, loaded when the stage was built; its first request reports the load
        self.model = loaded.model
        self.cache = cache
        self.num_jobs = 0
        self.cfg_batched = True  # cond and uncond rows in one forward (False: two forwards, as diffusers does)
        self.video_preset = video_preset
        self.exports = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"omni-{node_id}-export")
        self.export_in_background = placement.device == "cuda"
        self.group = None  # a RankGroup (ranks.py) when the forwards run over several ranks

    def add_request(self, record: StepJob) -> None:
        record.state = WanJob(record.item, Profiler(sync=self._sync()))
        self.num_jobs += 1

    def run(self, batch: DiffusionSchedulerOutput) -> dict[str, Any]:
        """The batch's phase; a denoise step is one forward of every job at its own step, here (the hot path)."""
        jobs = [r.state for r in batch.records]
        if batch.phase != "denoise":
            return {"prepare": self.prepare, "decode": self.decode, "export": self.export_batch}[batch.phase](jobs)
        steps = [step - 1 for step in batch.steps]  # the scheduler's step 0 was prepare
        timesteps = [float(j.denoise.timesteps[step]) for j, step in zip(jobs, steps)]
        start = time.perf_counter()
        if self.group is None:
            self.model.denoise_batch([j.denoise for j in jobs], steps, cfg_batched=self.cfg_batched)
        else:
            self.group.denoise([j.denoise for j in jobs], steps, [j.item.request_id for j in jobs], self.cfg_batched)
        end = self._synced()
        for job, step, timestep in zip(jobs, steps, timesteps):
            job.profiler.record(f"denoise:{step}", start, end, timestep=timestep, batch_size=len(jobs))
            job.batch_sizes.append(len(jobs))
            job.trace["diffusion.cfg_batched"] = self.cfg_batched and job.input.settings.guidance_scale > 1
        return {j.item.request_id: _finite(j, step) or Progress(step + 1, j.denoise.total)
                for j, step in zip(jobs, steps)}

    def free(self, record: StepJob) -> None:
        job = record.state
        if job is None:
            return
        if record.pending is not None and not record.pending.cancel():
            record.pending.add_done_callback(_remove_output)  # aborted while exporting: leave no MP4 behind
        self.num_jobs -= 1
        if self.group is not None:
            self.group.forget(record.item.request_id)
        if not self.num_jobs:
            self.model.forget_batch()

    def prepare(self, jobs: list[WanJob]) -> dict[str, Any]:
        """Requests prepared at the same step share one text-encoder call for the texts the cache lacks and one VAE
        encode for the images it lacks (one size: the batch key); each then draws its own noise. If the shared
        encode fails, each request encodes its own, so one bad request fails alone."""
        loaded = self.loaded
        self.loaded = attrs.evolve(loaded, cold=False, load_ms=0.0)
        start = time.perf_counter()
        fresh, texts_done = self._encode_missing(loaded, jobs)
        images_done = self._synced()
        results = {}
        for job in jobs:
            if loaded.cold:
                job.profiler.add("load", loaded.load_ms / 1000)
            job.profiler.record("text_encode", start, texts_done, batch_size=len(jobs))
            if job.input.image is not None:  # text-to-video has no image phase
                job.profiler.record("image_prepare", texts_done, images_done, batch_size=len(jobs))
            try:
                results[job.item.request_id] = self._prepare_one(job, loaded, fresh)
            except Exception as exc:  # noqa: BLE001 - this request fails, its neighbours go on
                results[job.item.request_id] = exc
        return results

    def _encode_missing(self, loaded, jobs: list[WanJob]) -> tuple[set, float]:
        """Encode every text and image of `jobs` that the cache lacks, texts in one call and images in one;
        returns the keys computed and when the texts were done."""
        model, fresh = loaded.model, set()
        texts = {}
        for job in jobs:
            s = job.input.settings
            for text in (job.item.prompt, s.negative_prompt) if s.guidance_scale > 1 else (job.item.prompt,):
                texts.setdefault(prepare_cache.text_key(loaded.key, text), text)
        images = {prepare_cache.image_key(loaded.key, j.input.digest, j.input.settings.height,
                                          j.input.settings.width): j for j in jobs if j.input.image is not None}
        fresh |= self._fill(texts, lambda missing: model.encode_texts([texts[k] for k in missing]))
        texts_done = self._synced()
        fresh |= self._fill(images, lambda missing: self._encode_images(model, [images[k] for k in missing]))
        return fresh, texts_done

    def _fill(self, keys, encode) -> set:
        """Put what `encode` makes for the keys the cache lacks, when two or more do (one is left to its request:
        the same call, with its own error). A failure leaves each request to encode its own."""
        missing = [k for k in keys if not self.cache.contains(k)]
        if len(missing) < 2:
            return set()
        try:
            for key, value in zip(missing, encode(missing)):
                self.cache.put(key, value)
        except Exception:  # noqa: BLE001 - each request retries alone in _prepare_one
            log.debug("a shared prepare of %d inputs failed; each request prepares its own", len(missing),
                      exc_info=True)
            return set()
        return set(missing)

    @staticmethod
    def _encode_images(model, jobs: list[WanJob]) -> list:
        s = jobs[0].input.settings
        return model.encode_images([j.input.image for j in jobs], s.height, s.width)

    def _prepare_one(self, job: WanJob, loaded, fresh: set) -> Progress:
        s, image = job.input.settings, job.input.image
        model = loaded.model

        def cached(key, compute):
            value, hit = self.cache.get_or_compute(key, compute)
            return value, hit and key not in fresh

        with job.profiler.span("text_encode"):
            text, text_hit = self._text(loaded.key, model, job.item.prompt, cached)
            negative, negative_hit = (self._text(loaded.key, model, s.negative_prompt, cached)
                                      if s.guidance_scale > 1 else (None, True))
            text, text_hit = TextEmbeds(text, negative), text_hit and negative_hit
        if image is None:  # text-to-video: no condition (the model's all-noise latents, a mask of ones)
            condition, image_hit = None, True
        else:
            with job.profiler.span("image_prepare"):
                condition, image_hit = cached(prepare_cache.image_key(loaded.key, job.input.digest, s.height,
                                                                      s.width),
                                              lambda: model.encode_image(image, s.height, s.width))
        with job.profiler.span("latents"):
            import torch

            generator = torch.Generator("cpu").manual_seed(s.seed)
            job.denoise = model.prepare(text, condition, s.height, s.width, s.num_frames, s.steps, s.guidance_scale,
                                      generator)
        if job.denoise.total != s.steps:  # the scheduler counts s.steps denoise steps; they must be the timesteps
            raise RuntimeError(f"the noise scheduler made {job.denoise.total} timesteps for {s.steps} steps")
        job.trace.update({"diffusion.load_was_cold": loaded.cold, "diffusion.load_ms": round(loaded.load_ms, 3),
                          "diffusion.text_cache": "hit" if text_hit else "miss",
                          "diffusion.task": "image_to_video" if image is not None else "text_to_video",
                          "diffusion.image_cache": ("hit" if image_hit else "miss") if image is not None else "none",
                          "diffusion.prepare_cache_hit": text_hit and image_hit,
                          "diffusion.cfg_batched": self.cfg_batched and s.guidance_scale > 1})
        return Progress(0, job.denoise.total)

    @staticmethod
    def _text(model_key, model, text: str, cached):
        return cached(prepare_cache.text_key(model_key, text), lambda: model.encode_text(text))

    def decode(self, jobs: list[WanJob]) -> dict[str, None]:
        start = time.perf_counter()
        frames = self.model.decode_batch([j.denoise for j in jobs])
        end = self._synced()
        for job, video in zip(jobs, frames):
            job.profiler.record("vae_decode", start, end, batch_size=len(jobs))
            job.frames, job.denoise = video, None
        return dict.fromkeys((j.item.request_id for j in jobs), None)

    def export_batch(self, jobs: list[WanJob]) -> dict[str, Any]:
        """Each job's MP4: written now (None, or the error), or the Future of the export thread writing it."""
        results: dict[str, Any] = {}
        for job in jobs:
            if self.export_in_background:
                results[job.item.request_id] = self.exports.submit(self.export, job)
                continue
            try:
                results[job.item.request_id] = self.export(job)
            except Exception as exc:  # noqa: BLE001 - e.g. the disk is full: this request fails alone
                results[job.item.request_id] = exc
        return results

    def export(self, job: WanJob) -> str:
        """Write the MP4 (CPU work only, maybe on the export thread: its span needs no device sync), and with
        `profile` the Chrome trace next to it; the MP4's path."""
        output = job.input.output
        start = time.perf_counter()
        write_mp4(job.frames, output, fps=self.layout.fps, preset=self.video_preset)
        job.profiler.record("export", start, time.perf_counter(), frames=len(job.frames))
        if job.item.params.profile:
            log.info("profile of request %s (%s):\n%s", job.item.request_id, self.node_id, job.profiler.table())
            try:
                chrome = job.profiler.write_chrome_trace(profile_path(output), job.item.request_id)
            except BaseException as exc:  # the request fails: it keeps no output, the MP4 neither
                Path(output).unlink(missing_ok=True)
                if isinstance(exc, OSError):
                    raise RequestError(f"cannot write the profile trace {profile_path(output)}: "
                                       f"{exc.strerror or exc}; the video was not kept") from None
                raise
            job.trace["diffusion.profile_trace"] = str(chrome)
        return str(output)

    def _synced(self) -> float:
        """perf_counter() after the device has finished its queued work."""
        sync = self._sync()
        if sync is not None:
            sync()
        return time.perf_counter()

    def _sync(self):
        if self.placement.device != "cuda":
            return None
        import torch

        return torch.cuda.synchronize


def _finite(job: WanJob, step: int) -> RequestError | None:
    """None while the job's latents are finite; else the error that fails this request alone (its batch goes on):
    a NaN or an infinity never goes away, and the video would be noise."""
    import torch

    if bool(torch.isfinite(job.denoise.latents).all()):
        return None
    s = job.input.settings
    return RequestError(f"the video's latents stopped being finite at denoise step {step + 1} of {job.denoise.total} "
                        f"(guidance_scale {s.guidance_scale:g}, {s.steps} steps): lower guidance_scale or try "
                        "another seed")


def _remove_output(future: Future) -> None:
    if not future.cancelled() and future.exception() is None:
        Path(future.result()).unlink(missing_ok=True)
