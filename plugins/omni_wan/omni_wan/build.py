"""The `diffusion.wan22_i2v` node type's parts (the kernel's NodeType form): the engine settings, checked without
loading anything; the engine, Engine(PhaseScheduler, WanRunner), with its model loaded (once per process and
plugin host: the plugin's model pool); and the node's Stage(WanInputProcessor, engine, WanOutputProcessor).

The kernel keeps one engine per equal settings, so every Wan node of one model, device and config shares one
engine and its batches, whichever pipeline and image policy: text and image requests of wan_t2v, wan_i2v and the
qwen_to_wan pipelines share its forwards. One engine step is one phase (runner.PHASES: prepare, one denoise step,
decode, export). Finishing and newly arrived requests go first (runner.PHASE_ORDER), then every denoising request
of one batch key (size, frames, CFG on/off, dtype) shares one denoise forward, each at its own step, up to
`wan_max_batch` requests and `wan_max_batch_tokens` latent tokens. Text-to-video and image-to-video requests
share a key: a text row is all noise under a mask of ones, the same shapes as an image row (whose mask is 0 on
the first latent frame).

The node policy (params.WanPolicy: `image`, `preset`) is validated by the kernel when the plan is built; an image
policy other than `required` on a checkpoint without a text-to-video path, and parallel degrees the model or the
devices cannot take, are refused by `engine_settings`, before any model loads or rank starts.
"""

from __future__ import annotations

import json

import attrs
import omni_hf

from omni_kernel.core.engine import Engine
from omni_kernel.core.errors import ModelError, UserError
from omni_kernel.core.graph import NodeSpec
from omni_kernel.core.ranks import RankLauncher
from omni_kernel.core.request import StageInput
from omni_kernel.core.scheduler import PhaseScheduler
from omni_kernel.core.stage import Stage

from .demo import ensure_demo_model
from .device import WanDevice, place
from .inputs import WanInputProcessor
from .layout import ModelLayout, read_layout
from .loader import model_key
from .outputs import WanOutputProcessor
from .params import WanConfig, WanPolicy
from .prepare_cache import PrepareCache
from .presets import PRESETS, Settings

CPU_TOKEN_BUDGET = 16384  # on a CPU a forward is compute-bound long before memory matters
DEMO_LABEL = "demo (random weights)"


@attrs.frozen
class WanEngineSettings:
    """Everything a Wan engine depends on, resolved without loading a model: the kernel's share key."""

    layout: ModelLayout
    device: WanDevice
    config: WanConfig
    resources: tuple[tuple[str, float], ...] | None = None  # the rank group's Ray resources (parallel only)
    # The first node built on the engine names it in logs and errors; the nodes that share it may have other ids.
    node_id: str = attrs.field(default="wan", eq=False)
    # Where its other ranks start: the placement's launcher (NodeSpec.ranks), else processes of this machine.
    ranks: RankLauncher | None = attrs.field(default=None, eq=False)


def is_parallel(config: WanConfig) -> bool:
    """Whether the engine's forwards run over a group of ranks (ranks.py)."""
    return config.wan_cfg_parallel > 1 or config.wan_ulysses > 1


def engine_settings(node: NodeSpec, config: WanConfig, policy: WanPolicy) -> WanEngineSettings:
    """The node's engine settings; the settings invalid for the checkpoint are refused here (ModelError,
    UserError, InvalidParameter), before anything loads."""
    layout = read_layout(config.model or ensure_demo_model())
    if policy.image != "required" and not layout.text_to_video:
        raise ModelError(f"{layout.path} has no text-to-video path: its transformer takes {layout.in_channels} input "
                         f"channels, the VAE's latents {layout.z_dim} (an image-to-video model); use wan_i2v")
    device = place(config)
    resources = None
    if is_parallel(config):
        check_parallel(node, config, layout, device, default_preset(config, policy))
        resources = tuple(sorted(node.resources.items())) if node.resources else None
    return WanEngineSettings(layout, device, config, resources, node.id, ranks=node.ranks)


def default_preset(config: WanConfig, policy: WanPolicy) -> str:
    """The preset of a request that names none: the policy's, else quality (smoke with the demo model)."""
    if policy.preset is not None:
        return policy.preset
    return "quality" if config.model else "smoke"


