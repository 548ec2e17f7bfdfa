"""Two fast paths for the Wan VAE on a CPU, each the same arithmetic as the call it replaces.

- 3D convolutions of one video through oneDNN (mkldnn). PyTorch's CPU convolution picks its unvectorized
  `slow_conv3d` for a batch of one with a small input (its heuristic: one sample, kernels of 3 or less,
  N*C*D*H <= 20480), which is what the VAE's causal convolutions see for every frame chunk of one video.
  Measured here (one thread, 128x128x17): a decode took 700 ms that way and 336 ms through oneDNN, which is also
  what each video costs at batch 2 and 4. So batch-one calls with a spatial kernel go to `mkldnn_convolution`;
  every other call keeps PyTorch's own choice.
- The VAE's RMS norm (`F.normalize` over the channel dimension) as x * rsqrt(sum of squares): the strided
  `linalg_vector_norm` was 18% of a CPU decode and is 3-8x slower than the sum it amounts to.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def speed_up_cpu_vae(vae: torch.nn.Module) -> dict[str, int]:
    """Patch the VAE's Conv3d (zeros padding; needs oneDNN) and RMS norm modules; returns how many of each."""
    counts = {"conv3d": 0, "rms_norm": 0}
    for module in vae.modules():
        if (isinstance(module, torch.nn.Conv3d) and module.padding_mode == "zeros"
                and not isinstance(module.padding, str) and torch.backends.mkldnn.is_available()):
            module._conv_forward = types.MethodType(_conv_forward, module)
            counts["conv3d"] += 1
        elif type(module).__name__ == "WanRMS_norm":
            module.forward = types.MethodType(_rms_norm_forward, module)
            counts["rms_norm"] += 1
    return counts


def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.shape[0] != 1
            or weight.shape[-1] == weight.shape[-2] == 1 or torch.is_grad_enabled()):  # PyTorch's own choice is right
        return F.conv3d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)
    return torch.ops.aten.mkldnn_convolution(x.contiguous(), weight.contiguous(), bias, self.padding, self.stride,
                                             self.dilation, self.groups)


def _rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return type(self).forward(self, x)
    # F.normalize divides by max(norm, 1e-12): the same as multiplying by rsqrt(max(sum of squares, 1e-24)).
    squares = (x * x).sum(dim=1 if self.channel_first else -1, keepdim=True)
    return x * torch.rsqrt(squares.clamp_min(1e-24)) * self.scale * self.gamma + self.bias
