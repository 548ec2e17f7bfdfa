"""The `omni` command line through click's CliRunner."""

from __future__ import annotations

import importlib.metadata
import io
import json
import sys

import attrs
import click
import pytest
from click.testing import CliRunner

from omni_kernel import hookimpl, option
from omni_kernel.api import Omni
from omni_kernel.builtin.echo import KernelPlugin, build_echo_engine, build_echo_stage, echo_engine_settings
from omni_kernel.cli import main
from omni_kernel.core.errors import InputError
from omni_kernel.core.graph import EdgeSpec, NodeSpec, PipelinePlan
from omni_kernel.core.params import ARParams, integer
from omni_kernel.core.planner import GraphBuilder
from omni_kernel.core.registry import NodeType
from omni_kernel.plugins import PluginHost


@attrs.frozen
class ShoutConfig:
    voice: str = option("plain", help="how the stage shouts", flag="--voice", choices=("plain", "loud"))


@attrs.frozen
class ShoutParams(ARParams):
    volume: int = option(1, help="exclamation marks", type=int, flag="--volume", validator=integer(1, 9))


def build_shout_stage(node, config, policy, settings, engine):
    assert isinstance(config, ShoutConfig)
    return build_echo_stage(node, None, None, settings, engine)


class ExtrasPlugin:
    """A command, a connector and a two-node echo pipeline, registered inline."""

    @hookimpl
    def omni_register_commands(self, register):
        @click.command("greet")
        @click.option("--name", default="world")
        def greet(name):
            """Say hello."""
            click.echo(f"hello {name}")

        register(greet)

    @hookimpl
    def omni_register_node_types(self, register):
        register(NodeType("extras.shout", "ar", engine_settings=echo_engine_settings, engine=build_echo_engine,
                          stage=build_shout_stage, config=ShoutConfig, params=ShoutParams))

    @hookimpl
    def omni_register_connectors(self, register):
        register(Relay())

    @hookimpl
    def omni_register_pipelines(self, register):
        register(PipelinePlan("echo_twice", [NodeSpec("first", "kernel.echo"), NodeSpec("second", "kernel.echo",
                                                                                        final=True)],
                              [EdgeSpec("first", "second", "relay")], description="echo, echoed again"))
        register(PipelinePlan("shout", [NodeSpec("shout", "extras.shout", final=True)]))
        register(PipelinePlan("needs_wan", [NodeSpec("wan", "diffusion.wan22_i2v", final=True,
                                                     plugin_hint="omni-wan")]))


class Relay:
    name, source_kind, target_kind = "relay", "ar", "ar"

    def convert(self, output, request):
        from omni_kernel.core.request import StageInput
        return StageInput(request.request_id, f"[{output.text}]", trace={"relay.chars": len(output.text)})


@pytest.fixture
def host():
    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel", "0.1.0")
    host.register(ExtrasPlugin(), "extras", "2.0")
    return host


def omni(host, *args):
    return CliRunner().invoke(main, list(args), obj={"host": host})


def test_run_streams_the_text_and_writes_the_trace(host, tmp_path):
    trace_path = tmp_path / "deep" / "t.json"
    result = omni(host, "run", "--pipeline", "echo", "--prompt", "héllo 世界", "--stream", "--trace-json",
                  str(trace_path))
    assert result.exit_code == 0, result.output
    assert result.stdout == "héllo 世界\n"
    trace = json.loads(trace_path.read_text(encoding="utf-8"))
    assert trace["ar.streaming"] is True and trace["ar.input_tokens"] == 2 and trace["request.pipeline"] == "echo"
    assert "ar.output_tokens" in result.stderr and "Traceback" not in result.output
    assert not list(trace_path.parent.glob("*.tmp"))


def test_run_without_stream_prints_the_text_once(host):
    result = omni(host, "run", "--pipeline", "echo", "--prompt", "a b c", "--seed", "3")
    assert result.exit_code == 0 and result.stdout == "a b c\n"


def test_run_json_prints_one_object(host):
    result = omni(host, "run", "--pipeline", "echo", "--prompt", "héllo 世界", "--json", "--stream")
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["output"] == {"text": "héllo 世界"} and body["stop_reason"] == "eos" and body["pipeline"] == "echo"
    assert body["trace"]["ar.stop_reason"] == "eos" and result.stdout.count("\n") == 1


