"""Where the model runs and whether it is offloaded: decided once per stage from the config."""

from __future__ import annotations

import attrs

from .vae import resolve_vae_dtype


@attrs.frozen
class Placement:
    device: str  # "cuda" or "cpu"
    dtype: str  # transformer and text encoder
    vae_dtype: str
    vae_dtype_reason: str
    offload: str  # "model_cpu_offload" | "off" | "not applicable (no GPU)"

    @property
    def offloaded(self) -> bool:
        return self.offload == "model_cpu_offload"

    def trace(self) -> dict:
        return {"diffusion.device": self.device, "diffusion.dtype": self.dtype, "diffusion.vae_dtype": self.vae_dtype,
                "diffusion.vae_dtype_reason": self.vae_dtype_reason, "diffusion.offload": self.offload}


def place(config) -> Placement:
    """CPU offload is on by default with a GPU (a 5B transformer plus a umt5-xxl encoder fill 24 GB cards);
    `disable_cpu_offload` keeps everything on the GPU. On a CPU-only machine offload does not apply."""
    import torch

    if torch.cuda.is_available():
        memory = torch.cuda.get_device_properties(0).total_memory
        vae_dtype, why = resolve_vae_dtype(config.get("vae_dtype"), "cuda", memory)
        offload = "off" if config.get("disable_cpu_offload") else "model_cpu_offload"
        return Placement("cuda", "bf16", vae_dtype, why, offload)
    vae_dtype, why = resolve_vae_dtype(config.get("vae_dtype"), "cpu")
    return Placement("cpu", "fp32", vae_dtype, why, "not applicable (no GPU)")
