"""Declared parameters: node types describe their config and request parameters as closed attrs classes.

A field made with `option(...)` carries its help text, the type its text form parses to (for `-o key=value`,
`-c key=value` and generated flags) and an optional `omni run` flag. `split` routes one flat mapping of
values to every node of a pipeline and refuses a key that no node declares, naming the valid ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from omni_kernel.core.errors import InputError, InvalidParameter

TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


@attrs.frozen
class OptionInfo:
    help: str
    type: type = str  # str, int, float or bool: what a text value parses to
    flag: str | None = None  # e.g. "--steps"; None: reachable through -o / -c only
    choices: tuple[str, ...] | None = None
    multiple: bool = False  # a tuple of values; -o key=a -o key=b collects both
    metavar: str | None = None  # how the flag's value is shown in --help (default: its type)
    # The range its validator (integer() or number()) allows, for what shows it (the server's model card)
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None  # a strict lower bound
    # What `omni run` (one request, then exit) uses where none is given, if not the field's default: for a setting
    # that pays for itself only over many requests (a compile at load)
    run_default: Any = None


def option(default: Any = None, *, help: str, type: type = str, flag: str | None = None,
           choices: tuple[str, ...] | None = None, multiple: bool = False,
           validator: Callable | None = None, converter: Callable | None = None, metavar: str | None = None,
           run_default: Any = None) -> Any:
    """An attrs field with the metadata the CLI, the Python API and the HTTP server read."""
    info = OptionInfo(help, type, flag, tuple(choices) if choices else None, multiple, metavar,
                      **getattr(validator, "bounds", {}), run_default=run_default)
    validators = [v for v in (_choice(info.choices) if info.choices else None, validator) if v]
    return attrs.field(default=default, validator=validators or None, converter=converter,
                       metadata={"omni": info}, kw_only=True)


def options_of(cls: type | None) -> dict[str, OptionInfo]:
    """The declared options of a params/config class by field name."""
    if cls is None:
        return {}
    return {f.name: f.metadata.get("omni") or OptionInfo(help="") for f in attrs.fields(cls)}


def parse(name: str, info: OptionInfo, text: str) -> Any:
    """A `key=value` text value converted to the option's type."""
    try:
        if info.type is bool:
            low = text.strip().lower()
            if low not in TRUE | FALSE:
                raise ValueError
            return low in TRUE
        return info.type(text)
    except ValueError:
        raise InvalidParameter(name, f"{text!r} is not a valid {info.type.__name__}") from None


def make(cls: type, values: Mapping[str, Any]) -> Any:
    """Build one params/config instance; a wrong type becomes an InvalidParameter naming the field."""
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        field = next((k for k in values if k in str(exc)), "parameter")
        raise InvalidParameter(field, " ".join(str(exc).split())) from None


def split(pipeline: str, what: str, classes: Mapping[str, type | None], values: Mapping[str, Any]) -> dict[str, Any]:
    """Route flat `values` to each node's class (None values mean "not given"); refuse unknown keys."""
    given = {k: v for k, v in values.items() if v is not None}
    valid = sorted({name for cls in classes.values() for name in options_of(cls)})
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise InvalidParameter(unknown[0], f"pipeline {pipeline!r} has no {what} {unknown[0]!r}; valid {what}s: "
                                           f"{', '.join(valid) or 'none'}")
    return {node: None if cls is None else make(cls, {k: v for k, v in given.items() if k in options_of(cls)})
            for node, cls in classes.items()}


REQUEST_INPUTS = ("image", "audio")  # a Request's inputs besides the prompt, as NodeType.inputs names them


def resolve(pipeline: str, node_types: Mapping[str, Any], request, nodes=()) -> dict[str, Any]:
    """Each node's params for a request (node id -> its params instance); refuses parameters no node of the
    pipeline declares and an input (image, audio) when no node reads one. A node (NodeSpec, of `nodes`) that routes
    its parameters (`NodeSpec.params`) gets the ones its route gives."""
    for name in REQUEST_INPUTS:
        if getattr(request, name) is not None and not any(name in t.inputs for t in node_types.values()):
            raise InvalidParameter(name, f"pipeline {pipeline!r} takes no input {name}")
    params = split(pipeline, "request parameter", {n: t.params for n, t in node_types.items()}, request.params)
    for node in nodes:
        cls = node_types[node.id].params
        if node.params is not None and cls is not None:
            routed = node.params(dict(request.params), request)
            params[node.id] = make(cls, {k: v for k, v in routed.items() if v is not None and k in options_of(cls)})
    return params


