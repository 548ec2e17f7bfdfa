"""What a transcription request is before the model sees it: its audio decoded and checked, its log-mel, its
decoder prompt. Model-free: it reads the model directory's tokenizer, feature extractor and generation config only
(WhisperAssets), so bad audio or a bad parameter is refused in one line before any weights load.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np

from omni_kernel.core.errors import InputError, InvalidParameter
from omni_kernel.core.request import StageInput
from omni_kernel.core.stage import Inputs

from .audio_in import SAMPLE_RATE, DecodedAudio, decode

SHORT_SECONDS = 30.0  # one window: decoded without timestamps unless segments are asked for


@attrs.frozen
class WhisperAssets:
    """A Whisper directory's model-free parts: tokenizer, feature extractor, generation config and the sizes the
    decoder prompt is bounded by."""

    tokenizer: object = attrs.field(eq=False, repr=False)
    features: object = attrs.field(eq=False, repr=False)
    generation: object = attrs.field(eq=False, repr=False)
    max_positions: int = 448

    @classmethod
    def load(cls, path: str | Path) -> WhisperAssets:
        from omni_hf import quiet_hf_load
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig, WhisperFeatureExtractor

        with quiet_hf_load(["transformers"]):
            config = AutoConfig.from_pretrained(path)
            return cls(AutoTokenizer.from_pretrained(path), WhisperFeatureExtractor.from_pretrained(path),
                       GenerationConfig.from_pretrained(path), config.max_target_positions)

    @property
    def multilingual(self) -> bool:
        return bool(getattr(self.generation, "is_multilingual", False) and getattr(self.generation, "lang_to_id", None))

    @property
    def eos(self) -> int:
        eos = self.generation.eos_token_id
        return eos[0] if isinstance(eos, (list, tuple)) else eos

    @property
    def timestamp_begin(self) -> int:
        return self.generation.no_timestamps_token_id + 1

    @property
    def max_prompt_tokens(self) -> int:
        """The previous-text prompt is cut to its last tokens beyond this (Whisper's n_text_ctx // 2 - 1)."""
        return self.max_positions // 2 - 1

    def languages(self) -> list[str]:
        if not self.multilingual:
            return ["en"]
        return sorted(token.strip("<|>") for token in self.generation.lang_to_id)

    def language_id(self, language: str | None) -> int | None:
        """The language token of a request's `language` (None: detected, on a multilingual model); refuses one the
        model does not know, naming the valid ones."""
        from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

        if language is None:
            return None
        code = TO_LANGUAGE_CODE.get(language.lower(), language.lower())
        valid = self.languages()
        if code not in valid:
            kind = "an English-only model" if not self.multilingual else "the model"
            raise InvalidParameter("language", f"{language!r} is not a language of {kind}; valid: {', '.join(valid)}")
        return self.generation.lang_to_id[f"<|{code}|>"] if self.multilingual else None

    def decoder_prompt(self, language_id: int | None, timestamps: bool) -> tuple[int, ...]:
        """A window's first decoder tokens (without the previous-text prompt): <|startoftranscript|>, on a
        multilingual model the language and <|transcribe|> (always, as OpenAI's decoding), and <|notimestamps|>
        when decoded without timestamps."""
        tokens = [self.generation.decoder_start_token_id]
        if self.multilingual:
            tokens += [language_id, self.generation.task_to_id["transcribe"]]
        if not timestamps:
            tokens.append(self.generation.no_timestamps_token_id)
        return tuple(tokens)

    def prompt_ids(self, text: str) -> tuple[int, ...]:
        """Whisper's previous-text prompt: <|startofprev|> and the text's last tokens; () for no text."""
        if not text.strip():
            return ()
        try:
            ids = [int(i) for i in self.tokenizer.get_prompt_ids(text, return_tensors="np")]
        except ValueError as exc:
            raise InputError(f"the prompt cannot be Whisper's previous text: {exc}") from None
        return (ids[0], *ids[1:][-self.max_prompt_tokens:])


@attrs.frozen
class ASRInput:
    """A transcription request as the engine takes it (StageInput.processed)."""

    features: np.ndarray = attrs.field(eq=False, repr=False)  # log-mel [mels, frames] of the whole clip
    num_frames: int  # the frames the seek runs over (3000 for a clip up to 30 s, padded as the extractor does)
    audio_seconds: float
    timestamps: bool  # decoded with timestamps (segments asked for, or audio over 30 s)
    prompt: tuple[int, ...]  # <|startofprev|> + the previous-text prompt, or ()
    language_id: int | None  # None on a multilingual model: detected from the first window
    temperature: float
    seed: int | None

    @property
    def audio_frames(self) -> int:
        """The frames of real audio: where the last segment of a window without timestamps ends."""
        return int(round(self.audio_seconds * SAMPLE_RATE)) // 160


def log_mel(assets: WhisperAssets, audio: DecodedAudio) -> np.ndarray:
    """The feature extractor's log-mel of the whole clip, as transformers makes it for `generate`: padded to 30 s
    when shorter, else over the whole clip (its normalisation spans the clip)."""
    if audio.seconds <= SHORT_SECONDS:
        out = assets.features(audio.samples, sampling_rate=SAMPLE_RATE, return_tensors="np")
    else:
        out = assets.features(audio.samples, sampling_rate=SAMPLE_RATE, truncation=False, padding="longest",
                              return_tensors="np")
    return out.input_features[0].astype(np.float32, copy=False)


class ASRInputs(Inputs):
    """Decodes and checks the audio, refuses bad parameters, computes the log-mel and the decoder prompt."""

    concurrent = True

    def __init__(self, assets: WhisperAssets):
        self.assets = assets

    def check(self, item: StageInput) -> DecodedAudio:
        if item.audio is None:
            raise InputError("no audio: speech to text needs an audio file (--audio, or the request's audio)")
        self.assets.language_id(item.params.language)
        self.assets.prompt_ids(item.prompt)
        return decode(item.audio)

    def process(self, item: StageInput) -> StageInput:
        audio = self.check(item)
        params = item.params
        features = log_mel(self.assets, audio)
        processed = ASRInput(features, max(features.shape[-1], 1), audio.seconds,
                             params.timestamps or audio.seconds > SHORT_SECONDS, self.assets.prompt_ids(item.prompt),
                             self.assets.language_id(params.language), params.temperature, params.seed)
        return attrs.evolve(item, processed=processed)

