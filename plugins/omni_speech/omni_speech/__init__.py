"""omni plugin: speech. `tts.vits` speaks text with a transformers VitsModel (by default a Piper voice converted
from its registry wheel), `asr.whisper` transcribes audio with a WhisperForConditionalGeneration (by default
Whisper tiny.en converted from its CTranslate2 wheel); the pipelines `tts` and `asr`."""
