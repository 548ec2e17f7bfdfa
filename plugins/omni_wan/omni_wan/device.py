"""Where the model runs, whether it is offloaded, and the VAE dtype: decided once per stage from the config.

The Wan VAE is the stage most sensitive to precision (colour drift, banding), and the model card loads it in
fp32 while the transformer runs in bf16. So the VAE's default is fp32 wherever memory allows it:
- CPU: fp32 (bf16/fp16 3D convolutions on a CPU are slower, not faster, and lose precision);
- a GPU with 40 GiB or more: fp32;
- a smaller GPU: bf16, which halves the VAE's weights and decode activations (121 frames of 1280x704).
"""

from __future__ import annotations

from typing import Literal

import attrs
from omni_hf import resolve_device

from .params import WanConfig

Device = Literal["cuda", "cpu"]
Offload = Literal["model_cpu_offload", "off", "not applicable (CPU)"]
_BIG_GPU_BYTES = 40 * 2**30


@attrs.frozen
class WanDevice:
    """Where and how a Wan model runs: its device, dtypes and offload (the kernel's placement is another thing:
    which process a stage runs in)."""

    device: Device
    dtype: str  # transformer and text encoder
    vae_dtype: str
    vae_dtype_reason: str
    offload: Offload

    @property
    def offloaded(self) -> bool:
        return self.offload == "model_cpu_offload"

    def trace(self) -> dict:
        return {"diffusion.device": self.device, "diffusion.dtype": self.dtype, "diffusion.vae_dtype": self.vae_dtype,
                "diffusion.vae_dtype_reason": self.vae_dtype_reason, "diffusion.offload": self.offload}


def place(config: WanConfig) -> WanDevice:
    """CPU offload is on by default with a GPU (a 5B transformer plus a umt5-xxl encoder fill 24 GB cards);
    `disable_cpu_offload` keeps everything on the GPU. On the CPU offload does not apply."""
    if resolve_device(config.device) == "cuda":
        import torch

        memory = torch.cuda.get_device_properties(0).total_memory
        vae_dtype, why = resolve_vae_dtype(config.vae_dtype, "cuda", memory)
        return WanDevice("cuda", "bf16", vae_dtype, why, "off" if config.disable_cpu_offload else "model_cpu_offload")
    vae_dtype, why = resolve_vae_dtype(config.vae_dtype, "cpu")
    return WanDevice("cpu", "fp32", vae_dtype, why, "not applicable (CPU)")


def resolve_vae_dtype(requested: str | None, device: Device, gpu_memory_bytes: int = 0) -> tuple[str, str]:
    """Return (dtype name, why) for the trace."""
    if requested is not None:
        return requested, "requested"
    if device == "cpu":
        return "fp32", "default for cpu"
    return ("fp32" if gpu_memory_bytes >= _BIG_GPU_BYTES else "bf16"), "default for cuda"