def test_multi_stage_stream_keeps_stdout_for_the_final_node(host):
    result = omni(host, "run", "--pipeline", "echo_twice", "--prompt", "x y", "--stream")
    assert result.exit_code == 0, result.output
    assert result.stdout == "[x y]\n"
    assert result.stderr.startswith("x y\n") and "relay.chars" in result.stderr


def one_line_error(result, code=2) -> str:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_unknown_pipeline_lists_the_known_ones(host):
    line = one_line_error(omni(host, "run", "--pipeline", "nope", "--prompt", "x"))
    assert "unknown pipeline 'nope'" in line and "echo, echo_twice, needs_wan, shout" in line


@pytest.mark.parametrize("flag", [["--image", "x.png"], ["--volume", "3"], ["--voice", "loud"]])
def test_a_flag_the_pipeline_does_not_use_is_refused(host, flag):
    line = one_line_error(omni(host, "run", "--pipeline", "echo", "--prompt", "x", *flag))
    assert "'echo'" in line and flag[0] in line


def test_a_third_party_node_type_adds_its_own_flags_and_keys(host):
    result = omni(host, "run", "--pipeline", "shout", "--prompt", "a b", "--volume", "3", "--voice", "loud",
                  "-o", "max_tokens=1", "-c", "voice=plain")
    assert result.exit_code == 0, result.output
    assert result.stdout == "a\n"
    line = one_line_error(omni(host, "run", "--pipeline", "shout", "--prompt", "x", "--volume", "12"))
    assert "volume" in line and "between 1 and 9" in line
    line = one_line_error(omni(host, "run", "--pipeline", "shout", "--prompt", "x", "-c", "voise=loud"))
    assert "has no config key 'voise'; valid config keys: voice" in line
    line = one_line_error(omni(host, "run", "--pipeline", "echo", "--prompt", "x", "-o", "max_tokns=1"))
    assert "has no request parameter 'max_tokns'" in line and "max_tokens" in line
    line = one_line_error(omni(host, "run", "--pipeline", "echo", "--prompt", "x", "-o", "max_tokens"))
    assert "is not key=value" in line


def test_run_help_names_the_plugin_of_each_flag(host):
    help = " ".join(omni(host, "run", "--help").stdout.split())
    assert "--volume INTEGER Exclamation marks [extras]" in help and "--voice [plain|loud]" in help
    assert "Random seed for sampling and noise [omni_kernel, extras]" in help


@pytest.fixture
def builds(monkeypatch) -> list:
    """The graphs `omni run` builds (none here: a build that starts records itself and fails)."""
    started = []

    def build(self, plan, *args, **kwargs):
        started.append(plan.name)
        raise AssertionError(f"built {plan.name!r}")

    monkeypatch.setattr(GraphBuilder, "build", build)
    return started


@pytest.mark.parametrize("pipeline", ["echo", "echo_twice"])
@pytest.mark.parametrize("prompt", ["", " ", " \n\t "])
def test_empty_prompt_is_one_line_exit_2_before_anything_is_built(host, builds, pipeline, prompt):
    """The kernel's one prompt rule (params.check_prompt), in the check before loading: every pipeline whose nodes
    read the prompt gives the same answer, and no engine is built."""
    line = one_line_error(omni(host, "run", "--pipeline", pipeline, "--prompt", prompt))
    assert line == "Error: the prompt is empty" and builds == []


@pytest.mark.parametrize("prompt", ["", " "])
def test_the_python_api_refuses_an_empty_prompt_at_submit(host, prompt):
    omni = Omni("echo", host=host)
    with pytest.raises(InputError, match="^the prompt is empty$"):
        omni.generate(prompt)
    assert not omni.has_unfinished()


def test_missing_node_type_says_which_plugin_to_install(host):
    line = one_line_error(omni(host, "run", "--pipeline", "needs_wan", "--prompt", "x"))
    assert "omni-wan" in line and "unknown_node_type" in line


