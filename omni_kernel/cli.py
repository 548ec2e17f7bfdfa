"""The `omni` command line."""

from __future__ import annotations

import json
import logging
import sys

import click

from . import __version__
from .errors import OmniError, UserError
from .events import RequestFailed, RequestFinished, StageFinished, StageProgress, TokenDelta
from .files import write_json
from .params import ARParams, DiffusionParams
from .planner import PipelineRegistry, Planner
from .plugins import load_host
from .request import Request
from .stage_scheduler import StageScheduler, raise_for
from .trace import format_trace, jsonable

CONFIG_OPTIONS = ("ar_model", "model", "vae_dtype", "disable_cpu_offload")
REQUEST_OPTIONS = ("stream", "output", "profile")


class UserFacingError(click.ClickException):
    exit_code = 2


class RequestFailedError(click.ClickException):
    exit_code = 1


class OmniGroup(click.Group):
    """The group, plus the commands that plugins register."""

    def main(self, *args, **kwargs):
        _setup_logging()  # before any plugin loads, so a broken plugin's warning reads "omni: ..." once
        return super().main(*args, **kwargs)

    def _host(self, ctx: click.Context):
        ctx.ensure_object(dict)
        if "host" not in ctx.obj:
            ctx.obj["host"] = load_host()
        return ctx.obj["host"]

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self._host(ctx).registry.commands))

    def get_command(self, ctx, name):
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
    _setup_logging()
    ctx.ensure_object(dict)


@main.command()
@click.option("--pipeline", required=True, help="Pipeline to run (see `omni pipelines`).")
@click.option("--prompt", required=True, help="The user's prompt.")
@click.option("--stream", is_flag=True, default=None, help="Print text as it is generated.")
@click.option("--ar-model", type=click.Path(), help="Local causal-LM directory (default: a tiny demo model).")
@click.option("--model", type=click.Path(), help="Local diffusion model directory (default: a tiny demo model).")
@click.option("--image", type=click.Path(), help="Input image for image-to-video.")
@click.option("--preset", help="Diffusion preset (quality, balanced, fast, smoke).")
@click.option("--height", type=int, help="Video height in pixels (overrides the preset).")
@click.option("--width", type=int, help="Video width in pixels (overrides the preset).")
@click.option("--num-frames", type=int, help="Number of frames (overrides the preset).")
@click.option("--steps", type=int, help="Denoise steps (overrides the preset).")
@click.option("--guidance-scale", type=float, help="Classifier-free guidance scale (overrides the preset).")
@click.option("--output", type=click.Path(), help="Output file (e.g. out.mp4).")
@click.option("--profile", is_flag=True, default=None, help="Record per-phase times and a Chrome trace.")
@click.option("--disable-cpu-offload", is_flag=True, default=None, help="Keep the whole model on the GPU.")
@click.option("--vae-dtype", type=click.Choice(["fp32", "bf16", "fp16"]), help="VAE dtype.")
@click.option("--seed", type=int, help="Random seed for sampling and noise.")
@click.option("--trace-json", type=click.Path(), help="Write the finished request's trace to PATH as JSON.")
@click.option("--json", "as_json", is_flag=True, default=None, help="Print the finished request as one JSON object.")
@click.pass_context
def run(ctx: click.Context, pipeline: str, prompt: str, as_json: bool | None, **options) -> None:
    """Run one request through a pipeline and print its output and trace."""
    options["json"] = as_json
    host = ctx.obj.get("host") or load_host()
    try:
        plan = Planner(host.registry).plan(pipeline)
        PipelineRegistry(host.registry).validate(plan)  # a missing plugin's message beats "does not use --image"
        used = host.registry.options_of(plan)
        unused = sorted(k for k, v in options.items() if v is not None and k not in used)
        if unused:
            flags = ", ".join("--" + k.replace("_", "-") for k in unused)
            raise UserError(f"pipeline {pipeline!r} does not use {flags}")
        request = Request(pipeline, prompt, image=options["image"], params=_params(options),
                          options={k: options[k] for k in REQUEST_OPTIONS if options[k] is not None})
        config = {k: options[k] for k in CONFIG_OPTIONS if options[k] is not None}
        scheduler = StageScheduler(PipelineRegistry(host.registry).build(plan, config))
        result, streamed = _drive(scheduler, request, stream=bool(options["stream"]) and not as_json)
    except UserError as exc:
        raise UserFacingError(_one_line(exc)) from None
    except OmniError as exc:
        raise RequestFailedError(_one_line(exc)) from None
    except KeyboardInterrupt:
        raise RequestFailedError("interrupted; the request was aborted and no partial output was kept") from None
    if options["trace_json"]:
        write_json(options["trace_json"], jsonable(dict(result.trace)))
    if as_json:
        click.echo(json.dumps(result.to_json(), ensure_ascii=False))
        return
    if result.path is not None:
        click.echo(f"wrote {result.path}")
    elif not streamed and result.text is not None:
        click.echo(result.text)
    click.echo(format_trace(result.trace), err=True)


def _params(options) -> dict:
    seed = options["seed"]
    return {"ar": ARParams(seed=seed),
            "diffusion": DiffusionParams(preset=options["preset"], height=options["height"], width=options["width"],
                                         num_frames=options["num_frames"], num_inference_steps=options["steps"],
                                         guidance_scale=options["guidance_scale"], seed=seed)}


def _drive(scheduler: StageScheduler, request: Request, stream: bool):
    """Run the request; return its result and whether the final node's text was streamed to stdout."""
    progress = sys.stderr.isatty()
    final = scheduler.graph.final
    streamed: set[str] = set()
    for event in scheduler.generate_stream(request):
        if isinstance(event, TokenDelta) and stream:
            # stdout carries the final node's text only; upstream stages stream to stderr as they go
            upstream = event.node_id != final
            click.echo(event.text, nl=False, err=upstream)
            (sys.stderr if upstream else sys.stdout).flush()
            streamed.add(event.node_id)
        elif isinstance(event, StageFinished) and event.node_id in streamed and event.node_id != final:
            click.echo(err=True)
        elif isinstance(event, StageProgress) and progress:
            _progress(event)
        elif isinstance(event, RequestFinished):
            if final in streamed:
                click.echo()
            return event.result, final in streamed
        elif isinstance(event, RequestFailed):
            if final in streamed:
                click.echo()
            raise raise_for(event)
    raise OmniError("the request ended without a result")


def _progress(event: StageProgress) -> None:
    width = 30
    filled = width * event.step // max(event.total, 1)
    end = "\n" if event.step >= event.total else ""
    sys.stderr.write(f"\r{event.node_id} {event.phase} [{'#' * filled}{'.' * (width - filled)}] "
                     f"{event.step}/{event.total}{end}")
    sys.stderr.flush()


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


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
            click.echo(f"  node {node.id}: {node.type}" + (" [final]" if node.final else ""))
        for edge in plan.edges:
            click.echo(f"  edge {edge.source} -> {edge.target} via {edge.connector}")
