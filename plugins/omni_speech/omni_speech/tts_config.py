"""What the `tts.vits` node type declares (no torch): the run's config keys and one request's parameters.

Config keys share one flat namespace with the other plugins' (hence the `tts_` prefix, as omni_qwen's `ar_`).
`noise_scale` and `noise_w` left out take the voice's own defaults (its config); 0 for both makes the audio
deterministic; `seed` makes it reproducible, alone or in a batch.
"""

from __future__ import annotations

import os

import attrs
from omni_hf import DTYPE_NAMES

from omni_kernel.core.errors import InvalidParameter
from omni_kernel.core.params import MAX_SEED, boolean, integer, number, option, text

FORMATS = ("wav", "mp3", "flac", "opus", "aac", "pcm")  # OpenAI's response_format values
MAX_INPUT_CHARS = 4096  # OpenAI's /v1/audio/speech `input` limit
MIN_SPEED, MAX_SPEED = 0.25, 4.0
MAX_NOISE = 2.0  # past this the durations' noise can ask for minutes of frames per phoneme
DEFAULT_MAX_BATCH = 16


def _path(value):
    return os.fspath(value) if isinstance(value, os.PathLike) else value


@attrs.frozen
class TTSConfig:
    """Model-level settings of the text-to-speech stages of one run (docs/speech.md)."""

    tts_model: str | None = option(
        None, help="local VitsModel directory (default: the Piper voice joe from `omni models fetch`)",
        flag="--tts-model", converter=_path, validator=text)
    tts_dtype: str = option("auto", help="weights dtype; auto: the checkpoint's (the default voice's is fp32)",
                            choices=DTYPE_NAMES)
    tts_device: str | None = option(None, help="torch device of the text-to-speech stage, e.g. cpu or cuda:0 "
                                               "(default: cuda if available)", validator=text)
    tts_max_batch: int = option(DEFAULT_MAX_BATCH, help="sentences (of as many requests) in one forward",
                                type=int, validator=integer(1))
    tts_batch_decoder: bool | None = option(
        None, help="run the HiFi-GAN decoder over the step's sentences at once (default: on a GPU; on a CPU each "
                   "sentence's decoder runs alone, which measured 2.4x less CPU time than batched on 8 sentences)",
        type=bool, validator=boolean)


@attrs.frozen
class TTSParams:
    """One speech request's parameters. The text is the request's prompt."""

    voice: str | None = option(None, help="the voice (default: the model's; `omni serve` lists them on "
                                          "/v1/audio/voices)", flag="--voice", validator=text)
    speed: float = option(1.0, help=f"speaking rate ({MIN_SPEED:g}-{MAX_SPEED:g}; 1: the voice's own)", type=float,
                          flag="--speed", validator=number(minimum=MIN_SPEED, maximum=MAX_SPEED))
    noise_scale: float | None = option(None, help="variation of the voice's sound (default: the voice's; 0 with "
                                                  "noise_w 0: the same audio every time)", type=float,
                                       validator=number(minimum=0, maximum=MAX_NOISE))
    noise_w: float | None = option(None, help="variation of the phonemes' durations (default: the voice's)",
                                   type=float, validator=number(minimum=0, maximum=MAX_NOISE))
    seed: int | None = option(None, help="random seed for sampling and noise", type=int, flag="--seed",
                              validator=integer(0, MAX_SEED))
    response_format: str | None = option(None, help="the audio file's format (default: the output file's "
                                                    "extension, else wav)", choices=FORMATS)
    output: str | None = option(None, help="output file; for speech its extension gives the audio format (wav, mp3, "
                                           "flac, opus, aac, pcm; default: no file, the audio is in the result)",
                                flag="--output", converter=_path, validator=text)


def output_format(params: TTSParams) -> str:
    """The format of the request's audio file: response_format, else the output's extension, else wav. An output
    whose extension names another format than response_format, or none of them, is refused."""
    if params.output is None:
        return params.response_format or "wav"
    suffix = os.path.splitext(params.output)[1].lower().lstrip(".")
    if suffix not in FORMATS:
        if params.response_format is not None and not suffix:
            return params.response_format
        raise InvalidParameter("output", f"{params.output!r} must end in one of "
                                         f"{', '.join('.' + f for f in FORMATS)} (the format of the audio file)")
    if params.response_format is not None and params.response_format != suffix:
        raise InvalidParameter("response_format", f"{params.response_format!r} does not match the output "
                                                  f"{params.output!r}")
    return suffix