def test_click_usage_errors_are_one_line_exit_2(host):
    line = one_line_error(omni(host, "run", "--pipeline", "echo", "--prompt", "x", "--seed", "many"))
    assert "'many' is not a valid integer" in line and "run --help`" in line
    assert "Missing option '--prompt'" in one_line_error(omni(host, "run", "--pipeline", "echo"))
    assert "No such option '--bogus'" in one_line_error(omni(host, "run", "--bogus"))
    assert "No such command 'nope'" in one_line_error(omni(host, "nope"))


def test_invalid_seed_range_is_a_user_error(host):
    line = one_line_error(omni(host, "run", "--pipeline", "echo", "--prompt", "x", "--seed", "-1"))
    assert "seed" in line


def test_plugins_lists_versions_and_registrations(host):
    result = omni(host, "plugins")
    assert result.exit_code == 0
    assert "omni_kernel 0.1.0 [loaded]" in result.stdout and "extras 2.0 [loaded]" in result.stdout
    assert "  commands: greet" in result.stdout and "  pipelines: echo_twice, needs_wan" in result.stdout


def test_pipelines_lists_nodes_edges_and_plugin(host):
    result = omni(host, "pipelines")
    assert result.exit_code == 0
    out = result.stdout
    assert "echo (from omni_kernel)" in out and "  node echo: kernel.echo [final]" in out
    assert "echo_twice (from extras): echo, echoed again" in out and "  edge first -> second via relay" in out


def test_plugin_commands_join_the_cli(host):
    result = omni(host, "greet", "--name", "omni")
    assert (result.exit_code, result.stdout) == (0, "hello omni\n")
    assert "greet" in omni(host, "--help").stdout




def test_broken_plugin_warning_is_printed_once(monkeypatch):
    class Broken:
        name, dist = "broken", type("D", (), {"version": "0.0.1"})()

        def load(self):
            raise ImportError("No module named 'nothing_here'")

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [Broken()])
    result = CliRunner().invoke(main, ["run", "--pipeline", "echo", "--prompt", "hi"])
    assert result.exit_code == 0 and result.stdout == "hi\n"
    warnings = [line for line in result.stderr.splitlines() if "broken" in line]
    assert warnings == ["omni: plugin broken 0.0.1 failed to load and was skipped: ImportError: No module named "
                        "'nothing_here'"]


def test_ctrl_c_aborts_the_request_and_exits_1(host):
    stage_types = host.registry.node_types

    class Interrupting:
        def add_request(self, item):
            pass

        def run(self, batch):
            raise KeyboardInterrupt

        def free(self, request_id):
            freed.append(request_id)

    freed: list[str] = []
    echo = stage_types["kernel.echo"].item

    def build(settings):
        engine = echo.engine(settings)
        engine.runner = Interrupting()
        return engine

    stage_types["kernel.echo"] = attrs.evolve(stage_types["kernel.echo"], item=attrs.evolve(echo, engine=build))
    line = one_line_error(omni(host, "run", "--pipeline", "echo", "--prompt", "a b"), code=1)
    assert line == "Error: interrupted; the request was aborted and no partial output was kept"
    assert len(freed) == 1


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_draws_one_line_per_phase(monkeypatch):
    """Each node's phase gets its own tqdm line on a terminal, ended when the phase reaches its total."""
    from omni_kernel.cli import run as cli_run
    from omni_kernel.core.events import RequestFinished, StageProgress

    class Fake:
        class graph:
            finals = ["wan"]

        @staticmethod
        def generate_stream(request):
            for step in (1, 2, 3):
                yield StageProgress("r", "wan", step, 3, "denoise")
            yield StageProgress("r", "wan", 1, 1, "decode")
            yield RequestFinished("r", "done")

    err = _TTY()
    monkeypatch.setattr(sys, "stderr", err)
    assert cli_run._drive(Fake, None, stream=False) == ("done", set())
    lines = [line.split("\r")[-1] for line in err.getvalue().split("\n")[:-1]]  # each line as last drawn
    assert [line.split(" ")[:2] for line in lines] == [["wan", "denoise"], ["wan", "decode"]], lines
    assert " 3/3 [" in lines[0] and " 1/1 [" in lines[1], lines
