"""`omni serve`: the command. Its model flags are the config flags the installed node types declare (the same
`--ar-model`, `--model`, `--vae-dtype`, `--disable-cpu-offload`, ... as `omni run`) plus `-c key=value`; each
value goes to every served pipeline whose node types declare it."""

from __future__ import annotations

import functools
import logging
import signal
import time
from pathlib import Path

import attrs
import click

from omni_kernel.cli.flags import Flag, collect, declared, values
from omni_kernel.cli.options import placement_options, run_setting_names
from omni_kernel.core.errors import GraphError, OmniError, UserError
from omni_kernel.plugins import load_host

from .settings import ServeSettings, Timeouts
from .store import ON_RESTART, JobStore

log = logging.getLogger("omni")


def _host(ctx: click.Context):
    obj = ctx.find_object(dict)
    if obj is not None and obj.get("host") is not None:
        return obj["host"]
    host = load_host()
    if obj is not None:
        obj["host"] = host
    return host


@attrs.frozen
class PluginFlags:
    """What the installed plugins add to `omni serve`: the node types' config flags and the names of the
    placements' run settings (the destinations of their flags)."""

    flags: tuple[Flag, ...]
    settings: tuple[str, ...]


def _plugin_flags(ctx: click.Context) -> PluginFlags:
    """Found once per invocation and kept beside the plugin host in the context's object, so the parser and the
    callback read the same flags (and a flag two plugins declare is warned of once)."""
    obj = ctx.find_object(dict)
    if obj is not None and obj.get("serve_flags") is not None:
        return obj["serve_flags"]
    registry = _host(ctx).registry
    found = PluginFlags(tuple(f for f in collect(registry) if f.where == "config"), tuple(run_setting_names(registry)))
    if obj is not None:
        obj["serve_flags"] = found
    return found


class ServeCommand(click.Command):
    """Adds the node types' config flags and the installed placements' run-setting flags when the command is
    parsed or its help is shown."""

    def get_params(self, ctx: click.Context):
        params = super().get_params(ctx)
        added = [_option(f) for f in _plugin_flags(ctx).flags] + placement_options(_host(ctx).registry)
        return params[:-1] + added + params[-1:]  # --help stays last


def _option(flag: Flag) -> click.Option:
    help = f"{flag.info.help[:1].upper()}{flag.info.help[1:]} [{', '.join(flag.plugins)}]"
    if flag.info.type is bool:
        return click.Option([flag.flag, flag.dest], is_flag=True, default=None, help=help)
    kind = click.Choice(flag.info.choices) if flag.info.choices else flag.info.type
    return click.Option([flag.flag, flag.dest], type=kind, help=help, multiple=flag.info.multiple, default=None)


