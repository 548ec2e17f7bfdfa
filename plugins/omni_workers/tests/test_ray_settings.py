"""`ray_resources` and `ray_rank_strategy`, the Ray placement's settings: parsed per node, refused in one line
(InvalidParameter; `omni run` exits 2) before anything is built. No Ray starts here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from omni_kernel import Omni
from omni_kernel.cli import main
from omni_kernel.core.errors import InvalidParameter
from omni_kernel.core.graph import NodeSpec
from omni_workers.settings import WorkersSettings, parse_ray_resources

sys.path.insert(0, str(Path(__file__).parent))
from worker_fakes import make_host  # noqa: E402


def test_ray_resources_per_node_run_wide_and_as_a_mapping():
    assert parse_ray_resources("video=GPU:1,bridge=CPU:2") == (None, {"video": {"GPU": 1.0},
                                                                     "bridge": {"CPU": 2.0}})
    assert parse_ray_resources("bridge=node_a:1+CPU:0.5, video=node_b:1") == (
        None, {"bridge": {"node_a": 1.0, "CPU": 0.5}, "video": {"node_b": 1.0}})
    assert parse_ray_resources("slot:1,video=GPU:1") == ({"slot": 1.0}, {"video": {"GPU": 1.0}})
    assert parse_ray_resources({"video": {"GPU": 1}, "bridge": "node_a:1"}) == (
        None, {"video": {"GPU": 1.0}, "bridge": {"node_a": 1.0}})
    settings = WorkersSettings(ray_resources="video=GPU:1,slot:2")
    assert settings.resources_of(NodeSpec("video", "t")) == {"GPU": 1.0}
    assert settings.resources_of(NodeSpec("bridge", "t")) == {"slot": 2.0}  # the run-wide value
    assert WorkersSettings().resources_of(NodeSpec("a", "t", resources={"GPU": 1})) == {"GPU": 1}  # the plan's
    assert WorkersSettings().resources_of(NodeSpec("a", "t")) == {"CPU": 1}


@pytest.mark.parametrize("value, bad", [("video=GPU", "'GPU'"), ("video=GPU:-1", "'GPU:-1'"),
                                        ("video=GPU:x", "'GPU:x'"), ("video=:1", "':1'"),
                                        ("video=GPU:1+", "'GPU:1+'"), ("video=G PU:1", "'G PU:1'"),
                                        ("video=GPU:inf", "'GPU:inf'")])
def test_bad_ray_resources_name_the_bad_part_and_the_form(value, bad):
    with pytest.raises(InvalidParameter) as info:
        WorkersSettings(ray_resources=value)
    message = str(info.value)
    assert message.startswith(f"invalid ray_resources: {bad} is not NAME:AMOUNT[+NAME:AMOUNT...]"), message
    assert "\n" not in message


def test_ray_resources_name_nodes_of_the_plan_placed_on_ray():
    with pytest.raises(InvalidParameter, match="ray_resources: pipeline 'fake_slow' has no node 'video'; its nodes: "
                                               "words, render"):
        Omni("fake_slow", host=make_host(), placement="ray", ray_resources="video=GPU:1")
    with pytest.raises(InvalidParameter, match="node 'words' runs process; Ray resources need placement ray"):
        Omni("fake_slow", host=make_host(), placement="process", ray_resources="words=CPU:1")
    with pytest.raises(InvalidParameter, match="ray_rank_strategy"):
        Omni("fake_slow", host=make_host(), placement="ray", ray_rank_strategy="ANYWHERE")


def test_cli_refuses_bad_ray_resources_in_one_line_exit_2():
    for value, says in [("words=CPU:-2", "invalid ray_resources: 'CPU:-2' is not NAME:AMOUNT"),
                        ("video=CPU:1", "invalid ray_resources: pipeline 'fake_slow' has no node 'video'")]:
        result = CliRunner().invoke(main, ["run", "--pipeline", "fake_slow", "--prompt", "hi", "--placement", "ray",
                                           "--ray-resources", value], obj={"host": make_host()})
        assert result.exit_code == 2 and says in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
    help_text = CliRunner().invoke(main, ["run", "--help"], obj={"host": make_host()}).output
    assert "--ray-resources" in help_text and "--ray-rank-strategy" in help_text
