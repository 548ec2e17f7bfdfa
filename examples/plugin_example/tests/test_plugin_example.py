"""The example plugin, registered inline with a fresh PluginHost: no installation needed."""

import json

import attrs
import pytest
from click.testing import CliRunner

from omni_kernel import GraphError, Omni, TokenDelta, UserError
from omni_kernel.builtin.echo import KernelPlugin
from omni_kernel.cli import main
from omni_kernel.plugins import PluginHost
from omni_plugin_example.plugin import ExamplePlugin


@pytest.fixture
def host():
    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel")
    host.register(ExamplePlugin(), "omni_plugin_example", "0.1.0")
    return host


def test_it_registers_a_node_type_a_connector_and_a_pipeline(host):
    assert host.registry.by_plugin("omni_plugin_example") == {
        "node types": ["text.upper"], "connectors": ["ar_to_text"], "pipelines": ["echo_upper"], "commands": []}


def test_the_pipeline_runs_through_both_stages(host):
    omni = Omni("echo_upper", host=host)
    events = list(omni.generate_stream("  héllo wörld, omni ", stream=True))
    result = events[-1].result
    assert result.text == "HÉLLO WÖRLD, OMNI"
    assert result.outputs["echo"].text == "  héllo wörld, omni "
    upper = [e.text for e in events if isinstance(e, TokenDelta) and e.node_id == "upper"]
    assert len(upper) == 5 and "".join(upper) == result.text
    assert result.trace["upper.chars"] == 17 and result.trace["ar_to_text.chars"] == 20
    assert result.trace["ar.stop_reason"] == "eos"


def test_requests_run_side_by_side(host):
    omni = Omni("echo_upper", host=host)
    for i in range(3):
        omni.submit(omni.request(f"request {i} " * (i + 1), request_id=f"r{i}"))
    finished = {}
    while omni.has_unfinished():
        for event in omni.step():
            if hasattr(event, "result"):
                finished[event.request_id] = event.result.text
    assert finished == {f"r{i}": (f"REQUEST {i} " * (i + 1)).strip() for i in range(3)}


def test_blank_text_is_a_user_error(host):
    # The entry node (the kernel's echo) refuses a blank prompt by the kernel's one rule, before this plugin's node
    with pytest.raises(UserError, match="the prompt is empty"):
        Omni("echo_upper", host=host).generate("   ")


def test_omni_run_streams_the_final_stage_to_stdout(host, tmp_path):
    trace = tmp_path / "t.json"
    result = CliRunner().invoke(main, ["run", "--pipeline", "echo_upper", "--prompt", "héllo", "--stream",
                                       "--trace-json", str(trace)], obj={"host": host})
    assert result.exit_code == 0, result.output
    assert result.stdout == "HÉLLO\n"
    assert json.loads(trace.read_text(encoding="utf-8"))["upper.chars"] == 5


def test_its_own_flag_and_config_key_reach_the_stage(host):
    result = CliRunner().invoke(main, ["run", "--pipeline", "echo_upper", "--prompt", "hi", "--shout",
                                       "-c", "upper_max_batch=2"], obj={"host": host})
    assert result.exit_code == 0, result.output
    assert result.stdout == "HI!\n"
    help = " ".join(CliRunner().invoke(main, ["run", "--help"], obj={"host": host}).stdout.split())
    assert "--shout End the upper-cased text with '!' [omni_plugin_example]" in help
    with pytest.raises(UserError, match="upper_max_batch"):
        Omni("echo_upper", host=host, upper_max_batch=0)


def test_its_node_policy_is_checked_when_the_plan_is_built(host):
    plan = host.registry.pipelines["echo_upper"].item
    upper = plan.node("upper")
    misspelt = attrs.evolve(plan, nodes=[plan.node("echo"), attrs.evolve(upper, policy={"chunks": 4})])
    with pytest.raises(GraphError, match="no policy key 'chunks'; valid keys: chunk, strip"):
        Omni(misspelt, host=host)
    with pytest.raises(GraphError, match="chunk"):
        Omni(attrs.evolve(plan, nodes=[plan.node("echo"), attrs.evolve(upper, policy={"chunk": 0})]), host=host)


def test_nodes_with_equal_engine_settings_share_one_engine(host):
    first, second = Omni("echo_upper", host=host), Omni("echo_upper", host=host)
    assert first.graph.stages["upper"].engine is second.graph.stages["upper"].engine
    other = Omni("echo_upper", host=host, upper_max_batch=2)
    assert other.graph.stages["upper"].engine is not first.graph.stages["upper"].engine
