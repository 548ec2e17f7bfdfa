"""The VAE's 3D convolutions of one video on a CPU through oneDNN (mkldnn), as a batch of two would be.

PyTorch's CPU convolution picks its unvectorized `slow_conv3d` for a batch of one with a small input (its
heuristic: one sample, kernels of 3 or less, N*C*D*H <= 20480), which is what the Wan VAE's causal convolutions
see for every frame chunk of one video. Measured here (one thread, 128x128x17): the decode of one video takes
700 ms that way and 336 ms through oneDNN, which is also what each video costs at batch 2 and 4. So batch-one
calls with a spatial kernel go to `mkldnn_convolution`; every other call keeps PyTorch's own choice.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def use_mkldnn_conv3d(module: torch.nn.Module) -> int:
    """Patch every Conv3d under `module` (zeros padding); returns how many. A no-op without oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return 0
    count = 0
    for conv in module.modules():
        if isinstance(conv, torch.nn.Conv3d) and conv.padding_mode == "zeros" and not isinstance(conv.padding, str):
            conv._conv_forward = types.MethodType(_conv_forward, conv)
            count += 1
    return count


def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.shape[0] != 1
            or weight.shape[-1] == weight.shape[-2] == 1 or torch.is_grad_enabled()):  # PyTorch's own choice is right
        return F.conv3d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)
    return torch.ops.aten.mkldnn_convolution(x.contiguous(), weight.contiguous(), bias, self.padding, self.stride,
                                             self.dilation, self.groups)
