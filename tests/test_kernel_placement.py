"""Placements other than inproc come from plugins (omni-workers): without one, a run that asks for one is
refused in one line naming the plugin to install; inproc needs none."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from omni_kernel import Omni
from omni_kernel.builtin.echo import KernelPlugin
from omni_kernel.cli import main
from omni_kernel.core.errors import UserError
from omni_kernel.plugins import PluginHost


def kernel_only() -> PluginHost:
    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel")
    return host


@pytest.mark.parametrize("placement", ["process", "ray", "echo=process"])
def test_a_placement_no_plugin_provides_is_refused(placement):
    with pytest.raises(UserError, match="placement '(process|ray)' needs the omni-workers plugin"):
        Omni("echo", host=kernel_only(), placement=placement)


def test_the_cli_refuses_it_in_one_line_exit_2():
    result = CliRunner().invoke(main, ["run", "--pipeline", "echo", "--prompt", "hi", "--placement", "process"],
                                obj={"host": kernel_only()})
    assert result.exit_code == 2
    assert "placement 'process' needs the omni-workers plugin" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_inproc_needs_no_plugin():
    with Omni("echo", host=kernel_only(), placement="inproc") as omni:
        assert omni.generate("a b c").text == "a b c"
        assert omni.graph.workers is None


def test_worker_threads_is_an_integer_or_shared():
    from omni_kernel.core.errors import InvalidParameter
    from omni_kernel.core.placement import RunSettings

    for good in (None, 1, 4, "shared"):
        RunSettings(worker_threads=good).check()
    for bad in (0, -1, True, "2", "all"):
        with pytest.raises(InvalidParameter, match="is not an integer >= 1 or 'shared'"):
            RunSettings(worker_threads=bad).check()


@pytest.mark.parametrize(("args", "says"), [(["--worker-threads", "all"], "'all' is not an integer >= 1 or 'shared'"),
                                            (["--max-restarts", "x"], "'x' is not a valid integer")])
def test_bad_worker_flags_are_refused_in_one_line_exit_2(args, says):
    result = CliRunner().invoke(main, ["run", "--pipeline", "echo", "--prompt", "hi", *args],
                                obj={"host": kernel_only()})
    assert result.exit_code == 2
    assert says in result.output and len(result.output.strip().splitlines()) == 1


def test_worker_flags_are_run_settings_inproc_ignores():
    result = CliRunner().invoke(main, ["run", "--pipeline", "echo", "--prompt", "a b", "--worker-threads", "shared",
                                       "--max-restarts", "0"], obj={"host": kernel_only()})
    assert result.exit_code == 0, result.output
    assert "a b" in result.output
