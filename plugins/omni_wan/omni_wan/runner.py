"""WanRunner: per-request Wan2.2 state, advanced one phase per engine step.

The DiffusionScheduler owns each request's phase and step index: prepare -> denoise (one step per engine
step) -> decode -> export. The runner only runs what it is given; a request can be aborted between any two
steps (the engine calls `free`), and nothing is written before export, which writes the MP4 atomically.
A denoise batch (requests of one shape, each at its own step) is one transformer forward: `denoise`; requests
that reach decode at the same step share one VAE decode; prepare runs batched too. The export step's result is a
Future of the StageOutput, which DiffusionStage reports when it is done. With the model on a GPU, export (ffmpeg)
runs on the runner's export thread, so the GPU denoises on while a finished video is encoded; on a CPU it runs
in the step, because torch's threads already use every core and an encoder beside them only slows them.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
from omni_kernel.request import StageInput, StageOutput
from omni_kernel.scheduler import DiffusionSchedulerOutput

from . import prepare_cache
from .device import Placement
from .layout import ModelLayout
from .loader import ModelPool
from .model import TextEmbeds
from .presets import DEFAULT_NEGATIVE_PROMPT
from .profiler import Profiler, profile_path
from .stage import Denoised, WanInput
from .video import write_mp4

log = logging.getLogger("omni")


@attrs.define
class Job:
    item: StageInput
    profiler: Profiler
    start: float = attrs.Factory(time.perf_counter)
    model: Any = None
    state: Any = None
    frames: Any = None
    trace: dict = attrs.Factory(dict)
    batch_sizes: list[int] = attrs.Factory(list)  # requests in each of its denoise forwards

    @property
    def input(self) -> WanInput:
        return self.item.processed


class WanRunner:
    def __init__(self, node_id: str, layout: ModelLayout, placement: Placement, model_label: str, pool: ModelPool,
                 cache: prepare_cache.PrepareCache, budget: str = "", video_preset: str = "veryfast"):
        self.node_id = node_id
        self.layout = layout
        self.placement = placement
        self.model_label = model_label
        self.pool = pool
        self.cache = cache
        self.jobs: dict[str, Job] = {}
        self.cfg_batched = True  # cond and uncond rows in one forward (False: two forwards, as diffusers does)
        self.budget = budget  # logged once, with the first request
        self.video_preset = video_preset
        self.exports = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"omni-{node_id}-export")
        self.export_in_background = placement.device == "cuda"

    def add_request(self, item: StageInput) -> None:
        self.jobs[item.request_id] = Job(item, Profiler(sync=self._sync()))

    def run(self, batch: DiffusionSchedulerOutput) -> dict[str, Any]:
        jobs = [self.jobs[rid] for rid in batch.request_ids]
        if batch.phase == "export":
            return {j.item.request_id: self._export(j) for j in jobs}
        return {"prepare": self.prepare, "denoise": self.denoise, "decode": self.decode}[batch.phase](jobs)

    def free(self, request_id: str) -> None:
        job = self.jobs.pop(request_id, None)
        if job is not None and job.model is not None and not self.jobs:
            job.model.forget_batch()

    def prepare(self, jobs: list[Job]) -> dict[str, Any]:
        """Requests prepared at the same step share one text-encoder call for the texts the cache lacks and one VAE
        encode for the images it lacks (one size: the batch key); each then draws its own noise. If the shared
        encode fails, each request encodes its own, so one bad request fails alone."""
        loaded = self.pool.acquire(self.layout.path, self.placement)
        if self.budget:
            log.info("%s: %s", self.node_id, self.budget)
            self.budget = ""
        start = time.perf_counter()
        fresh, texts_done = self._encode_missing(loaded, jobs)
        images_done = self._synced()
        results = {}
        for job in jobs:
            if loaded.cold:
                job.profiler.add("load", loaded.load_ms / 1000)
            job.profiler.record("text_encode", start, texts_done, batch_size=len(jobs))
            job.profiler.record("image_prepare", texts_done, images_done, batch_size=len(jobs))
            try:
                results[job.item.request_id] = self._prepare_one(job, loaded, fresh)
            except Exception as exc:  # noqa: BLE001 - this request fails, its neighbours go on
                results[job.item.request_id] = exc
        return results

    def _encode_missing(self, loaded, jobs: list[Job]) -> tuple[set, float]:
        """Encode every text and image of `jobs` that the cache lacks, texts in one call and images in one;
        returns the keys computed and when the texts were done."""
        model, fresh = loaded.model, set()
        texts = {}
        for job in jobs:
            s = job.input.settings
            for text in (job.item.prompt, s.negative_prompt) if s.guidance_scale > 1 else (job.item.prompt,):
                texts.setdefault(prepare_cache.text_key(loaded.key, text), text)
        images = {prepare_cache.image_key(loaded.key, j.input.digest, j.input.settings.height,
                                          j.input.settings.width): j for j in jobs}
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
    def _encode_images(model, jobs: list[Job]) -> list:
        s = jobs[0].input.settings
        return model.encode_images([j.input.image for j in jobs], s.height, s.width)

    def _prepare_one(self, job: Job, loaded, fresh: set) -> Denoised:
        s, image = job.input.settings, job.input.image
        model = job.model = loaded.model

        def cached(key, compute):
            value, hit = self.cache.get_or_compute(key, compute)
            return value, hit and key not in fresh

        with job.profiler.span("text_encode"):
            text, text_hit = self._text(loaded.key, model, job.item.prompt, cached)
            negative, negative_hit = (self._text(loaded.key, model, s.negative_prompt, cached)
                                      if s.guidance_scale > 1 else (None, True))
            text, text_hit = TextEmbeds(text, negative), text_hit and negative_hit
        with job.profiler.span("image_prepare"):
            condition, image_hit = cached(prepare_cache.image_key(loaded.key, job.input.digest, s.height, s.width),
                                          lambda: model.encode_image(image, s.height, s.width))
        with job.profiler.span("latents"):
            import torch

            generator = torch.Generator("cpu").manual_seed(s.seed)
            job.state = model.prepare(text, condition, s.height, s.width, s.num_frames, s.steps, s.guidance_scale,
                                      generator)
        if job.state.total != s.steps:  # the scheduler counts s.steps denoise steps; they must be the timesteps
            raise RuntimeError(f"the noise scheduler made {job.state.total} timesteps for {s.steps} steps")
        job.trace.update({"diffusion.load_was_cold": loaded.cold, "diffusion.load_ms": round(loaded.load_ms, 3),
                          "diffusion.text_cache": "hit" if text_hit else "miss",
                          "diffusion.image_cache": "hit" if image_hit else "miss",
                          "diffusion.prepare_cache_hit": text_hit and image_hit})
        return Denoised(0, job.state.total)

    @staticmethod
    def _text(model_key, model, text: str, cached):
        return cached(prepare_cache.text_key(model_key, text), lambda: model.encode_text(text))

    def denoise(self, jobs: list[Job]) -> dict[str, Denoised]:
        """One step of every job, at its own step, in one forward; each job's profile gets the batch's span."""
        steps = [(j.state.step, float(j.state.timesteps[j.state.step])) for j in jobs]
        start = time.perf_counter()
        jobs[0].model.denoise_batch([j.state for j in jobs], cfg_batched=self.cfg_batched)
        end = self._synced()
        for job, (step, timestep) in zip(jobs, steps):
            job.profiler.record(f"denoise:{step}", start, end, timestep=timestep, batch_size=len(jobs))
            job.batch_sizes.append(len(jobs))
        return {j.item.request_id: Denoised(j.state.step, j.state.total) for j in jobs}

    def decode(self, jobs: list[Job]) -> dict[str, None]:
        start = time.perf_counter()
        frames = jobs[0].model.decode_batch([j.state for j in jobs])
        end = self._synced()
        for job, video in zip(jobs, frames):
            job.profiler.record("vae_decode", start, end, batch_size=len(jobs))
            job.frames, job.state = video, None
        return dict.fromkeys((j.item.request_id for j in jobs), None)

    def _export(self, job: Job) -> Future:
        if self.export_in_background:
            return self.exports.submit(self.export, job)
        done: Future = Future()
        try:
            done.set_result(self.export(job))
        except Exception as exc:  # noqa: BLE001 - reported by the stage, as a failed background export is
            done.set_exception(exc)
        return done

    def export(self, job: Job) -> StageOutput:
        """Write the MP4 (CPU work only, maybe on the export thread: its span needs no device sync)."""
        params, output = job.item.params, job.input.output
        start = time.perf_counter()
        write_mp4(job.frames, output, fps=self.layout.fps, preset=self.video_preset)
        job.profiler.record("export", start, time.perf_counter(), frames=len(job.frames))
        trace = self._trace(job, params.profile)
        if params.profile:
            log.info("profile of request %s (%s):\n%s", job.item.request_id, self.node_id, job.profiler.table())
            chrome = job.profiler.write_chrome_trace(profile_path(output), job.item.request_id)
            trace["diffusion.profile_trace"] = str(chrome)
        data = {"frames": job.frames} if params.return_frames else None
        return StageOutput(job.item.request_id, self.node_id, path=str(output), data=data, contract="video/mp4",
                           trace=trace)

    def _trace(self, job: Job, profile: bool) -> dict:
        s = job.input.settings
        negative = "wan default" if s.negative_prompt == DEFAULT_NEGATIVE_PROMPT else s.negative_prompt
        trace = {"diffusion.model": self.model_label, "diffusion.prompt": job.item.prompt,
                 "diffusion.negative_prompt": negative, "diffusion.seed": s.seed, "diffusion.fps": self.layout.fps,
                 "diffusion.output": str(job.input.output)}
        trace.update(s.trace())
        trace.update(self.placement.trace())
        trace.update(job.trace)
        sizes = job.batch_sizes or [0]
        trace.update({"diffusion.batch_size_mean": round(sum(sizes) / len(sizes), 3),
                      "diffusion.batch_size_max": max(sizes),
                      "diffusion.cfg_batched": self.cfg_batched and s.guidance_scale > 1})
        trace.update(job.profiler.trace(detailed=profile))
        trace["diffusion.elapsed_ms"] = round((time.perf_counter() - job.start) * 1000, 3)
        return trace

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
