"""Flags and parameter types that more than one command uses: the run settings (`omni run`, `omni serve`)."""

from __future__ import annotations

import click


class WorkerThreads(click.ParamType):
    """--worker-threads: an integer >= 1 or `shared`."""

    name = "N|shared"

    def convert(self, value, param, ctx):
        if value == "shared" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        if isinstance(value, str) and value.isdigit() and int(value) >= 1:
            return int(value)
        self.fail(f"{value!r} is not an integer >= 1 or 'shared'", param, ctx)


def placement_options() -> list[click.Option]:
    """The run settings as flags (`omni run`, `omni serve`): where stages run and how their workers behave."""
    return [
        click.Option(["--placement"], metavar="MODE|NODE=MODE,...",
                     help="Where stages run: inproc (default), process (each stage in its own worker process) or "
                          "ray; per node as video=process,bridge=inproc (docs/distributed.md)."),
        click.Option(["--replicas"], metavar="N|NODE=N,...",
                     help="Independent copies of a worker-placed stage, each request to the least loaded: N for "
                          "every node, or per node as video=2 (docs/distributed.md)."),
        click.Option(["--ray-address"], metavar="ADDRESS",
                     help="The Ray cluster for --placement ray, e.g. HEAD_IP:6379 (default: a local Ray)."),
        click.Option(["--worker-threads"], type=WorkerThreads(), metavar="N|shared",
                     help="Torch threads in each stage worker: N, or shared (the worker processes lend each other "
                          "their cores: one busy alone uses all of them). Default: the library's."),
        click.Option(["--max-restarts"], type=click.IntRange(min=0), metavar="N",
                     help="Restarts of a stage worker that died, before its stage fails (default: 1)."),
    ]
