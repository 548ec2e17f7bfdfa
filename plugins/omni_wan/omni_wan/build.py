"""build_stage: a `diffusion.wan22_i2v` node's Stage(WanInputProcessor, Engine(DiffusionScheduler, WanRunner),
WanOutputProcessor), with its model loaded (once per process and plugin host: the ModelPool).

One engine step is one phase (prepare, one denoise step, decode, export). Finishing and newly arrived requests go
first (export, decode, prepare), then every denoising request of one batch key (size, frames, CFG on/off, dtype)
shares one denoise forward, each at its own step, up to `wan_max_batch` requests and `wan_max_batch_tokens`
latent tokens. Text-to-video and image-to-video requests share a key: a text row is all noise under a mask of ones,
the same shapes as an image row (whose mask is 0 on the first latent frame).

The node policy `image` (required, none, optional; inputs.py) is checked when a request is processed; a policy
other than `required` on a checkpoint without a text-to-video path is refused here, before the model loads.
"""

from __future__ import annotations

import json

from omni_kernel.core.engine import Engine, EngineView
from omni_kernel.core.errors import GraphError, ModelError, UserError
from omni_kernel.core.graph import NodeSpec
from omni_kernel.core.scheduler import DiffusionScheduler
from omni_kernel.core.stage import Stage

from .demo import ensure_demo_model
from .device import WanDevice, place
from .inputs import IMAGE_POLICIES, WanInputProcessor
from .layout import ModelLayout, read_layout
from .loader import ModelPool
from .outputs import WanOutputProcessor
from .params import WanConfig
from .prepare_cache import PrepareCache
from .presets import PRESETS, Settings
from .runner import WanRunner

CPU_TOKEN_BUDGET = 16384  # on a CPU a forward is compute-bound long before memory matters


def build_stage(node: NodeSpec, config: WanConfig, pool: ModelPool, cache: PrepareCache,
                engines: dict[tuple, Engine]) -> Stage:
    """`engines` (the factory's): one engine per model, device and config, shared by every stage built with them,
    whichever pipeline and image policy: text and image requests of wan_t2v, wan_i2v and the qwen_to_wan pipelines
    share its batches."""
    if config.model:
        layout, label, default_preset = read_layout(config.model), config.model, "quality"
    else:
        layout, label, default_preset = read_layout(ensure_demo_model()), "demo (random weights)", "smoke"
    default_preset = node.policy.get("preset", default_preset)
    image = node.policy.get("image", "required")
    if image not in IMAGE_POLICIES:
        raise GraphError("node policy", [node.id], f"node {node.id!r}: image policy {image!r} is not one of "
                                                   f"{', '.join(IMAGE_POLICIES)}")
    if image != "required" and not layout.text_to_video:
        raise ModelError(f"{layout.path} has no text-to-video path: its transformer takes {layout.in_channels} input "
                         f"channels, the VAE's latents {layout.z_dim} (an image-to-video model); use wan_i2v")
    placement = place(config)
    if config.wan_cfg_parallel > 1 or config.wan_ulysses > 1:
        check_parallel(node, config, layout, placement, default_preset)
    budget, why = token_budget(config, placement, layout)
    key = (layout.path, placement, config)
    engine = engines.get(key)
    if engine is None or engine.dead is not None:  # a dead engine takes nothing more: a new one
        loaded = pool.acquire(layout.path, placement)
        runner = WanRunner(node.id, layout, placement, loaded, cache, video_preset=config.wan_video_preset)
        if config.wan_cfg_parallel > 1 or config.wan_ulysses > 1:
            runner.group = start_group(node, config, layout, placement, loaded.model)
        scheduler = DiffusionScheduler(
            max_batch=config.wan_max_batch, num_steps=lambda item: item.processed.settings.steps,
            batch_key=lambda item: batch_key(item.processed.settings, placement.dtype),
            cost=lambda item: latent_tokens(item.processed.settings, layout), max_cost=budget,
            phase_order=("export", "decode", "prepare", "denoise"))
        engine = engines[key] = Engine(scheduler, runner)
    model_trace = {"diffusion.model": label, "diffusion.fps": layout.fps, **placement.trace()}
    summary = (f"{node.id}: batching up to {config.wan_max_batch} requests and {budget} latent tokens per denoise "
               f"step ({why})")
    processor = WanInputProcessor(layout, default_preset, image, config.wan_cfg_parallel)
    return Stage(node, "diffusion", processor, EngineView(engine), WanOutputProcessor(node.id, model_trace), summary)


