"""The tiny random-weight demo checkpoint: the real Wan2.2 TI2V-5B classes and layout, a few MB.

It is built once under `omni_kernel.util.files.cache_dir()/demo/wan22-tiny/` and loaded back through the same
code path as a real checkpoint, so `omni run --pipeline wan_i2v` works with no download.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from omni_kernel.util.files import cache_dir

log = logging.getLogger("omni")

DEMO_NAME = "wan22-tiny"
_CORPUS = [
    "a cat surfing on a blue wave at sunset, cinematic light",
    "the camera slowly pans across a quiet mountain lake in the morning mist",
    "a red fox runs through fresh snow between tall pine trees",
    "close-up of raindrops falling on green leaves, shallow depth of field",
    "a busy city street at night with neon signs and reflections on wet asphalt",
    "an astronaut floats inside a space station and waves at the camera",
    "golden wheat fields sway in the wind under a bright summer sky",
    "a small boat drifts along a calm river lined with old stone houses",
    "children fly colourful kites on a windy hill above the sea",
    "steam rises from a cup of coffee on a wooden table by the window",
    "a hummingbird hovers near a purple flower, slow motion, vivid detail",
    "waves crash against dark rocks while seagulls circle overhead",
    "色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量",
    "bright tones, overexposed, static, blurred details, subtitles, worst quality, low quality, ugly",
]


def demo_dir() -> Path:
    return cache_dir() / "demo" / DEMO_NAME


def ensure_demo_model() -> Path:
    """Return the demo checkpoint directory, building it atomically on first use."""
    target = demo_dir()
    if not (target / "model_index.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{DEMO_NAME}."))
        try:
            log.info("building the random-weight demo model at %s", target)
            build_tiny_checkpoint(staging)
            try:
                os.rename(staging, target)
            except OSError:
                if not (target / "model_index.json").is_file():  # not a concurrent build that won the race
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target  # the load line says that it is the demo model (loader.py)


def build_tiny_checkpoint(path: Path, *, dims: dict | None = None, seed: int = 0) -> Path:
    """Save a random-weight WanPipeline (expand_timesteps, no transformer_2) in the Diffusers layout.

    `dims` overrides the transformer size (num_layers, num_attention_heads, attention_head_dim, ffn_dim), so a
    benchmark can build one large enough that a run takes seconds.
    """
    from omni_hf import quiet_hf_load

    with quiet_hf_load(("transformers", "diffusers")):
        return _build(Path(path), dims or {}, seed)


def _build(path: Path, dims: dict, seed: int) -> Path:
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(path / "_spm")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=tokenizer.vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1))
        vae = AutoencoderKLWan(
            base_dim=8, decoder_base_dim=16, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1, is_residual=True,
            in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
            latents_mean=[0.05 * (i % 7 - 3) for i in range(48)], latents_std=[1.0 + 0.05 * (i % 5) for i in range(48)])
        shape = {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 12, "ffn_dim": 32} | dims
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), in_channels=48, out_channels=48, text_dim=32, freq_dim=256, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", **shape)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=5.0)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer, transformer_2=None, expand_timesteps=True)
    pipe.save_pretrained(path, safe_serialization=True)
    shutil.rmtree(path / "_spm", ignore_errors=True)
    return path


def _build_tokenizer(workdir: Path):
    """A SentencePiece unigram model trained on a few local sentences, loaded the way umt5's tokenizer is."""
    import sentencepiece as spm
    from transformers import T5Tokenizer

    workdir.mkdir(parents=True, exist_ok=True)
    corpus = workdir / "corpus.txt"
    corpus.write_text("\n".join(_CORPUS * 4) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(workdir / "spiece"), model_type="unigram", vocab_size=384,
        byte_fallback=True, pad_id=0, eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0,
        hard_vocab_limit=False, minloglevel=2, num_threads=1)
    # T5Tokenizer(vocab_file=...) silently ignores the file in transformers 5; from_pretrained reads it.
    return T5Tokenizer.from_pretrained(str(workdir), extra_ids=0)
