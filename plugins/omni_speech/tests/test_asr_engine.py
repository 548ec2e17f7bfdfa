"""The speech-to-text engine's batching on a tiny random Whisper built here (saved and loaded back, fp32): requests
decoded together, of different lengths, joining at different steps, give each the tokens transformers' `generate`
gives it alone; the window rule equals transformers' long-form seek."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration
from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

from omni_kernel.core.engine import Engine
from omni_kernel.core.errors import InvalidParameter
from omni_kernel.core.request import StageInput
from omni_speech.asr_config import ASRParams
from omni_speech.asr_engine import ASRRunner, ASRScheduler, WindowLimits
from omni_speech.asr_inputs import ASRInput, WhisperAssets
from omni_speech.asr_model import WhisperForward
from omni_speech.asr_windows import split_window

EOS, SOT, PREV, NO_TIMESTAMPS = 50256, 50257, 50360, 50362
TIMESTAMP_BEGIN = NO_TIMESTAMPS + 1
MAX_LENGTH = 24  # a random model rarely says EOS: windows end at the token limit, and tests stay short


def generation_config() -> GenerationConfig:
    return GenerationConfig(bos_token_id=SOT, decoder_start_token_id=SOT, eos_token_id=EOS, pad_token_id=EOS,
                            no_timestamps_token_id=NO_TIMESTAMPS, prev_sot_token_id=PREV, is_multilingual=False,
                            max_initial_timestamp_index=50, return_timestamps=False,
                            suppress_tokens=[1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 28, 29, 31, 58, 59, 60, 61, 62, 63],
                            begin_suppress_tokens=[220, EOS], max_length=MAX_LENGTH)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random tiny.en-shaped Whisper (its vocabulary and special tokens), saved and loaded back."""
    config = WhisperConfig(vocab_size=51864, num_mel_bins=80, d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, max_source_positions=1500, max_target_positions=448,
                           decoder_start_token_id=SOT, eos_token_id=EOS, pad_token_id=EOS, bos_token_id=SOT,
                           init_std=0.3)  # large weights: varied tokens that depend on the audio
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config)
    model.generation_config = generation_config()
    path = tmp_path_factory.mktemp("whisper") / "tiny"
    model.save_pretrained(path)
    loaded = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return loaded


def assets() -> WhisperAssets:
    return WhisperAssets(tokenizer=None, features=None, generation=generation_config(), max_positions=448)


def clip(seed: int, frames: int) -> np.ndarray:
    """A log-mel [80, frames] as the extractor's output ranges (values around -1..1)."""
    return np.random.default_rng(seed).uniform(-1.0, 1.0, (80, frames)).astype(np.float32)


def item(rid: str, features: np.ndarray, timestamps=False, prompt=(), temperature=0.0, seed=None) -> StageInput:
    frames = features.shape[-1]
    processed = ASRInput(features, frames, frames / 100, timestamps or frames > 3000, tuple(prompt), None, temperature,
                         seed)
    return StageInput(rid, "", params=ASRParams(), processed=processed)


def transcribe(model, items, max_batch=8, late=()) -> dict[str, list[int]]:
    """Each request's tokens (its segments' tokens, in order), decoding `items` together; `late` join after 3 steps."""
    engine = Engine(ASRScheduler(WindowLimits.of(assets()), max_batch), ASRRunner(WhisperForward(model, max_batch),
                                                                                  assets()))
    for it in items:
        engine.add_request(it)
    done, steps = {}, 0
    while engine.has_unfinished() or (late and steps < 4):
        steps += 1
        if steps == 4:
            for it in late:
                engine.add_request(it)
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                done[out.request_id] = [t for s in out.record.segments for t in s.tokens]
    return done


def alone(model, features: np.ndarray, timestamps=False, prompt=()) -> list[int]:
    """transformers' generate on the clip alone: its tokens without the EOS."""
    kwargs = {"return_timestamps": True} if timestamps or features.shape[-1] > 3000 else {}
    if prompt:
        kwargs["prompt_ids"] = torch.tensor(prompt)
    out = model.generate(torch.from_numpy(features)[None], generation_config=generation_config(), **kwargs)
    return [t for t in out[0].tolist() if t != EOS]


def test_batched_equals_generate_alone(tiny):
    clips = {f"c{i}": clip(i, 3000) for i in range(4)}
    late = {"late": clip(9, 3000)}
    got = transcribe(tiny, [item(k, v) for k, v in clips.items()], late=[item(k, v) for k, v in late.items()])
    for rid, features in {**clips, **late}.items():
        assert got[rid] == alone(tiny, features), rid


def test_timestamps_and_long_form_equal_generate(tiny):
    """Segments asked for on a short clip, and clips over 30 s (several windows, transformers' seek) in one batch."""
    clips = {"short": (clip(1, 3000), True), "long": (clip(2, 7300), True), "longer": (clip(3, 9500), True),
             "plain": (clip(4, 3000), False)}
    got = transcribe(tiny, [item(k, f, timestamps=t) for k, (f, t) in clips.items()])
    for rid, (features, timestamps) in clips.items():
        assert got[rid] == alone(tiny, features, timestamps), rid


def test_prompt_equals_generate(tiny):
    prompt = (PREV, 464, 2068, 7586)
    got = transcribe(tiny, [item("p", clip(5, 3000), prompt=prompt), item("q", clip(6, 3000))])
    assert got["p"] == alone(tiny, clip(5, 3000), prompt=prompt)
    assert got["q"] == alone(tiny, clip(6, 3000))


