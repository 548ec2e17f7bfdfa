"""What the `asr.whisper` node type declares (no torch): the run's config keys and one request's parameters.

Config keys share one flat namespace with the other plugins' (hence the `asr_` prefix, as omni_qwen's `ar_`).
The request's prompt (`omni run --prompt`, the OpenAI API's `prompt`) is Whisper's previous-text prompt: text the
decoder reads before each window (after <|startofprev|>) to steer spelling and style; it may be empty.
"""

from __future__ import annotations

import os

import attrs
from omni_hf import DTYPE_NAMES

from omni_kernel.core.errors import InvalidParameter
from omni_kernel.core.params import MAX_SEED, boolean, integer, number, option, text

DEFAULT_MAX_BATCH = 32


def _path(instance, attribute, value) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise InvalidParameter(attribute.name, f"{value!r} is not a path")


@attrs.frozen
class ASRConfig:
    """Model-level settings of the speech-to-text stages of one run (docs/speech.md)."""

    asr_model: str | os.PathLike | None = option(
        None, help="local WhisperForConditionalGeneration directory (default: Whisper tiny.en from "
                   "`omni models fetch`)", flag="--asr-model", validator=_path)
    asr_dtype: str = option("auto", help="weights dtype; auto: fp32 on a CPU (equal to transformers' generate), the "
                                         "checkpoint's on a GPU", choices=DTYPE_NAMES)
    asr_device: str | None = option(None, help="torch device of the speech-to-text stage, e.g. cpu or cuda:0 "
                                               "(default: cuda if available)", validator=text)
    asr_max_batch: int = option(DEFAULT_MAX_BATCH, help="requests that share one encoder and decoder step (each "
                                                        "holds its window's keys and values: 24 MB with tiny.en "
                                                        "in fp32)", type=int, validator=integer(1))


@attrs.frozen
class ASRParams:
    """One transcription request's parameters. The audio is the request's `audio` input."""

    language: str | None = option(None, help="the spoken language (ISO 639-1, e.g. en); an English-only model "
                                             "takes en only (default: en on those, detected on the others)",
                                  flag="--language", validator=text)
    temperature: float = option(0.0, help="sampling temperature (0: greedy)", type=float, flag="--temperature",
                                validator=number(minimum=0, maximum=2))
    seed: int | None = option(None, help="random seed for sampling and noise", type=int, flag="--seed",
                              validator=integer(0, MAX_SEED))
    timestamps: bool = option(False, help="decode Whisper's timestamps: segments with their start and end times",
                              type=bool, flag="--timestamps", validator=boolean)
    stream: bool = option(False, help="print text as it is generated", type=bool, flag="--stream",
                          validator=boolean)
