"""The Wan node's compute shortcuts against the computation they replace, on the tiny checkpoint's real modules:
cross-attention keys and values projected once per text, and the VAE's batch-one convolutions through oneDNN."""

from __future__ import annotations

import pytest
import torch

from omni_wan.cpu_vae import speed_up_cpu_vae
from omni_wan.crossattn import CrossKV, num_pad
from omni_wan.model import Text
from omni_wan.prepare_cache import PrepareCache


@pytest.fixture(scope="module")
def parts(tiny_model):
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    transformer = WanTransformer3DModel.from_pretrained(str(tiny_model), subfolder="transformer").eval()
    vae = AutoencoderKLWan.from_pretrained(str(tiny_model), subfolder="vae").eval()
    return transformer, vae


def _forward(transformer, latents, timesteps, text):
    with torch.no_grad():
        return transformer(hidden_states=latents, timestep=timesteps, encoder_hidden_states=text,
                           return_dict=False)[0]


def test_projected_text_rows_give_the_forward_of_the_embeddings(parts):
    """Texts padded with zero rows as the pipeline pads them (20 and 7 real tokens) and one without padding: the
    cached keys and values of the real tokens plus one padding token with its multiplicity give the forward of the
    full 512-token embeddings."""
    transformer, _ = parts
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(3, 48, 3, 4, 6, generator=generator)
    timesteps = torch.tensor([999.0, 500.0, 20.0]).repeat_interleave(3 * 2 * 3).view(3, -1)
    texts = torch.randn(3, 512, transformer.config.text_dim, generator=generator)
    texts[0, 20:] = 0
    texts[1, 7:] = 0
    expected = _forward(transformer, latents, timesteps, texts)

    cross = CrossKV(transformer)
    try:
        rows = cross.project(texts)  # one call, one TextKV per row
        placeholder = cross.placeholder(3, torch.float32, "cpu")
        with cross.use(rows):
            got = _forward(transformer, latents, timesteps, placeholder)
        with cross.use(rows[::-1]):  # other rows: joined anew, not the last batch's keys
            flipped = _forward(transformer, latents.flip(0), timesteps.flip(0), placeholder)
        with cross.use(rows[:2]):  # padded texts only: a shorter one's empty slots get no weight
            padded = _forward(transformer, latents[:2], timesteps[:2], placeholder[:2])
        outside = _forward(transformer, latents, timesteps, texts)  # outside `use`: diffusers' own processor
    finally:
        for block in transformer.blocks:
            block.attn2.set_processor(block.attn2.processor.fallback)
    assert [(r.num_tokens, r.num_pad) for r in rows] == [(21, 492), (8, 505), (512, 0)]
    assert float((got - expected).abs().max()) <= 1e-5
    assert float((flipped - expected.flip(0)).abs().max()) <= 1e-5
    assert float((padded - expected[:2]).abs().max()) <= 1e-5
    assert torch.equal(outside, expected)
    per_token = 2 * len(transformer.blocks) * transformer.config.num_attention_heads \
        * transformer.config.attention_head_dim * 4
    assert rows[1].nbytes == 8 * per_token


def test_num_pad_counts_the_zero_rows_at_the_end_only():
    text = torch.ones(10, 4)
    assert num_pad(text) == 0
    text[6:] = 0
    text[2] = 0  # a zero row inside the text is a token, not padding
    assert num_pad(text) == 4
    assert num_pad(torch.zeros(5, 4)) == 5


def test_the_cpu_vae_fast_paths_decode_and_encode_the_same_video(parts):
    """oneDNN for batch-one convolutions and the RMS norm as a sum of squares, against the stock modules."""
    _, vae = parts
    latents = torch.randn(1, 48, 3, 4, 6, generator=torch.Generator().manual_seed(1))
    video = torch.rand(1, 3, 1, 64, 96, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        expected = vae.decode(latents, return_dict=False)[0], vae.encode(video).latent_dist.mode()
        counts = speed_up_cpu_vae(vae)
        try:
            got = vae.decode(latents, return_dict=False)[0], vae.encode(video).latent_dist.mode()
        finally:
            for module in vae.modules():
                module.__dict__.pop("_conv_forward", None)
                module.__dict__.pop("forward", None)
    assert counts["rms_norm"] > 10
    assert counts["conv3d"] > 10 or not torch.backends.mkldnn.is_available()
    for ours, stock in zip(got, expected):
        assert ours.shape == stock.shape
        assert float((ours - stock).abs().max()) <= 1e-4


def test_prepare_cache_keeps_to_its_byte_budget():
    texts = {key: Text(torch.zeros(1024)) for key in "abc"}  # 4 KiB each
    cache = PrepareCache(max_bytes=9000)
    for key, text in texts.items():
        cache.get_or_compute(key, lambda t=text: t)
    assert cache.get_or_compute("a", lambda: "recomputed") == ("recomputed", False)  # evicted for c
    assert cache.get_or_compute("c", lambda: "recomputed")[1] is True
    huge = PrepareCache(max_bytes=10)
    assert huge.get_or_compute("x", lambda: texts["a"]) == (texts["a"], False)
    assert huge.get_or_compute("x", lambda: "recomputed")[1] is True  # the newest entry stays, even over budget
