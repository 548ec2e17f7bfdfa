"""`omni run`: one request through a pipeline, its output and trace. Its model and request flags come from the
installed node types."""

from __future__ import annotations

import json
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import click
from tqdm import tqdm

from omni_kernel.api import Omni
from omni_kernel.cli.flags import Flag, collect, declared, values
from omni_kernel.cli.options import placement_options, run_setting_names
from omni_kernel.core.errors import InvalidParameter, OmniError, UserError
from omni_kernel.core.events import RequestFailed, RequestFinished, StageFinished, StageProgress, TokenDelta
from omni_kernel.core.placement import RunSettings
from omni_kernel.core.planner import Planner
from omni_kernel.core.request import Request
from omni_kernel.core.trace import format_trace, jsonable
from omni_kernel.plugins import load_host
from omni_kernel.util.files import check_output_path, remove_outputs, write_json

# The flag of each request input `omni run` declares itself: an error naming the input names the flag
INPUT_FLAGS = {"image": "--image", "audio": "--audio"}
# tqdm's own bar with the step count last and the elapsed and remaining time after it
BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]"


class UserFacingError(click.ClickException):
    exit_code = 2


def run_command(registry) -> click.Command:
    flags = collect(registry)
    options = [
        click.Option(["--pipeline"], required=True, help="Pipeline to run (see `omni pipelines`)."),
        click.Option(["--prompt"], help="The user's prompt (not needed where the pipeline reads the --audio or "
                                        "--image given instead)."),
        click.Option(["--image"], type=click.Path(), help="Input image, for pipelines that take one."),
        click.Option(["--audio"], type=click.Path(), help="Input audio file, for pipelines that take one."),
    ]
    for flag in flags:
        help = f"{flag.info.help[:1].upper()}{flag.info.help[1:]} [{', '.join(flag.plugins)}]"
        if flag.info.type is bool:
            options.append(click.Option([flag.flag, flag.dest], is_flag=True, default=None, help=help))
        else:
            kind = click.Choice(flag.info.choices) if flag.info.choices else flag.info.type
            options.append(click.Option([flag.flag, flag.dest], type=kind, help=help, multiple=flag.info.multiple,
                                        default=None))
    options += [
        click.Option(["-o", "--option", "request_pairs"], multiple=True, metavar="KEY=VALUE",
                     help="A request parameter of the pipeline's nodes (repeatable), e.g. -o max_tokens=64."),
        click.Option(["-c", "--config", "config_pairs"], multiple=True, metavar="KEY=VALUE",
                     help="A model-level setting of the pipeline's nodes (repeatable), e.g. -c ar_dtype=bf16."),
        click.Option(["--trace-json"], type=click.Path(), help="Write the finished request's trace to PATH as JSON."),
        click.Option(["--json", "as_json"], is_flag=True, help="Print the finished request as one JSON object."),
        *placement_options(registry),
    ]
    by_dest = {f.dest: f for f in flags}
    setting_names = run_setting_names(registry)

    @click.pass_context
    def run(ctx, pipeline, prompt, image, audio, request_pairs, config_pairs, trace_json, as_json, **given):
        settings = {key: given.pop(key) for key in setting_names}
        chosen = {by_dest[k]: v for k, v in given.items() if v is not None and v != ()}
        inputs = {"image": image, "audio": audio}
        _run(ctx, pipeline, prompt, inputs, chosen, request_pairs, config_pairs, trace_json, as_json, settings)

    return RunCommand("run", callback=run, params=options,
                         help="Run one request through a pipeline and print its output and trace.\n\n"
                              "Flags name the plugin that declares them; `-o`/`-c` reach every request "
                              "parameter and config key of the pipeline's node types (docs/plugins.md).")


