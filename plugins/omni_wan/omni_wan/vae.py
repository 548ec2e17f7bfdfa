"""VAE dtype policy: `vae_dtype` fp32 | bf16 | fp16, with a default chosen per device.

The Wan VAE is the stage most sensitive to precision (colour drift, banding), and the model card loads it in
fp32 while the transformer runs in bf16. So the default is fp32 wherever memory allows it:
- CPU: fp32 (bf16/fp16 3D convolutions on a CPU are slower, not faster, and lose precision);
- a GPU with 40 GiB or more: fp32;
- a smaller GPU: bf16, which halves the VAE's weights and decode activations (121 frames of 1280x704).
"""

from __future__ import annotations

from omni_kernel.errors import InvalidParameter

VAE_DTYPES = ("fp32", "bf16", "fp16")
_BIG_GPU_BYTES = 40 * 2**30


def default_vae_dtype(device: str, gpu_memory_bytes: int = 0) -> str:
    if device == "cpu":
        return "fp32"
    return "fp32" if gpu_memory_bytes >= _BIG_GPU_BYTES else "bf16"


def resolve_vae_dtype(requested: str | None, device: str, gpu_memory_bytes: int = 0) -> tuple[str, str]:
    """Return (dtype name, why) for the trace."""
    if requested is None:
        return default_vae_dtype(device, gpu_memory_bytes), f"default for {device}"
    if requested not in VAE_DTYPES:
        raise InvalidParameter("vae_dtype", f"{requested!r} is not one of {', '.join(VAE_DTYPES)}")
    return requested, "requested"


def torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