def serve_command() -> click.Command:
    options = [
        click.Option(["--pipeline", "pipelines"], multiple=True,
                     help="Pipeline to serve (repeatable; default: every installed pipeline that builds)."),
        click.Option(["--host"], default="127.0.0.1", show_default=True, help="Address to bind."),
        click.Option(["--port"], default=8000, show_default=True, type=int, help="Port to bind (0: any free)."),
        click.Option(["--api-key"], default=None, envvar="OMNI_API_KEY",
                     help="Require `Authorization: Bearer KEY` on every /v1 route (or OMNI_API_KEY)."),
        click.Option(["--served-model-name", "aliases"], multiple=True, metavar="NAME[=PIPELINE]",
                     help="Another name a request's `model` may use for a pipeline (repeatable)."),
        click.Option(["--output-dir"], type=click.Path(file_okay=False), default=None,
                     help="Where videos, uploads and the job store are kept (default: serve/videos under the omni "
                          "cache, e.g. ~/.cache/omni/serve/videos; kept across restarts)."),
        click.Option(["--jobs-db"], type=click.Path(dir_okay=False), default=None,
                     help="The video job store, a SQLite file (default: jobs.sqlite in --output-dir)."),
        click.Option(["--on-restart"], type=click.Choice(ON_RESTART), default="fail", show_default=True,
                     help="A video job in progress when the server died: run it again from the start, or fail it "
                          "(error code server_restarted). Queued jobs always run."),
        click.Option(["--video-ttl"], type=float, default=3600.0, show_default=True,
                     help="Seconds a finished video job and its file are kept (0: forever)."),
        click.Option(["--max-body-mb"], type=float, default=20.0, show_default=True,
                     help="Largest request body in MB (413 above)."),
        click.Option(["--max-text-body-mb"], type=float, default=4.0, show_default=True,
                     help="Largest completions or chat request body in MB (413 above, before it is parsed)."),
        click.Option(["--allowed-origins"], multiple=True,
                     help="Origins allowed by CORS (repeatable; default: no CORS)."),
        click.Option(["--max-concurrent-requests", "max_in_flight"], type=click.IntRange(min=0), default=1024,
                     show_default=True, help="Requests (chats, completions, video jobs) in flight at once; one "
                                             "more gets 429 with Retry-After (0: no limit)."),
        click.Option(["--shutdown-timeout"], type=float, default=30.0, show_default=True,
                     help="Seconds in-flight requests may finish after SIGTERM/Ctrl-C before they are aborted."),
        *timeout_options(),
        click.Option(["-c", "--config", "config_pairs"], multiple=True, metavar="KEY=VALUE",
                     help="A model-level setting of the pipelines' nodes (repeatable), e.g. -c ar_dtype=bf16."),
        click.Option(["--ui/--no-ui"], default=True, show_default=True,
                     help="Serve the web page at / (chat, video jobs); --no-ui: GET / is 404."),
        click.Option(["--log-level"], default="info", show_default=True,
                     type=click.Choice(["debug", "info", "warning", "error"])),
    ]

    @click.pass_context
    def serve(ctx, pipelines, config_pairs, **options):
        plugin_host, plugin_flags = _host(ctx), _plugin_flags(ctx)
        run_settings = {key: options.pop(key) for key in plugin_flags.settings}
        chosen = {flag: options.pop(flag.dest, None) for flag in plugin_flags.flags}
        chosen = {flag: value for flag, value in chosen.items() if value is not None and value != ()}
        try:
            _check_limits(options["max_body_mb"], options["max_text_body_mb"], options["shutdown_timeout"])
            plan = plan_pipelines(plugin_host, pipelines, chosen, config_pairs, run_settings)
            if not pipelines:
                plan = with_models(plugin_host, plan)
            run_server(plugin_host, plan, serve_settings(list(plan), **options))
        except UserError as exc:
            raise _UsageError(" ".join(str(exc).split())) from None
        except OmniError as exc:
            raise click.ClickException(" ".join(str(exc).split())) from None

    return ServeCommand("serve", callback=serve, params=options,
                        help="Serve pipelines over an OpenAI-compatible HTTP API (chat, completions, videos, "
                             "audio).\n\nModel flags come from the installed node types, as for `omni run`; see "
                             "docs/serving.md.")


class _UsageError(click.ClickException):
    exit_code = 2


SHUTDOWN_GRACE_S = 3.0  # after --shutdown-timeout, what is left is failed; its error events get this long to go out


def timeout_options() -> list[click.Option]:
    seconds = click.FloatRange(min=0)
    return [
        click.Option(["--header-timeout"], type=seconds, default=Timeouts().header, show_default=True,
                     help="Seconds a request's headers may take to arrive; a slower connection is closed (0: none)."),
        click.Option(["--body-timeout"], type=seconds, default=Timeouts().body, show_default=True,
                     help="Seconds a request's body may take to arrive after its headers; slower is 408 (0: none)."),
        click.Option(["--keep-alive-timeout"], type=seconds, default=Timeouts().keep_alive, show_default=True,
                     help="Seconds an idle kept-alive connection stays open."),
    ]