class RunCommand(click.Command):
    """`omni run`: a flag of a node type that is not installed says which plugin to install."""

    def parse_args(self, ctx, args):
        args, given = list(args), args  # click's parser consumes the list it is given
        try:
            return super().parse_args(ctx, given)
        except click.NoSuchOption:
            name = args[args.index("--pipeline") + 1] if "--pipeline" in args[:-1] else None
            registry = ctx.find_object(dict)["host"].registry  # OmniGroup loaded the host to build this command
            if name in registry.pipelines:
                try:
                    ctx.find_object(dict)["host"].builder.validate(registry.pipelines[name].item)
                except UserError as exc:
                    raise UserFacingError(_one_line(exc)) from None
            raise


def _run(ctx, pipeline: str, prompt: str | None, inputs: dict, chosen: dict[Flag, object], request_pairs,
         config_pairs, trace_json, as_json: bool, settings: dict | None = None) -> None:
    host = ctx.obj.get("host") or load_host()
    omni = None
    try:
        plan = Planner(host.registry).plan(pipeline)
        prompt = _prompt_or_missing(ctx, host.registry, plan, prompt, inputs)
        given = values(host.registry, plan, chosen, {"params": request_pairs, "config": config_pairs})
        _one_request_defaults(host.registry, plan, given["config"])
        settings = {k: v for k, v in (settings or {}).items() if v is not None}
        _check_before_loading(host, plan, given, dict(settings), Request(plan.name, prompt, **inputs,
                                                                         params=given["params"]))
        if trace_json:  # before any model loads: a bad trace path must not cost the run
            _check_trace_json(trace_json, given["params"].get("output"))
        with _signals_interrupt():
            omni = Omni(plan, host=host, **given["config"], **settings)
            stream = bool(given["params"].get("stream")) and not as_json
            result, streamed = _drive(omni, omni.request(prompt, **inputs, **given["params"]), stream)
            if trace_json:
                _write_trace(trace_json, result)
    except UserError as exc:
        raise UserFacingError(_user_line(exc)) from None
    except OmniError as exc:
        raise click.ClickException(_one_line(exc)) from None
    except KeyboardInterrupt:
        raise click.ClickException("interrupted; the request was aborted and no partial output was kept") from None
    finally:
        if omni is not None:
            omni.close()
    _print_result(result, streamed, as_json)


def _print_result(result, streamed: set[str], as_json: bool) -> None:
    """The finished request as JSON, or each of the pipeline's outputs (a file's path, or its text where it was not
    streamed) on stdout and its trace on stderr."""
    if as_json:
        click.echo(json.dumps(result.to_json(), ensure_ascii=False))
        return
    for node_id, output in result.final_outputs.items():
        if output.path is not None:
            click.echo(f"wrote {output.path}")
        elif node_id not in streamed and output.text is not None:
            click.echo(output.text)
    click.echo(format_trace(result.trace), err=True)


def _one_request_defaults(registry, plan, config: dict) -> None:
    """The config values a node type declares for one request (`option(run_default=...)`), where none is given."""
    for name, info in declared(registry, plan, "config").items():
        if info.run_default is not None:
            config.setdefault(name, info.run_default)


def _prompt_or_missing(ctx, registry, plan, prompt: str | None, inputs: dict) -> str:
    """The prompt, "" where it is not given but a node of the pipeline reads an input the run gives instead (speech
    to text reads its --audio); otherwise click's missing-option error, as for any required flag."""
    if prompt is not None:
        return prompt
    reads = {name for node_type in registry.node_types_of(plan).values() for name in node_type.inputs}
    if any(value is not None and name in reads for name, value in inputs.items()):
        return ""
    raise click.MissingParameter(ctx=ctx, param=next(p for p in ctx.command.params if p.name == "prompt"))


def _check_before_loading(host, plan, given: dict, settings: dict, request: Request) -> None:
    """The plan, config, run settings and the request's inputs and parameters, before any model loads or worker
    starts (Omni checks them again as it builds): a typo costs no load."""
    run_settings = RunSettings.pop(settings, host.builder.placements())
    builds = host.builder.prepare(plan, given["config"], run_settings)
    host.builder.check_request(plan, builds, request)