def test_sampling_is_the_requests_own(tiny):
    """temperature > 0: a request's tokens depend on its seed only, alone or beside others."""
    features = clip(7, 3000)
    alone_tokens = transcribe(tiny, [item("s", features, temperature=1.0, seed=5)])["s"]
    batch = transcribe(tiny, [item("x", clip(8, 3000), temperature=1.0, seed=1), item("s", features, temperature=1.0,
                                                                                      seed=5)])
    assert batch["s"] == alone_tokens
    assert transcribe(tiny, [item("s", features, temperature=1.0, seed=6)])["s"] != alone_tokens


def test_more_requests_than_the_batch(tiny):
    clips = {f"c{i}": clip(20 + i, 3000) for i in range(5)}
    got = transcribe(tiny, [item(k, v) for k, v in clips.items()], max_batch=2)
    for rid, features in clips.items():
        assert got[rid] == alone(tiny, features), rid


@pytest.mark.parametrize("seed", range(40))
def test_window_rule_equals_transformers(seed):
    """split_window cuts a window into segments and moves the seek exactly as transformers' _retrieve_segment."""
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.choice([10, 11, 12, TIMESTAMP_BEGIN + 3, TIMESTAMP_BEGIN + 40, TIMESTAMP_BEGIN + 77],
                                         size=int(rng.integers(1, 12)))]
    seek, frames = int(rng.integers(0, 5000)), int(rng.integers(100, 3001))
    ours = split_window(tokens, TIMESTAMP_BEGIN, seek, frames)
    theirs, offset = WhisperGenerationMixin._retrieve_segment(
        seek_sequence=torch.tensor(tokens), seek_outputs=[None], time_offset=torch.tensor([seek * 0.01],
                                                                                          dtype=torch.float64),
        timestamp_begin=TIMESTAMP_BEGIN, seek_num_frames=torch.tensor([frames]), time_precision=0.02,
        time_precision_features=0.01, input_stride=2, prev_idx=0, idx=0, return_token_timestamps=False,
        decoder_input_ids=torch.zeros(1, 1))
    assert [s.tokens for s in ours.segments] == [tuple(s["tokens"].tolist()) for s in theirs]
    assert [(round(s.start, 6), round(s.end, 6)) for s in ours.segments] == [
        (round(float(s["start"]), 6), round(float(s["end"]), 6)) for s in theirs]
    assert ours.advance == (int(offset) if int(offset) > 0 else frames)


LANGUAGES = {"<|en|>": 50259, "<|zh|>": 50260, "<|de|>": 50261, "<|es|>": 50262, "<|ru|>": 50263, "<|ko|>": 50264,
             "<|fr|>": 50265}


def multilingual_generation() -> GenerationConfig:
    values = {**generation_config().to_dict(), "eos_token_id": 50257, "pad_token_id": 50257, "bos_token_id": 50258,
              "decoder_start_token_id": 50258, "no_timestamps_token_id": 50363, "prev_sot_token_id": 50361,
              "is_multilingual": True, "lang_to_id": LANGUAGES, "task_to_id": {"translate": 50358, "transcribe": 50359},
              "begin_suppress_tokens": [220, 50257]}
    return GenerationConfig(**values)


def test_multilingual_language_detected_or_given_as_generate(tmp_path):
    """A multilingual model: the language detected from the first window when not given (transformers'
    detect_language), or the one given, then <|transcribe|> (always, as OpenAI's decoding: transformers adds it when
    told the task); in a batch, tokens equal generate alone."""
    config = WhisperConfig(vocab_size=51865, num_mel_bins=80, d_model=32, encoder_layers=1, decoder_layers=2,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, decoder_start_token_id=50258, eos_token_id=50257, pad_token_id=50257,
                           bos_token_id=50258, init_std=0.3)
    torch.manual_seed(1)
    model = WhisperForConditionalGeneration(config).eval()
    model.generation_config = multilingual_generation()
    found = WhisperAssets(None, None, multilingual_generation(), 448)
    assert found.multilingual and found.languages() == ["de", "en", "es", "fr", "ko", "ru", "zh"]
    assert found.language_id("French") == found.language_id("fr") == 50265
    with pytest.raises(InvalidParameter, match="'xx' is not a language of the model; valid: de, en, es"):
        found.language_id("xx")
    engine = Engine(ASRScheduler(WindowLimits.of(found), 4), ASRRunner(WhisperForward(model, 4), found))
    cases = {"detect": (clip(30, 3000), None), "fr": (clip(31, 3000), "fr"), "detect2": (clip(32, 3000), None)}
    for rid, (features, language) in cases.items():
        processed = ASRInput(features, 3000, 30.0, False, (), found.language_id(language), 0.0, None)
        engine.add_request(StageInput(rid, "", params=ASRParams(), processed=processed))
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                got[out.request_id] = ([t for s in out.record.segments for t in s.tokens], out.record.decoder_prompt)
    for rid, (features, language) in cases.items():
        out = model.generate(torch.from_numpy(features)[None], generation_config=multilingual_generation(),
                             language=language, task="transcribe", return_dict_in_generate=True)
        expected = [t for t in out.sequences[0].tolist() if t != 50257]
        tokens, prompt = got[rid]
        assert tokens == expected[len(prompt):], rid
        assert list(prompt) == expected[: len(prompt)], rid


def test_english_only_model_takes_english_only():
    found = assets()
    assert not found.multilingual and found.languages() == ["en"]
    assert found.language_id("en") is None and found.language_id("English") is None
    with pytest.raises(InvalidParameter, match="'fr' is not a language of an English-only model; valid: en"):
        found.language_id("fr")