def plan_pipelines(host, names, chosen: dict[Flag, object], config_pairs,
                   run_settings: dict | None = None) -> dict[str, tuple[str, dict]]:
    """name -> (pipeline, config and run settings) for each pipeline to serve; a flag or -c key that no served
    pipeline uses is refused. With no --pipeline: every registered pipeline whose graph validates."""
    from omni_kernel.core.planner import Planner

    registry = host.registry
    explicit = bool(names)
    if not names:
        names = sorted(registry.pipelines)
    plans = {}
    for name in names:
        plan = Planner(registry).plan(name)
        try:
            host.builder.validate(plan)
        except GraphError as exc:
            if explicit:
                raise
            log.info("not serving %s: %s", name, " ".join(str(exc).split()))
            continue
        plans[name] = plan
    if not plans:
        raise UserError("no pipeline to serve: install a plugin that registers one (see `omni pipelines`)")
    used_flags = {f for f in chosen if any(f.name in declared(registry, p, "config") for p in plans.values())}
    if unused := [f.flag for f in chosen if f not in used_flags]:
        raise UserError(f"no served pipeline uses {', '.join(unused)}")
    pair_keys = {item.partition("=")[0].strip().replace("-", "_") for item in config_pairs}
    known = {k for p in plans.values() for k in declared(registry, p, "config")}
    if unknown := sorted(pair_keys - known):
        raise UserError(f"invalid {unknown[0]}: no served pipeline has the config key {unknown[0]!r}; "
                        f"valid config keys: {', '.join(sorted(known)) or 'none'}")
    run_settings = {k: v for k, v in (run_settings or {}).items() if v is not None and v != ""}
    out = {}
    for name, plan in plans.items():
        mine = declared(registry, plan, "config")
        flags = {f: v for f, v in chosen.items() if f.name in mine}
        pairs = tuple(i for i in config_pairs if i.partition("=")[0].strip().replace("-", "_") in mine)
        out[name] = (name, {**values(registry, plan, flags, {"config": pairs})["config"], **run_settings})
    return out


def with_models(host, plan: dict[str, tuple[str, dict]]) -> dict[str, tuple[str, dict]]:
    """With no --pipeline, the planned pipelines whose models are there: one whose default model was never fetched
    (a speech pipeline before `omni models fetch`) is left out, saying so, instead of stopping the server."""
    out = {name: entry for name, entry in plan.items() if _models_there(host, name, entry[1])}
    if not out:
        raise UserError("no pipeline to serve: the models of every pipeline are missing (see `omni models list`)")
    return out


def _models_there(host, name: str, config: dict) -> bool:
    """Whether the pipeline's settings check without a ModelError (e.g. a default model never fetched: `omni models
    fetch`), logging why not."""
    from omni_kernel.core.errors import ModelError

    from .async_omni import check_before_building

    try:
        check_before_building(host, name, config)
    except ModelError as exc:
        log.info("not serving %s: %s", name, " ".join(str(exc).split()))
        return False
    return True


def serve_settings(served: list[str], *, host: str, port: int, api_key: str | None, aliases, output_dir, jobs_db,
                   on_restart: str, video_ttl: float, max_body_mb: float, max_text_body_mb: float, allowed_origins,
                   max_in_flight: int, shutdown_timeout: float, header_timeout: float, body_timeout: float,
                   keep_alive_timeout: float, ui: bool, log_level: str) -> ServeSettings:
    """The settings of `omni serve` from its flags (by their destinations), for the `served` pipelines (which
    --served-model-name names)."""
    output_dir = Path(output_dir).expanduser().absolute() if output_dir else default_output_dir()
    jobs_db = Path(jobs_db).expanduser().absolute() if jobs_db else output_dir / "jobs.sqlite"
    return ServeSettings(
        output_dir=output_dir, api_key=api_key or None, video_ttl=video_ttl or None, max_body_mb=max_body_mb,
        max_text_body_mb=max_text_body_mb, allowed_origins=tuple(allowed_origins), shutdown_timeout=shutdown_timeout,
        aliases=parse_aliases(aliases, served), on_restart=on_restart, ui=ui,
        timeouts=Timeouts(header_timeout, body_timeout, keep_alive_timeout), host=host, port=port,
        log_level=log_level, max_in_flight=max_in_flight or None, jobs_db=jobs_db)


def run_server(plugin_host, plan: dict[str, tuple[str, dict]], settings: ServeSettings) -> None:
    """Serve the `plan` of `plan_pipelines` with `settings` until SIGINT or SIGTERM."""
    _return_large_blocks()
    # locked before any model loads: a second server is refused at once
    store = JobStore(settings.jobs_db, settings.output_dir)
    try:
        _serve(plugin_host, plan, store, settings)
    finally:
        store.close()
    log.info("stopped")


