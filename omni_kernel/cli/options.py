"""The run settings as flags, for every command that builds pipelines (`omni run`, `omni serve`): `--placement`,
and one flag per option that a registered placement declares with `flag=` (its settings class)."""

from __future__ import annotations

import click

from omni_kernel.core.errors import InvalidParameter
from omni_kernel.core.params import options_of, parse
from omni_kernel.core.placement import settings_class
from omni_kernel.core.registry import Registry


class Declared(click.ParamType):
    """A flag's text parsed as the declared option parses `key=value` text (its validation runs when the settings
    are built, so the error names the setting)."""

    def __init__(self, name: str, info):
        self.key = name
        self.info = info
        self.name = info.type.__name__

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        try:
            return parse(self.key, self.info, value)
        except InvalidParameter as exc:
            self.fail(str(exc).split(": ", 1)[-1], param, ctx)


def placement_flags(registry: Registry) -> dict[str, object]:
    """Setting name -> OptionInfo of every option with a flag that a registered placement declares."""
    found = {}
    for registered in registry.placements.values():
        for name, info in options_of(settings_class(registered.item)).items():
            if info.flag is not None:
                found.setdefault(name, info)
    return found


def placement_options(registry: Registry) -> list[click.Option]:
    """`--placement` plus the placements' declared flags; each flag's destination is its setting's name."""
    installed = ", ".join(["inproc", *sorted(registry.placements)])
    options = [click.Option(["--placement"], metavar="NAME|NODE=NAME,...",
                            help=f"Where stages run: {installed}; run-wide, or per node as "
                                 "video=process,bridge=inproc (docs/distributed.md).")]
    for name, info in placement_flags(registry).items():
        options.append(click.Option([info.flag, name], type=Declared(name, info), metavar=info.metavar or None,
                                    help=info.help[:1].upper() + info.help[1:]))
    return options


def run_setting_names(registry: Registry) -> list[str]:
    """The destinations of `placement_options`: `placement` and the placements' flagged settings."""
    return ["placement", *placement_flags(registry)]
