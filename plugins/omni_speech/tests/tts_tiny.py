"""A tiny random VitsModel directory with an omni voice file, for the text-to-speech tests that need no real weights:
its phoneme map covers the letters, IPA and combining marks espeak-ng writes for English, so its text goes through
the same front end as the real voice's."""

from __future__ import annotations

import json
from pathlib import Path

PUNCTUATION = " !'(),-.:;?"
SAMPLE_RATE = 16000


def phoneme_map() -> dict[str, list[int]]:
    symbols = ["_", "^", "$", *PUNCTUATION, *"abcdefghijklmnopqrstuvwxyz", *"æçðøŋœθβχᵻ",
               *(chr(c) for c in range(0x250, 0x300)), *(chr(c) for c in range(0x300, 0x370))]
    return {symbol: [i] for i, symbol in enumerate(dict.fromkeys(symbols))}


def make_tiny_voice(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import VitsConfig, VitsModel

    ids = phoneme_map()
    config = VitsConfig(vocab_size=len(ids), hidden_size=16, num_hidden_layers=2, num_attention_heads=2, window_size=4,
                        ffn_dim=32, flow_size=8, upsample_initial_channel=16, upsample_rates=[4, 4],
                        upsample_kernel_sizes=[8, 8], resblock_kernel_sizes=[3, 5],
                        resblock_dilation_sizes=[[1, 2], [2, 6]], duration_predictor_filter_channels=16,
                        spectrogram_bins=9, prior_encoder_num_wavenet_layers=2, posterior_encoder_num_wavenet_layers=2,
                        duration_predictor_num_flows=2, depth_separable_num_layers=2, wavenet_kernel_size=3,
                        layerdrop=0.0, sampling_rate=SAMPLE_RATE)
    torch.manual_seed(seed)
    VitsModel(config).save_pretrained(path)
    voice = {"name": "tiny", "sample_rate": SAMPLE_RATE, "phoneme_type": "espeak", "espeak_voice": "en-us",
             "phoneme_id_map": ids, "noise_scale": 0.667, "noise_w": 0.8, "length_scale": 1.0, "language": "en_US"}
    (path / "omni_voice.json").write_text(json.dumps(voice, ensure_ascii=False))
    return path
