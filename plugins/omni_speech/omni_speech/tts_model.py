"""VITS inference over a batch of sentences, from a transformers `VitsModel`'s parts, with each row's own noise.

`VitsModel.forward` draws the duration and prior noise from torch's global generator for the whole batch, and its
HiFi-GAN decoder sees no mask: a row's audio then depends on the other rows (their noise, and the padded tail its
convolutions read). `synthesize` runs the same parts (text encoder, stochastic duration predictor reversed with
`noise_w`, length regulation with `length_scale`, flow reversed with `noise_scale`, decoder) with:
- each row's noise drawn from its own `torch.Generator` (on the CPU, so a seed gives the same audio on any device),
  duration noise first, then prior noise, each of the row's own length;
- the decoder run with every row's tail zeroed before each convolution, as a row alone sees zero padding there;
- each row trimmed to its own length.
So a row's audio does not depend on what it is batched with, and with noise 0 it is VitsModel's own forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from torch import nn


@attrs.frozen
class Row:
    """One sentence to synthesize: its phoneme ids, its scales and the seed of its noise."""

    ids: tuple[int, ...] = attrs.field(converter=tuple)
    noise_scale: float
    noise_w: float
    length_scale: float
    seed: int


def _generator(seed: int) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


def _noise(generators: Sequence[torch.Generator], channels: int, lengths: Sequence[int], scales: Sequence[float],
           like: torch.Tensor) -> torch.Tensor:
    """(batch, channels, max length) standard normal noise, row i's from its own generator over its own length
    (zeros past it), times its scale."""
    noise = torch.zeros(len(generators), channels, max(lengths))
    for i, (generator, length, scale) in enumerate(zip(generators, lengths, scales)):
        noise[i, :, :length] = torch.randn(channels, length, generator=generator) * scale
    return noise.to(device=like.device, dtype=like.dtype)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).view(-1, 1, 1)


@torch.inference_mode()
def synthesize(model, rows: Sequence[Row], batch_decoder: bool = True) -> list[torch.Tensor]:
    """Each row's waveform (float, in [-1, 1], on the CPU), in one forward over the batch; with `batch_decoder`
    False the decoder runs row by row (each on its own frames), the rest still over the batch."""
    device = model.device
    lengths = [len(r.ids) for r in rows]
    input_ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, :lengths[i]] = torch.tensor(row.ids)
    attention_mask = (torch.arange(max(lengths)).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    generators = [_generator(r.seed) for r in rows]

    dtype = model.text_encoder.embed_tokens.weight.dtype
    padding_mask = attention_mask.unsqueeze(-1).to(dtype)
    encoded = model.text_encoder(input_ids=input_ids, padding_mask=padding_mask, attention_mask=attention_mask)
    hidden = encoded.last_hidden_state.transpose(1, 2)
    input_mask = padding_mask.transpose(1, 2)  # (batch, 1, ids)

    log_duration = _log_duration(model, hidden, input_mask, generators, lengths, [r.noise_w for r in rows])
    duration = torch.ceil(torch.exp(log_duration) * input_mask * _column([r.length_scale for r in rows], hidden))
    frames = torch.clamp_min(torch.sum(duration, [1, 2]), 1).long()
    output_mask = (torch.arange(int(frames.max()), device=device).unsqueeze(0) < frames.unsqueeze(1))
    output_mask = output_mask.unsqueeze(1).to(dtype)  # (batch, 1, frames)
    alignment = _alignment(duration, input_mask, output_mask)

    means = torch.matmul(alignment, encoded.prior_means).transpose(1, 2)
    log_variances = torch.matmul(alignment, encoded.prior_log_variances).transpose(1, 2)
    noise = _noise(generators, means.shape[1], frames.tolist(), [r.noise_scale for r in rows], means)
    latents = model.flow(means + noise * torch.exp(log_variances), output_mask, None, reverse=True)
    spectrogram = latents * output_mask
    hop = int(torch.tensor(model.config.upsample_rates).prod())
    lengths = frames.tolist()
    if not batch_decoder:
        return [masked_decoder(model.decoder, spectrogram[i:i + 1, :, :n], [n])[0, 0].float().cpu()
                for i, n in enumerate(lengths)]
    waveform = masked_decoder(model.decoder, spectrogram, lengths)
    return [waveform[i, 0, :n * hop].float().cpu() for i, n in enumerate(lengths)]


def _log_duration(model, hidden: torch.Tensor, mask: torch.Tensor, generators, lengths, noise_w) -> torch.Tensor:
    """The duration predictor reversed, as VitsModel runs it, with each row's own noise."""
    predictor = model.duration_predictor
    if not model.config.use_stochastic_duration_prediction:
        return predictor(hidden, mask, None)
    inputs = predictor.conv_pre(hidden)
    inputs = predictor.conv_dds(inputs, mask)
    inputs = predictor.conv_proj(inputs) * mask
    flows = list(reversed(predictor.flows))
    flows = flows[:-2] + [flows[-1]]  # as VitsModel: the flow before the last is not used in reverse
    latents = _noise(generators, 2, lengths, noise_w, inputs)
    for flow in flows:
        latents = torch.flip(latents, [1])
        latents, _ = flow(latents, mask, global_conditioning=inputs, reverse=True)
    return latents[:, :1]


