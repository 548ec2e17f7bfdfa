"""Wan22I2VPipeline: the diffusers WanImageToVideoPipeline call, split into steps an engine can drive.

prepare (text encode, image conditioning, latents, timesteps) -> one denoise step per call -> VAE decode ->
postprocess. Each piece does exactly what `WanImageToVideoPipeline.__call__` (diffusers 0.42) does for a
Wan2.2 TI2V checkpoint (expand_timesteps, no transformer_2, no image encoder), so the output equals a direct
call with the same seed and settings. Without an image (text-to-video) it is `WanPipeline.__call__` on the same
checkpoint: all-noise latents and a mask of ones (no first-frame condition), so every token's timestep is t and
`(1 - mask) * condition + mask * latents` is the latents themselves; one such row and image rows share a forward.
"""

from __future__ import annotations

import logging
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from omni_hf import torch_dtype

from .cpu_vae import speed_up_cpu_vae
from .crossattn import CrossKV, TextKV
from .device import WanDevice
from .step_cache import CachePolicy, RequestCache

log = logging.getLogger("omni")
MAX_SEQUENCE_LENGTH = 512  # diffusers' default for this pipeline


@attrs.frozen(eq=False)
class Text:
    """One encoded text, and its cross-attention keys and values (None: the blocks project it every step)."""

    embeds: torch.Tensor
    kv: TextKV | None = None

    @property
    def nbytes(self) -> int:
        return self.embeds.numel() * self.embeds.element_size() + (self.kv.nbytes if self.kv else 0)


@attrs.frozen
class TextEmbeds:
    prompt: Text
    negative: Text | None


@attrs.define
class DenoiseState:
    """One request's denoising state; the scheduler is a private copy because UniPC keeps history. Which step it
    is at is the engine scheduler's to count (`StepJob.step`), passed to `denoise_batch`."""

    latents: torch.Tensor
    condition: torch.Tensor
    mask: torch.Tensor
    timesteps: torch.Tensor
    scheduler: Any
    text: TextEmbeds
    guidance_scale: float
    step_cache: RequestCache | None = None  # its step cache's state (None: every forward runs every block)

    @property
    def total(self) -> int:
        return len(self.timesteps)