def check_prompt(prompt: str) -> None:
    """The one rule for a prompt that a node reads as its text: it must say something. Every node type that reads
    the prompt checks it with this, in its `check` (before any model loads), so one prompt gets one answer in every
    pipeline."""
    if not prompt.strip():
        raise InputError("the prompt is empty")


# Validators for option(validator=...). Each raises InvalidParameter naming the field.

def _choice(choices):
    def check(instance, attribute, value):
        if value is not None and value not in choices:
            raise InvalidParameter(attribute.name, f"{value!r} is not one of {', '.join(choices)}")
    return check


def integer(minimum: int | None = None, maximum: int | None = None):
    def check(instance, attribute, value):
        ok = isinstance(value, int) and not isinstance(value, bool) and _within(value, minimum, maximum)
        if value is not None and not ok:
            raise InvalidParameter(attribute.name, f"{value!r} is not an integer{_range(minimum, maximum)}")
    check.bounds = {"minimum": minimum, "maximum": maximum}
    return check


def number(minimum: float | None = None, maximum: float | None = None, above: float | None = None):
    """A finite int or float in [minimum, maximum]; `above` is a strict lower bound."""
    def check(instance, attribute, value):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if value is not None and not (ok and _within(value, minimum, maximum) and (above is None or value > above)):
            low = f" > {above}" if above is not None else _range(minimum, None)
            raise InvalidParameter(attribute.name, f"{value!r} is not a finite number{low}"
                                                   + (f" <= {maximum}" if maximum is not None else ""))
    check.bounds = {"minimum": minimum, "maximum": maximum, "above": above}
    return check


def boolean(instance, attribute, value):
    if value is not None and not isinstance(value, bool):
        raise InvalidParameter(attribute.name, f"{value!r} is not True or False")


def text(instance, attribute, value):
    if value is not None and not isinstance(value, str):
        raise InvalidParameter(attribute.name, f"{value!r} is not text")


def _within(value, minimum, maximum) -> bool:
    return (minimum is None or value >= minimum) and (maximum is None or value <= maximum)


def _range(minimum, maximum) -> str:
    if minimum is not None and maximum is not None:
        return f" between {minimum} and {maximum}"
    return f" >= {minimum}" if minimum is not None else f" <= {maximum}" if maximum is not None else ""


MAX_SEED = 2**63 - 1


@attrs.frozen
class ARParams:
    """Request parameters of an autoregressive stage. temperature 0 means greedy."""

    temperature: float = option(0.0, help="sampling temperature (0: greedy)", type=float, flag="--temperature",
                                validator=number(minimum=0))
    top_p: float = option(1.0, help="nucleus sampling mass", type=float, validator=number(maximum=1, above=0))
    top_k: int = option(-1, help="sample from the k most likely tokens (-1: off)", type=int, validator=integer(-1))
    seed: int | None = option(None, help="random seed for sampling and noise", type=int, flag="--seed",
                              validator=integer(0, MAX_SEED))
    stop: tuple[str, ...] = option((), help="stop string (repeatable)", multiple=True,
                                   converter=lambda v: (v,) if isinstance(v, str) else tuple(v))
    max_tokens: int | None = option(None, help="most new tokens", type=int, flag="--max-tokens",
                                    validator=integer(1))
    presence_penalty: float = option(0.0, help="subtracted from the logit of each token already generated (-2..2, "
                                          "OpenAI's)", type=float, validator=number(-2, 2))
    frequency_penalty: float = option(0.0, help="subtracted from a token's logit once per time it was generated "
                                           "(-2..2, OpenAI's)", type=float, validator=number(-2, 2))
    repetition_penalty: float = option(1.0, help="divides the positive and multiplies the negative logits of the "
                                            "prompt's and generated tokens (1: off)", type=float,
                                       validator=number(above=0))
    min_p: float = option(0.0, help="drop tokens less likely than min_p times the most likely one (0: off)",
                          type=float, validator=number(0, 1))
    ignore_eos: bool = option(False, help="keep generating past EOS (benchmarks)", type=bool, validator=boolean)
    stream: bool = option(False, help="print text as it is generated", type=bool, flag="--stream",
                          validator=boolean)

    def __attrs_post_init__(self) -> None:
        if self.top_k == 0:
            raise InvalidParameter("top_k", "0 is not allowed (use -1 for off, or k >= 1)")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidParameter("stop", f"{self.stop!r} must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the request's tokens (the sampler keeps their counts only then)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