def default_output_dir() -> Path:
    """Where videos are kept without --output-dir: serve/videos under the omni cache (OMNI_CACHE_DIR, else
    ~/.cache/omni), kept across restarts so the job store's files outlive the process."""
    from omni_kernel.util.files import cache_dir

    return (cache_dir() / "serve" / "videos").absolute()


def _serve(plugin_host, plan, store: JobStore, settings: ServeSettings) -> None:
    import uvicorn

    from .async_omni import AsyncOmni
    from .server import create_app
    from .timeouts import TimedH11Protocol

    started = time.perf_counter()
    async_omni = AsyncOmni.build(plan, plugin_host, settings.max_in_flight)  # checks every pipeline, then builds
    for stage in async_omni.snapshot.stages:  # what each stage reports of itself (its worker's, if placed in one)
        if stage.stats.kv_blocks_total is not None:
            log.info("%s/%s: %d KV blocks", stage.pipeline, stage.node, stage.stats.kv_blocks_total)
    log.info("built %s in %.1fs", ", ".join(async_omni.omnis), time.perf_counter() - started)
    log.info("videos in %s, job store %s (--on-restart %s)", settings.output_dir, store.path, settings.on_restart)
    app = create_app(async_omni, settings, store)
    # uvicorn cancels what still runs at its graceful timeout (a stream cut mid-way, a CancelledError logged):
    # the app fails what is left at --shutdown-timeout itself (server.py), so uvicorn waits a little longer.
    timeouts = settings.timeouts
    config = uvicorn.Config(app.state.asgi, host=settings.host, port=settings.port, log_level=settings.log_level,
                            access_log=False, timeout_graceful_shutdown=settings.shutdown_timeout + SHUTDOWN_GRACE_S,
                            lifespan="on", http=functools.partial(TimedH11Protocol, header_timeout=timeouts.header),
                            timeout_keep_alive=timeouts.keep_alive)
    server = uvicorn.Server(config)
    app.state.should_exit = lambda: server.should_exit  # the lifespan's drain (server.py) starts with uvicorn's exit
    previous = _pass_signals_to(server)
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        async_omni.shutdown(0)
        for omni in async_omni.omnis.values():  # stop the placed stages, if any
            omni.close()


def _pass_signals_to(server) -> dict:
    """Handlers that hand SIGINT and SIGTERM to uvicorn's own: uvicorn installs its handlers while it runs, and
    once it has shut down it raises the signal again to the handlers it found, these, so a graceful stop exits
    0 instead of dying of the signal. Returns the handlers they replace."""
    return {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}


def _check_limits(max_body_mb: float, max_text_body_mb: float, shutdown_timeout: float) -> None:
    if max_body_mb <= 0:
        raise UserError(f"invalid --max-body-mb: {max_body_mb} is not > 0")
    if max_text_body_mb <= 0:
        raise UserError(f"invalid --max-text-body-mb: {max_text_body_mb} is not > 0")
    if shutdown_timeout < 0:
        raise UserError(f"invalid --shutdown-timeout: {shutdown_timeout} is not >= 0")


def parse_aliases(aliases, served: list[str]) -> dict[str, str]:
    """--served-model-name NAME[=PIPELINE] -> {NAME: PIPELINE}; without =PIPELINE, the one served pipeline."""
    alias_map = {}
    for alias in aliases:
        name, sep, target = alias.partition("=")
        target = target if sep else (served[0] if len(served) == 1 else "")
        if target not in served:
            raise UserError(f"invalid --served-model-name {alias!r}: name a served pipeline as NAME=PIPELINE "
                            f"(served: {', '.join(served)})")
        alias_map[name] = target
    return alias_map


MMAP_THRESHOLD = 1 << 20


def _return_large_blocks() -> None:
    """Have glibc serve every allocation of 1 MiB or more with its own mapping, returned to the system when freed.
    Its default threshold grows to the largest block freed so far, after which a refused 18 MB request body (and
    its parsed copies) stays in the heap: RSS grew by ~50 MB a request. Elsewhere than glibc: nothing to do."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD; setting it also stops its dynamic growth
    except (OSError, AttributeError):
        log.debug("cannot set the malloc mmap threshold here", exc_info=True)