class Wan22I2VPipeline:
    def __init__(self, pipe, wan_device: WanDevice):
        self.pipe = pipe
        self.wan_device = wan_device  # (`device` is the torch device the pipeline runs on)
        # Offloaded, the transformer's weights reach the GPU only inside a forward: project the text there.
        self.cross_kv = None if wan_device.offloaded else CrossKV(pipe.transformer)
        from .blocks import CachedBlocks

        self.blocks = CachedBlocks(pipe.transformer, self.cross_kv)  # each row's step cache decided in the forward
        self.parallel = None  # a WanParallel: this process is one rank of a group running each forward together

    @classmethod
    def load(cls, path: str | Path, device: WanDevice) -> Wan22I2VPipeline:
        from diffusers import AutoencoderKLWan, WanImageToVideoPipeline

        dtype = torch_dtype(device.dtype)
        vae = AutoencoderKLWan.from_pretrained(path, subfolder="vae", dtype=torch_dtype(device.vae_dtype),
                                               use_safetensors=True)
        pipe = WanImageToVideoPipeline.from_pretrained(path, vae=vae, dtype=dtype, use_safetensors=True)
        if not pipe.config.expand_timesteps or pipe.transformer_2 is not None:
            raise ValueError("not a Wan2.2 TI2V checkpoint (expand_timesteps with one transformer)")
        pipe.set_progress_bar_config(disable=True)
        if device.offloaded:
            pipe.enable_model_cpu_offload()
        elif device.device != "cpu":
            pipe.to(device.device)
        else:
            speed_up_cpu_vae(pipe.vae)
        return cls(pipe, device)

    @classmethod
    def load_transformer(cls, path: str | Path, device: WanDevice) -> Wan22I2VPipeline:
        """Only the transformer, on its device: what a rank other than 0 runs (denoise_batch); no text encoder,
        no VAE (rank 0 encodes, prepares and decodes)."""
        from diffusers import WanTransformer3DModel

        transformer = WanTransformer3DModel.from_pretrained(path, subfolder="transformer",
                                                            dtype=torch_dtype(device.dtype), use_safetensors=True)
        if device.device != "cpu":
            transformer.to(device.device)
        return cls(types.SimpleNamespace(transformer=transformer), device)

    @property
    def device(self) -> torch.device:
        return self.pipe._execution_device

    @property
    def transformer_dtype(self) -> torch.dtype:
        return self.pipe.transformer.dtype

    def encode_text(self, text: str) -> Text:
        return self.encode_texts([text])[0]

    @torch.no_grad()
    def encode_texts(self, texts: list[str]) -> list[Text]:
        """Texts (prompts or negative prompts) as the pipeline encodes each one (padded to 512 tokens, masked), in
        one text-encoder call, with their keys and values."""
        embeds, _ = self.pipe.encode_prompt(prompt=list(texts), do_classifier_free_guidance=False,
                                            num_videos_per_prompt=1, max_sequence_length=MAX_SEQUENCE_LENGTH,
                                            device=self.device)
        embeds = embeds.to(self.transformer_dtype)
        kvs = self.cross_kv.project(embeds) if self.cross_kv else [None] * len(texts)
        return [Text(row.unsqueeze(0).clone(), kv) for row, kv in zip(embeds, kvs)]

    def encode_image(self, image, height: int, width: int) -> torch.Tensor:
        return self.encode_images([image], height, width)[0]

    @torch.no_grad()
    def encode_images(self, images: list, height: int, width: int) -> list[torch.Tensor]:
        """Each image's first-frame condition, in one VAE encode: the latent (mode) of the resized image,
        normalized."""
        from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents
        from diffusers.utils.torch_utils import get_module_execution_device

        pipe, device = self.pipe, self.device
        pixels = pipe.video_processor.preprocess(list(images), height=height, width=width)
        video = pixels.unsqueeze(2).to(device=get_module_execution_device(pipe.vae), dtype=pipe.vae.dtype)
        latents = retrieve_latents(pipe.vae.encode(video), sample_mode="argmax").to(device=device, dtype=torch.float32)
        mean, inv_std = self._latent_stats(device, torch.float32)
        return [((row - mean) * inv_std).clone() for row in latents.split(1)]

    def prepare(self, text: TextEmbeds, condition: torch.Tensor | None, height: int, width: int, num_frames: int,
                steps: int, guidance_scale: float, generator: torch.Generator,
                step_cache: CachePolicy | None = None) -> DenoiseState:
        """One request's noise, timesteps and condition; `condition` None is text-to-video (WanPipeline): a zero
        condition under a mask of ones, so the latents go to the transformer and the VAE unchanged. With a
        `step_cache` policy, its (empty) step cache."""
        from diffusers.utils.torch_utils import randn_tensor

        pipe, device = self.pipe, self.device
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        scheduler.set_timesteps(steps, device=device)
        frames = (num_frames - 1) // pipe.vae_scale_factor_temporal + 1
        shape = (1, pipe.vae.config.z_dim, frames, height // pipe.vae_scale_factor_spatial,
                 width // pipe.vae_scale_factor_spatial)
        latents = randn_tensor(shape, generator=generator, device=device, dtype=torch.float32)
        mask = torch.ones(1, 1, *shape[2:], dtype=torch.float32, device=device)
        if condition is None:
            condition = torch.zeros(1, shape[1], 1, *shape[3:], dtype=torch.float32, device=device)
        else:
            mask[:, :, 0] = 0  # the first latent frame is the image's: timestep 0 on its tokens
        cache = None if step_cache is None else RequestCache(step_cache)
        return DenoiseState(latents, condition, mask, scheduler.timesteps, scheduler, text, guidance_scale, cache)

    @torch.no_grad()
    def denoise_batch(self, states: list[DenoiseState], steps: list[int], cfg_batched: bool = True) -> None:
        """Denoise step `steps[i]` of every request in `states` (same latent shape), each at its own timestep, with its
        own condition, text and guidance scale. The rows share the transformer call(s): all cond rows, then the
        uncond rows of the guided requests, in one forward (`cfg_batched`) or in a second one; on a rank of a
        guidance-parallel group, the rank's branch, and the other's gathered. Each request's UniPC scheduler then
        steps on its own prediction (on every rank of a group alike). Each row decides its step cache for itself,
        in its branch's state (blocks.py)."""
        model, dtype = self.pipe.transformer, self.transformer_dtype
        ts = [s.timesteps[step] for s, step in zip(states, steps)]
        inputs = [((1 - s.mask) * s.condition + s.mask * s.latents).to(dtype) for s in states]
        stamps = [(s.mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0) for s, t in zip(states, ts)]
        guided = [i for i, s in enumerate(states) if s.guidance_scale > 1]
        caches = [s.step_cache for s in states]
        cond = ("cond", inputs, stamps, [s.text.prompt for s in states],
                [c and c.branch("cond") for c in caches])
        uncond = ("uncond", [inputs[i] for i in guided], [stamps[i] for i in guided],
                  [states[i].text.negative for i in guided], [caches[i] and caches[i].branch("uncond") for i in guided])
        noise = []
        for name, latents, timesteps, texts, rows in self._passes(cond, uncond, cfg_batched):
            with model.cache_context(name), self._context(texts) as context, self.blocks.use(rows):
                noise.extend(model(hidden_states=torch.cat(latents), timestep=torch.cat(timesteps),
                                   encoder_hidden_states=context, encoder_hidden_states_image=None,
                                   attention_kwargs=None, return_dict=False)[0].split(1))
        if guided and self._guidance_parallel():
            noise = self.parallel.gather(noise, [len(states), len(guided)])
            if any(caches):
                self.parallel.share_hits(cond[4], uncond[4])
        for i, (state, t) in enumerate(zip(states, ts)):
            pred = noise[i]
            if state.guidance_scale > 1:
                negative = noise[len(states) + guided.index(i)]
                pred = negative + state.guidance_scale * (pred - negative)
            state.latents = state.scheduler.step(pred, t, state.latents, return_dict=False)[0]

    def _passes(self, cond: tuple, uncond: tuple, cfg_batched: bool) -> list[tuple]:
        """The transformer forwards of one denoise step, each (cache name, latents, timesteps, texts, step caches):
        the cond rows alone when no row is guided; on a rank of a guidance-parallel group, the rank's own branch (the
        other's is gathered after the forward, parallel.py); else the cond and uncond rows in one forward
        (`cfg_batched`) or in two."""
        if not uncond[1]:
            return [cond]
        if self._guidance_parallel():
            return [self.parallel.branch(cond, uncond)]
        if cfg_batched:
            return [("cond_uncond", *(a + b for a, b in zip(cond[1:], uncond[1:])))]
        return [cond, uncond]

    def _guidance_parallel(self) -> bool:
        return self.parallel is not None and self.parallel.mesh.cfg > 1

    @contextmanager
    def _context(self, texts: list[Text]):
        """The forward's text: the rows' projected keys and values when every row has them, else the embeddings."""
        if self.cross_kv is None or any(t.kv is None for t in texts):
            yield torch.cat([t.embeds for t in texts])
            return
        with self.cross_kv.use([t.kv for t in texts]):
            yield self.cross_kv.placeholder(len(texts), texts[0].embeds.dtype, texts[0].embeds.device)

    def forget_batch(self) -> None:
        """Drop the joined keys and values of the last batch (its requests have left)."""
        if self.cross_kv is not None:
            self.cross_kv.forget()

    @torch.no_grad()
    def decode_batch(self, states: list[DenoiseState]) -> list[np.ndarray]:
        """One VAE decode of requests with the same latent shape: each one's frames, float32 (num_frames, height,
        width, 3) in [0, 1]."""
        from diffusers.utils.torch_utils import get_module_execution_device

        pipe = self.pipe
        latents = torch.cat([(1 - s.mask) * s.condition + s.mask * s.latents for s in states])
        latents = latents.to(device=get_module_execution_device(pipe.vae), dtype=pipe.vae.dtype)
        mean, inv_std = self._latent_stats(latents.device, latents.dtype)
        video = pipe.vae.decode(latents / inv_std + mean, return_dict=False)[0]
        frames = pipe.video_processor.postprocess_video(video, output_type="np")
        pipe.maybe_free_model_hooks()
        return list(frames)

    def _latent_stats(self, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.pipe.vae.config
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(device, dtype)
        inv_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(device, dtype)
        return mean, inv_std
