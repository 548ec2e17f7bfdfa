"""Per-stage-kind request parameters, validated at construction."""

from __future__ import annotations

import attrs

from .errors import InvalidParameter


def _check(field: str, ok: bool, allowed: str, value) -> None:
    if not ok:
        raise InvalidParameter(field, f"{value!r} is outside the allowed range ({allowed})")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _optional_int(value, field: str, minimum: int) -> None:
    if value is None:
        return
    _check(field, isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
           f"an integer >= {minimum}", value)


@attrs.frozen
class ARParams:
    """Sampling values of an autoregressive stage. temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    max_tokens: int | None = None

    def __attrs_post_init__(self) -> None:
        _check("temperature", _number(self.temperature) and self.temperature >= 0,
               "temperature >= 0", self.temperature)
        _check("top_p", _number(self.top_p) and 0 < self.top_p <= 1, "0 < top_p <= 1", self.top_p)
        _check("top_k", isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and (self.top_k == -1 or self.top_k > 0),
               "top_k = -1 (off) or top_k > 0", self.top_k)
        _optional_int(self.seed, "seed", 0)
        _optional_int(self.max_tokens, "max_tokens", 1)
        _check("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings", self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@attrs.frozen
class DiffusionParams:
    """Values of a diffusion stage; None means "the stage's preset decides"."""

    preset: str | None = None
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    negative_prompt: str | None = None

    def __attrs_post_init__(self) -> None:
        for name in ("height", "width", "num_frames", "num_inference_steps"):
            _optional_int(getattr(self, name), name, 1)
        _optional_int(self.seed, "seed", 0)
        if self.guidance_scale is not None:
            _check("guidance_scale", _number(self.guidance_scale) and self.guidance_scale >= 0,
                   "guidance_scale >= 0", self.guidance_scale)
