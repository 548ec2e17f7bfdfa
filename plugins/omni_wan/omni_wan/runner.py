"""WanRunner: per-request Wan2.2 state (a WanJob in the scheduler's record), advanced one phase per engine step.

Wan's phases are this module's: `phases(item)` names a request's steps (prepare, one denoise step per denoise
step of its settings, decode, export), which the kernel's PhaseScheduler counts and batches phase by phase in
PHASE_ORDER, and PHASES runs each phase with its runner method. The runner only runs what it is given; a request
can be aborted between any two steps (the engine calls `free`), and nothing is written before export, which
writes the MP4 atomically. A denoise batch (requests of one shape, each at its own step, text-to-video and
image-to-video rows alike) is one transformer forward; requests that reach decode at the same step share one
VAE decode; prepare runs batched too. With the model on a GPU, export (ffmpeg) runs on the runner's export
thread and its step's result is the Future of it, which the scheduler holds the request on until it is done, so
the GPU denoises on while a finished video is encoded; on a CPU it runs in the step, because torch's threads
already use every core and an encoder beside them only slows them.

The runner measures (times, cache hits, batch sizes, the load) into the request's WanJob; the output processor
(outputs.py) turns what it measured into the request's diffusion.* trace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from omni_hf import Loaded

from omni_kernel.core.errors import RequestError
from omni_kernel.core.request import StageInput
from omni_kernel.core.scheduler import PhaseSchedulerOutput, StepJob

from . import calibration, prepare_cache
from .device import WanDevice
from .job import Progress, StepResult, WanJob
from .layout import ModelLayout
from .model import TextEmbeds
from .profiler import Profiler, profile_path
from .step_cache import CachePolicy, interpolate
from .video import write_mp4

log = logging.getLogger("omni")


def phases(item: StageInput) -> tuple[str, ...]:
    """A request's steps, one phase name each (the PhaseScheduler's `phases`)."""
    return ("prepare", *["denoise"] * item.processed.settings.steps, "decode", "export")


# Finishing and newly arrived requests first, then every denoising request of one batch key: newcomers join the
# denoise batch at the next step.
PHASE_ORDER = ("export", "decode", "prepare", "denoise")


class WanRunner:
    def __init__(self, node_id: str, layout: ModelLayout, device: WanDevice, loaded: Loaded,
                 cache: prepare_cache.PrepareCache, video_preset: str = "veryfast"):
        self.node_id = node_id
        self.layout = layout
        self.device = device
        self.loaded = loaded  # the model, loaded when the engine was built
        self.model = loaded.model
        self.unreported_load_ms = loaded.load_ms if loaded.cold else None  # the first prepare's requests report it
        self.cache = cache
        self.num_jobs = 0
        self.cfg_batched = True  # cond and uncond rows in one forward (False: two forwards, as diffusers does)
        self.video_preset = video_preset
        self.exports = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"omni-{node_id}-export")
        self.export_in_background = device.device == "cuda"
        self.group = None  # a RankGroup (ranks.py) when the forwards run over several ranks
        self.num_cache_hits = 0  # transformer forwards of cached requests that skipped their blocks (/metrics)
        self.num_cache_misses = 0  # ... and that ran every block

    def stats(self) -> dict:
        """The counters this runner keeps (the scheduler's `model_stats`: StageStats.model, on /metrics as
        omni_step_cache_hits and omni_step_cache_misses)."""
        return {"step_cache_hits": self.num_cache_hits, "step_cache_misses": self.num_cache_misses}

    def add_request(self, record: StepJob) -> None:
        record.state = WanJob(record.item, Profiler(sync=self._sync()))
        self.num_jobs += 1

    def run(self, batch: PhaseSchedulerOutput) -> dict[str, StepResult]:
        """The batch's phase (PHASES), each job at its own step."""
        jobs = [record.state for record in batch.records]
        return PHASES[batch.phase](self, jobs, batch.steps)

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

    def prepare(self, jobs: list[WanJob], steps: Sequence[int]) -> dict[str, StepResult]:
        """Requests prepared at the same step share one text-encoder call for the texts the cache lacks and one VAE
        encode for the images it lacks (one size: the batch key); each then draws its own noise. If the shared
        encode fails, each request encodes its own, so one bad request fails alone."""
        load_ms, self.unreported_load_ms = self.unreported_load_ms, None
        start = time.perf_counter()
        fresh, texts_done = self._encode_missing(jobs)
        images_done = self._synced()
        results: dict[str, StepResult] = {}
        for job in jobs:
            job.load_ms = load_ms
            if load_ms is not None:
                job.profiler.add("load", load_ms / 1000)
            job.profiler.record("text_encode", start, texts_done, batch_size=len(jobs))
            if job.input.image is not None:  # text-to-video has no image phase
                job.profiler.record("image_prepare", texts_done, images_done, batch_size=len(jobs))
            try:
                results[job.item.request_id] = self._prepare_one(job, fresh)
            except Exception as exc:  # noqa: BLE001 - this request fails, its neighbours go on
                results[job.item.request_id] = exc
        return results

    def _encode_missing(self, jobs: list[WanJob]) -> tuple[set, float]:
        """Encode every text and image of `jobs` that the cache lacks, texts in one call and images in one;
        returns the keys computed and when the texts were done."""
        model, key, fresh = self.model, self.loaded.key, set()
        texts = {}
        for job in jobs:
            s = job.input.settings
            for text in (job.item.prompt, s.negative_prompt) if s.guidance_scale > 1 else (job.item.prompt,):
                texts.setdefault(prepare_cache.text_key(key, text), text)
        images = {prepare_cache.image_key(key, j.input.digest, j.input.settings.height,
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

    def _prepare_one(self, job: WanJob, fresh: set) -> Progress:
        s, image = job.input.settings, job.input.image
        model, key = self.model, self.loaded.key

        def cached(cache_key, compute):
            value, hit = self.cache.get_or_compute(cache_key, compute)
            return value, hit and cache_key not in fresh

        with job.profiler.span("text_encode"):
            text, text_hit = self._text(key, model, job.item.prompt, cached)
            negative, negative_hit = (self._text(key, model, s.negative_prompt, cached)
                                      if s.guidance_scale > 1 else (None, True))
        condition = None  # text-to-video: no condition (the model's all-noise latents, a mask of ones)
        if image is not None:
            with job.profiler.span("image_prepare"):
                condition, job.image_hit = cached(prepare_cache.image_key(key, job.input.digest, s.height, s.width),
                                                  lambda: model.encode_image(image, s.height, s.width))
        job.text_hit = text_hit and negative_hit
        with job.profiler.span("latents"):
            import torch

            generator = torch.Generator("cpu").manual_seed(s.seed)
            job.denoise = model.prepare(TextEmbeds(text, negative), condition, s.height, s.width, s.num_frames,
                                        s.steps, s.guidance_scale, generator, self._cache_policy(s))
        job.step_cache, job.num_blocks = job.denoise.step_cache, len(model.pipe.transformer.blocks)
        if job.denoise.total != s.steps:  # the scheduler counts s.steps denoise steps; they must be the timesteps
            raise RuntimeError(f"the noise scheduler made {job.denoise.total} timesteps for {s.steps} steps")
        return Progress(0, job.denoise.total)

    def _cache_policy(self, s) -> CachePolicy | None:
        if s.step_cache == "none":
            return None
        ratios = None
        if s.step_cache == "mag":
            ratios = interpolate(calibration.require_ratios(self.layout.path), s.steps)
        return CachePolicy(s.step_cache, s.step_cache_threshold, s.steps, ratios)

    @staticmethod
    def _text(model_key, model, text: str, cached):
        return cached(prepare_cache.text_key(model_key, text), lambda: model.encode_text(text))

    def denoise(self, jobs: list[WanJob], steps: Sequence[int]) -> dict[str, StepResult]:
        """One forward of every job at its own denoise step (the hot path): its progress, or the error that fails
        a job whose latents stopped being finite."""
        denoise_steps = [step - 1 for step in steps]  # step 0 was prepare
        timesteps = [float(j.denoise.timesteps[step]) for j, step in zip(jobs, denoise_steps)]
        start = time.perf_counter()
        if self.group is None:
            self.model.denoise_batch([j.denoise for j in jobs], denoise_steps, cfg_batched=self.cfg_batched)
        else:
            self.group.denoise([j.denoise for j in jobs], denoise_steps, [j.item.request_id for j in jobs],
                               self.cfg_batched)
        end = self._synced()
        results: dict[str, StepResult] = {}
        for job, step, timestep in zip(jobs, denoise_steps, timesteps):
            job.profiler.record(f"denoise:{step}", start, end, timestep=timestep, batch_size=len(jobs))
            job.batch_sizes.append(len(jobs))
            job.cfg_batched = self.cfg_batched and job.input.settings.guidance_scale > 1
            error = _not_finite(job, step)
            if error is not None:
                results[job.item.request_id] = error
            else:
                results[job.item.request_id] = Progress(step + 1, job.denoise.total, self._count_cache(job))
        return results

    def _count_cache(self, job: WanJob) -> bool | None:
        """Count the step's forwards of a cached request; whether all of them came from its cache."""
        cache = job.denoise.step_cache
        if cache is None:
            return None
        hits = sum(b.last_hit for b in cache.branches.values())
        self.num_cache_hits += hits
        self.num_cache_misses += len(cache.branches) - hits
        return cache.step_hit()

    def decode(self, jobs: list[WanJob], steps: Sequence[int]) -> dict[str, StepResult]:
        """One VAE decode of the jobs' latents (one shape: the batch key) into their frames."""
        start = time.perf_counter()
        frames = self.model.decode_batch([j.denoise for j in jobs])
        end = self._synced()
        for job, video in zip(jobs, frames):
            job.profiler.record("vae_decode", start, end, batch_size=len(jobs))
            job.frames, job.denoise = video, None
        return dict.fromkeys((j.item.request_id for j in jobs), None)

    def export_batch(self, jobs: list[WanJob], steps: Sequence[int]) -> dict[str, StepResult]:
        """Each job's MP4: written now (its path, or the error), or the Future of the export thread writing it."""
        results: dict[str, StepResult] = {}
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
            job.profile_trace = chrome
        return str(output)

    def _synced(self) -> float:
        """perf_counter() after the device has finished its queued work."""
        sync = self._sync()
        if sync is not None:
            sync()
        return time.perf_counter()

    def _sync(self):
        if self.device.device != "cuda":
            return None
        import torch

        return torch.cuda.synchronize


# Each phase's runner method: the jobs of one step, each one's step index (the scheduler's) -> each one's result.
PHASES: dict[str, Callable[[WanRunner, list[WanJob], Sequence[int]], dict[str, StepResult]]] = {
    "prepare": WanRunner.prepare,
    "denoise": WanRunner.denoise,
    "decode": WanRunner.decode,
    "export": WanRunner.export_batch,
}


def _not_finite(job: WanJob, step: int) -> RequestError | None:
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