def _check_trace_json(trace_json, output) -> None:
    target = check_output_path(trace_json, "--trace-json")
    if output is not None and os.path.realpath(target) == os.path.realpath(Path(output).expanduser()):
        raise InvalidParameter("--trace-json", f"{str(target)!r} is also the request's output; name another file")


def _write_trace(trace_json, result) -> None:
    """The trace JSON, or one line and none of the request's files: a failed request keeps no output."""
    try:
        write_json(trace_json, jsonable(dict(result.trace)))
    except BaseException as exc:  # a full disk, or a signal while writing
        removed = remove_outputs(o.path for o in result.outputs.values())
        if not isinstance(exc, OSError):
            raise
        note = f"; removed {', '.join(removed)}" if removed else ""
        raise OmniError(f"cannot write the trace to {trace_json}: {exc.strerror or exc}{note}") from None


@contextmanager
def _signals_interrupt():
    """SIGTERM and SIGHUP end `omni run` like Ctrl-C: the request is aborted and temporary files are removed."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt
    names = [getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n)]
    try:
        saved = {s: signal.signal(s, interrupt) for s in names}
    except ValueError:  # not the main thread: leave the handlers alone
        saved = {}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def _drive(omni: Omni, request, stream: bool):
    """Run the request; return its result and the final nodes whose text was streamed to stdout."""
    progress = _Progress() if sys.stderr.isatty() else None
    try:
        return _events(omni, request, stream, progress)
    finally:
        if progress is not None:
            progress.end()  # a bar cut short by a failure or Ctrl-C: the error goes on a line of its own


def _events(omni: Omni, request, stream: bool, progress):
    finals = set(omni.graph.finals)
    streamed: set[str] = set()
    open_lines: set[str] = set()  # the nodes whose streamed text's line has not ended yet
    for event in omni.generate_stream(request):
        if isinstance(event, TokenDelta) and stream:
            # stdout carries the final nodes' text only; upstream stages stream to stderr as they go
            upstream = event.node_id not in finals
            click.echo(event.text, nl=False, err=upstream)
            (sys.stderr if upstream else sys.stdout).flush()
            streamed.add(event.node_id)
            open_lines.add(event.node_id)
        elif isinstance(event, StageFinished) and event.node_id in open_lines:
            click.echo(err=event.node_id not in finals)
            open_lines.discard(event.node_id)
        elif isinstance(event, StageProgress) and progress is not None:
            progress.show(event)
        elif isinstance(event, RequestFinished):
            return event.result, streamed & finals
        elif isinstance(event, RequestFailed):
            if open_lines & finals:
                click.echo()
            raise event.exception()
    raise OmniError("the request ended without a result")


class _Progress:
    """A tqdm bar on stderr for each node's phase in turn; `bar` is None while none is open."""

    def __init__(self):
        self.bar = None
        self.phase: tuple[str, str] | None = None

    def show(self, event: StageProgress) -> None:
        phase = (event.node_id, event.phase)
        if phase != self.phase:
            self.end()
            self.bar = tqdm(total=event.total, desc=f"{event.node_id} {event.phase}", file=sys.stderr,
                            bar_format=BAR_FORMAT, dynamic_ncols=True)
            self.phase = phase
        self.bar.total = event.total
        self.bar.update(event.step - self.bar.n)
        if event.step >= event.total:
            self.end()

    def end(self) -> None:
        """Close the open bar: its line ends, so what is written next (an error, the result) starts a line."""
        if self.bar is not None:
            self.bar.close()
        self.bar = None
        self.phase = None


def _user_line(exc: UserError) -> str:
    """The user's mistake in one line; one about a request input that `omni run` takes as a flag of its own names
    the flag."""
    flag = INPUT_FLAGS.get(exc.field) if isinstance(exc, InvalidParameter) else None
    return _one_line(exc) if flag is None else " ".join(exc.named(flag).split())


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
