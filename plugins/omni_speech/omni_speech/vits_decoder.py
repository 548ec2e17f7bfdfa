"""Loading a VitsModel directory, with the HiFi-GAN block that transformers' VitsModel lacks.

HiFi-GAN has two residual block types; `VitsHifiGan` builds type 1 only. Piper's "medium" voices use type 2
(`x = x + conv(leaky_relu(x))` per dilation, one convolution each). A directory whose config.json says
`"resblock": "2"` (piper_onnx writes it) gets its decoder's blocks replaced by `ResidualBlock2` before the weights
load, so the model stays a plain `VitsModel` everywhere else, and transformers' files are untouched.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from omni_kernel.core.errors import ModelError

# Parts of VitsModel that only training uses; a converted voice does not ship them (Piper's export dropped them).
TRAINING_ONLY = re.compile(r"^(posterior_encoder\.|duration_predictor\.post_|duration_predictor\.flows\.1\.)")


class ResidualBlock2(nn.Module):
    """HiFi-GAN's residual block type 2 (as VITS and Piper define it)."""

    def __init__(self, channels: int, kernel_size: int, dilations: list[int], leaky_relu_slope: float = 0.1):
        super().__init__()
        self.leaky_relu_slope = leaky_relu_slope
        self.convs = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=(kernel_size * d - d) // 2)
            for d in dilations)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            hidden_states = hidden_states + conv(nn.functional.leaky_relu(hidden_states, self.leaky_relu_slope))
        return hidden_states


def use_residual_block2(model) -> None:
    """Replace every decoder block of `model` (a VitsModel) by a type-2 block of the same sizes."""
    config = model.config
    decoder = model.decoder
    blocks = []
    for i in range(len(config.upsample_rates)):
        channels = config.upsample_initial_channel // (2 ** (i + 1))
        for kernel_size, dilations in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes):
            blocks.append(ResidualBlock2(channels, kernel_size, list(dilations), config.leaky_relu_slope))
    decoder.resblocks = nn.ModuleList(blocks)


def _remove_flow_weight_norm(model) -> None:
    """The converted weights have weight norm folded in (as Piper's export has): plain `.weight` tensors."""
    from torch.nn.utils import parametrize

    for flow in model.flow.flows:
        for layer in [*flow.wavenet.in_layers, *flow.wavenet.res_skip_layers]:
            if parametrize.is_parametrized(layer, "weight"):
                parametrize.remove_parametrizations(layer, "weight")


def load_voice(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The VitsModel in directory `path`, in eval mode on `device`. A directory of omni's conversion (config.json's
    `resblock` "2") is built here with type-2 blocks and its weights loaded strictly (every tensor of the file used,
    every inference weight given; the training-only parts are left unset); any other VitsModel directory loads
    through `from_pretrained`."""
    from safetensors.torch import load_file
    from transformers import VitsConfig, VitsModel
    from transformers.initialization import no_init_weights

    path = Path(path)
    config = VitsConfig.from_pretrained(path)
    if str(getattr(config, "resblock", "1")) != "2":
        return VitsModel.from_pretrained(path, dtype=dtype).to(device).eval()
    with no_init_weights():  # every inference weight comes from the file (checked below): 0.7 s instead of 2.6
        model = VitsModel(config)
    use_residual_block2(model)
    _remove_flow_weight_norm(model)
    state = load_file(str(path / "model.safetensors"))
    result = model.load_state_dict(state, strict=False)
    missing = [key for key in result.missing_keys if not TRAINING_ONLY.match(key)]
    if missing or result.unexpected_keys:
        raise ModelError(f"{path}: the weights do not fit the config: missing {missing[:3]}, unexpected "
                         f"{result.unexpected_keys[:3]}")
    return model.to(device=device, dtype=dtype).eval()
