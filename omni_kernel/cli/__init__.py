"""The `omni` command line: the group (plugin commands, errors as one line, logging), `omni plugins` and
`omni pipelines`. `omni run` is built in run.py, `omni models` in models.py; the placement flags that commands share
are in options.py, and the flags of the node types' options in flags.py."""

from __future__ import annotations

import logging
import sys

import click

from omni_kernel import __version__
from omni_kernel.cli.models import models_command
from omni_kernel.cli.options import placement_options  # noqa: F401 - plugins import it from here
from omni_kernel.cli.run import run_command
from omni_kernel.plugins import load_host


class OmniGroup(click.Group):
    """The group, `omni run` built from the node types, and the commands that plugins register."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        _setup_logging()  # before any plugin loads, so a broken plugin's warning reads "omni: ..." once
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:  # one line, not click's usage block
            hint = f"; see `{exc.ctx.command_path} --help`" if exc.ctx else ""
            click.echo(f"Error: {' '.join(exc.format_message().split()).rstrip('.')}{hint}", err=True)
            sys.exit(2)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

    def _host(self, ctx: click.Context):
        ctx.ensure_object(dict)
        if "host" not in ctx.obj:
            ctx.obj["host"] = load_host(reserved_commands={"run", *super().list_commands(ctx)})
        return ctx.obj["host"]

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | {"run"} | set(self._host(ctx).registry.commands))

    def get_command(self, ctx, name):
        if name == "run":
            return run_command(self._host(ctx).registry)
        command = super().get_command(ctx, name)
        if command is None and name in self._host(ctx).registry.commands:
            command = self._host(ctx).registry.commands[name].item
        return command


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (click's test runner swaps it per invocation)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def _setup_logging() -> None:
    logger = logging.getLogger("omni")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("omni: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


@click.group(cls=OmniGroup)
@click.version_option(__version__, prog_name="omni")
@click.pass_context
def main(ctx: click.Context) -> None:
    """omni: a plugin-based multimodal inference runtime (AR, diffusion and pipelines of both)."""
    ctx.ensure_object(dict)


@main.command()
@click.pass_context
def plugins(ctx: click.Context) -> None:
    """List installed plugins, their versions and what each registers."""
    host = ctx.obj.get("host") or load_host()
    for info in host.plugins:
        click.echo(f"{info.name} {info.version} [{info.status}]" + (f": {info.error}" if info.error else ""))
        for what, names in host.registry.by_plugin(info.name).items():
            if names:
                click.echo(f"  {what}: {', '.join(names)}")


@main.command()
@click.pass_context
def pipelines(ctx: click.Context) -> None:
    """List every pipeline with its nodes, edges and providing plugin."""
    host = ctx.obj.get("host") or load_host()
    for name, registered in sorted(host.registry.pipelines.items()):
        plan = registered.item
        click.echo(f"{name} (from {registered.plugin})" + (f": {plan.description}" if plan.description else ""))
        for node in plan.nodes:
            node_type = host.registry.node_types.get(node.type)
            about = f" - {node_type.item.description}" if node_type and node_type.item.description else ""
            click.echo(f"  node {node.id}: {node.type}" + (" [final]" if node.final else "") + about)
        for edge in plan.edges:
            click.echo(f"  edge {edge.source} -> {edge.target} via {edge.connector}")


main.add_command(models_command)