def build_engine(settings: WanEngineSettings, pool: omni_hf.ModelPool, cache: PrepareCache) -> Engine:
    """The engine of `settings`: its model acquired from `pool` (loaded on first use), and with wan_cfg_parallel
    or wan_ulysses its other ranks started."""
    from .runner import PHASE_ORDER, WanRunner, phases  # torch: the settings and the stage above are built without

    layout, device, config = settings.layout, settings.device, settings.config
    loaded = pool.acquire(model_key(layout.path, device))
    runner = WanRunner(settings.node_id, layout, device, loaded, cache, video_preset=config.wan_video_preset)
    if is_parallel(config):
        runner.group = start_group(settings, loaded.model)
    budget, _ = token_budget(config, device, layout)
    scheduler = PhaseScheduler(
        max_batch=config.wan_max_batch, phases=phases, phase_order=PHASE_ORDER,
        batch_key=lambda item: batch_key(item.processed.settings, device.dtype),
        cost=lambda item: latent_tokens(item.processed.settings, layout), max_cost=budget, model_stats=runner.stats)
    return Engine(scheduler, runner)


def build_stage(node: NodeSpec, config: WanConfig, policy: WanPolicy, settings: WanEngineSettings,
                engine: Engine) -> Stage:
    """The node's stage over `engine` (which other Wan nodes of the same settings may share); `settings` are the
    node's engine settings, as the kernel computed them."""
    layout, device = settings.layout, settings.device
    budget, why = token_budget(config, device, layout)
    label = config.model or DEMO_LABEL
    model_trace = {"diffusion.model": label, "diffusion.fps": layout.fps, **device.trace()}
    summary = (f"{node.id}: batching up to {config.wan_max_batch} requests and {budget} latent tokens per denoise "
               f"step ({why})")
    return Stage(node, "diffusion", input_processor(settings, policy), engine,
                 WanOutputProcessor(node.id, model_trace), summary)


def check_request(node: NodeSpec, config: WanConfig, policy: WanPolicy, settings: WanEngineSettings,
                  item: StageInput) -> None:
    """A request's inputs and parameters against the node (the input processor's check), before any model loads:
    the prompt, the output path, the image against the image policy, the settings against the checkpoint."""
    input_processor(settings, policy).check(item)


def input_processor(settings: WanEngineSettings, policy: WanPolicy) -> WanInputProcessor:
    return WanInputProcessor(settings.layout, default_preset(settings.config, policy), policy.image,
                             settings.config.wan_cfg_parallel)


def check_parallel(node: NodeSpec, config: WanConfig, layout: ModelLayout, device: WanDevice, preset: str) -> None:
    """The parallel degrees against the model and the devices (parallel.check_degrees), before any rank starts:
    the transformer stays on its devices, and one process is rank 0 of one group at most (torch.distributed's
    default group is the process's)."""
    from .parallel import check_degrees
    check_degrees(config.wan_cfg_parallel, config.wan_ulysses, layout.num_heads, device.device,
                  PRESETS[preset].guidance_scale, count_devices=node.ranks is None)
    if device.offloaded:
        raise UserError(f"node {node.id!r}: wan_cfg_parallel / wan_ulysses keep the transformer on each rank's GPU: "
                        "add -c disable_cpu_offload=true")


def start_group(settings: WanEngineSettings, model):
    """The other ranks of a parallel engine, started, with this process as rank 0 (ranks.py)."""
    import torch.distributed as dist

    from .ranks import RankGroup

    if dist.is_initialized():
        raise UserError(f"node {settings.node_id!r}: this process is rank 0 of another parallel stage already; run "
                        "this one in a worker of its own (--placement process)")
    config = settings.config
    resources = dict(settings.resources) if settings.resources else None
    group = RankGroup(settings.node_id, model, settings.layout.path, settings.device, config.wan_cfg_parallel,
                      config.wan_ulysses, resources, config.wan_rank_restart_wait, settings.ranks)
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


def token_budget(config: WanConfig, device: WanDevice, layout: ModelLayout) -> tuple[int, str]:
    """`wan_max_batch_tokens`, or a default: on a GPU, half its memory beyond 24 GiB (the weights, the VAE
    decode) at a rough 4 bytes x (ffn_dim + 8 x hidden) of activations per token (bf16, with headroom)."""
    if config.wan_max_batch_tokens is not None:
        return config.wan_max_batch_tokens, "wan_max_batch_tokens"
    if device.device != "cuda":
        return CPU_TOKEN_BUDGET, "default for cpu"
    import torch

    t = json.loads((layout.path / "transformer" / "config.json").read_text(encoding="utf-8"))
    hidden = t.get("num_attention_heads", 24) * t.get("attention_head_dim", 128)
    per_token = 4 * (t.get("ffn_dim", 14336) + 8 * hidden)
    spare = torch.cuda.get_device_properties(0).total_memory - 24 * 2**30
    return max(1, spare // 2 // per_token), "default for cuda: half the memory beyond 24 GiB"