def _alignment(duration: torch.Tensor, input_mask: torch.Tensor, output_mask: torch.Tensor) -> torch.Tensor:
    """(batch, frames, ids): frame t reads id j when j's durations so far cover t (VitsModel's length regulation)."""
    batch, _, num_ids = duration.shape
    num_frames = output_mask.shape[2]
    ends = torch.cumsum(duration, -1).view(batch * num_ids, 1)
    covered = (torch.arange(num_frames, dtype=duration.dtype, device=duration.device).unsqueeze(0) < ends)
    covered = covered.to(output_mask.dtype).view(batch, num_ids, num_frames)
    starts = covered - nn.functional.pad(covered, [0, 0, 1, 0, 0, 0])[:, :-1]
    mask = input_mask.unsqueeze(2) * output_mask.unsqueeze(-1)  # (batch, 1, frames, ids)
    return (starts.unsqueeze(1).transpose(2, 3) * mask).squeeze(1)


def masked_decoder(decoder, spectrogram: torch.Tensor, frames: Sequence[int]) -> torch.Tensor:
    """VitsHifiGan's forward with every row's tail zeroed before each convolution (row i is `frames[i]` frames long;
    each upsampler stretches that). A row's samples then equal its own run alone; rows of the longest length need
    nothing zeroed, so a batch of one is VitsHifiGan's forward exactly."""
    slope = decoder.config.leaky_relu_slope
    tails = _Tails(list(frames))
    hidden = decoder.conv_pre(spectrogram)
    kernels = decoder.num_kernels
    for i, upsampler in enumerate(decoder.upsampler):
        hidden = upsampler(nn.functional.leaky_relu(tails.zero(hidden), slope))
        tails.stretch(upsampler.stride[0])
        blocks = decoder.resblocks[i * kernels:(i + 1) * kernels]
        total = _residual_block(blocks[0], hidden, tails)
        for block in blocks[1:]:
            total = total + _residual_block(block, hidden, tails)
        hidden = total / kernels
    hidden = decoder.conv_post(nn.functional.leaky_relu(tails.zero(hidden)))
    return torch.tanh(hidden)


class _Tails:
    """Each row's length at the decoder's current resolution, and the zeroing of what lies past it (in place: the
    tail is never read as audio)."""

    def __init__(self, lengths: list[int]):
        self.lengths = lengths

    def stretch(self, factor: int) -> None:
        self.lengths = [n * factor for n in self.lengths]

    def zero(self, hidden: torch.Tensor) -> torch.Tensor:
        for row, length in enumerate(self.lengths):
            if length < hidden.shape[2]:
                hidden[row, :, length:] = 0
        return hidden


def _residual_block(block, hidden: torch.Tensor, tails: _Tails) -> torch.Tensor:
    """One HiFi-GAN residual block (type 1: `convs1`/`convs2`; type 2: `convs`), its convolutions reading inputs
    with zero tails."""
    slope = block.leaky_relu_slope
    if hasattr(block, "convs1"):
        for conv1, conv2 in zip(block.convs1, block.convs2):
            out = conv1(nn.functional.leaky_relu(tails.zero(hidden), slope))
            out = conv2(nn.functional.leaky_relu(tails.zero(out), slope))
            hidden = hidden + out
        return hidden
    for conv in block.convs:
        hidden = hidden + conv(nn.functional.leaky_relu(tails.zero(hidden), slope))
    return hidden