def check_parallel(node: NodeSpec, config: WanConfig, layout: ModelLayout, placement: WanDevice,
                   default_preset: str) -> None:
    """The parallel degrees against the model and the devices (parallel.check_degrees), before any rank starts:
    the transformer stays on its devices, and one process is rank 0 of one group at most (torch.distributed's
    default group is the process's)."""
    from .parallel import check_degrees
    from .rank_launch import in_ray_actor

    preset = PRESETS.get(default_preset)  # an unknown one is the request's error, naming the field
    check_degrees(config.wan_cfg_parallel, config.wan_ulysses, layout.num_heads, placement.device,
                  preset.guidance_scale if preset else float("inf"), count_devices=not in_ray_actor())
    if placement.offloaded:
        raise UserError(f"node {node.id!r}: wan_cfg_parallel / wan_ulysses keep the transformer on each rank's GPU: "
                        "add -c disable_cpu_offload=true")


def start_group(node: NodeSpec, config: WanConfig, layout: ModelLayout, placement: WanDevice, model):
    """The other ranks of a parallel stage's new engine, started, with this process as rank 0 (ranks.py)."""
    import torch.distributed as dist

    from .ranks import RankGroup

    if dist.is_initialized():
        raise UserError(f"node {node.id!r}: this process is rank 0 of another parallel stage already; run this one "
                        "in a worker of its own (--placement process)")

    group = RankGroup(node.id, model, layout.path, placement, config.wan_cfg_parallel, config.wan_ulysses,
                      node.resources)
    group.start()
    return group


def batch_key(s: Settings, dtype: str) -> tuple:
    """Requests that can share a denoise forward: same latent shape, CFG on or off, same dtype."""
    return s.height, s.width, s.num_frames, s.guidance_scale > 1, dtype


def latent_tokens(s: Settings, layout: ModelLayout) -> int:
    """A request's rows in a denoise forward: its transformer sequence length, twice with CFG."""
    frames = (s.num_frames - 1) // layout.temporal_factor + 1
    tokens = frames * (s.height // layout.spatial_multiple) * (s.width // layout.spatial_multiple)
    return tokens * (2 if s.guidance_scale > 1 else 1)


def token_budget(config: WanConfig, placement: WanDevice, layout: ModelLayout) -> tuple[int, str]:
    """`wan_max_batch_tokens`, or a default: on a GPU, half its memory beyond 24 GiB (the weights, the VAE
    decode) at a rough 4 bytes x (ffn_dim + 8 x hidden) of activations per token (bf16, with headroom)."""
    if config.wan_max_batch_tokens is not None:
        return config.wan_max_batch_tokens, "wan_max_batch_tokens"
    if placement.device != "cuda":
        return CPU_TOKEN_BUDGET, "default for cpu"
    import torch

    t = json.loads((layout.path / "transformer" / "config.json").read_text(encoding="utf-8"))
    hidden = t.get("num_attention_heads", 24) * t.get("attention_head_dim", 128)
    per_token = 4 * (t.get("ffn_dim", 14336) + 8 * hidden)
    spare = torch.cuda.get_device_properties(0).total_memory - 24 * 2**30
    return max(1, spare // 2 // per_token), "default for cuda: half the memory beyond 24 GiB"
