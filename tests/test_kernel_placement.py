"""Placements other than inproc come from plugins: without one, a run that asks for one is refused in one line
naming the installed placements; inproc needs none. A placement declares its own settings: the kernel takes their
keys out of a run's keywords and makes flags of them without knowing what they mean."""

from __future__ import annotations

import attrs
import pytest
from click.testing import CliRunner

from omni_kernel import Omni, hookimpl
from omni_kernel.builtin.echo import KernelPlugin
from omni_kernel.cli import main
from omni_kernel.core.errors import InvalidParameter, UserError
from omni_kernel.core.params import integer, option
from omni_kernel.plugins import PluginHost


def kernel_only() -> PluginHost:
    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel")
    return host


@pytest.mark.parametrize("placement", ["process", "ray", "echo=process"])
def test_a_placement_no_plugin_provides_is_refused(placement):
    with pytest.raises(UserError, match="placement '(process|ray)' is not installed; installed placements: inproc"):
        Omni("echo", host=kernel_only(), placement=placement)


def test_the_cli_refuses_it_in_one_line_exit_2():
    result = CliRunner().invoke(main, ["run", "--pipeline", "echo", "--prompt", "hi", "--placement", "process"],
                                obj={"host": kernel_only()})
    assert result.exit_code == 2
    assert "placement 'process' is not installed" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_inproc_needs_no_plugin():
    with Omni("echo", host=kernel_only(), placement="inproc") as omni:
        assert omni.generate("a b c").text == "a b c"
        assert omni.graph.placed == []


@attrs.frozen
class CopiesSettings:
    copies: int = option(1, help="copies of each placed stage", type=int, flag="--copies", validator=integer(1))


@attrs.define
class CopiesPlacement:
    """A third-party placement that builds its stages in this process, counting what it was given."""

    name: str = "copies"
    settings: type = CopiesSettings
    checked: list = attrs.Factory(list)
    built: list = attrs.Factory(list)
    builder: object = None  # the host's GraphBuilder, which builds the stages here
    fail_fast: bool | None = None  # what the last build was given

    def check(self, settings: CopiesSettings, plan, placement_of) -> None:
        self.checked.append(settings.copies)

    def build(self, nodes, settings: CopiesSettings, host_factory, handle, fail_fast=False):
        self.built.append((settings.copies, [b.node.id for b in nodes]))
        self.fail_fast = fail_fast
        return {b.node.id: self.builder.stage(b) for b in nodes}, None


def host_with_copies() -> tuple[PluginHost, CopiesPlacement]:
    host = kernel_only()
    placement = CopiesPlacement()
    placement.builder = host.builder

    class Plugin:
        @hookimpl
        def omni_register_placements(self, register):
            register(placement)

    host.register(Plugin(), "copies")
    return host, placement


def test_a_placement_declares_its_settings_and_gets_its_own_instance():
    host, placement = host_with_copies()
    omni = Omni("echo", host=host, placement="copies", copies=3)
    assert omni.generate("a b").text == "a b"
    assert placement.built == [(3, ["echo"])] and placement.checked == [3]


def test_a_placement_is_built_with_the_runs_fail_fast():
    """`fail_fast` is a kernel run setting (RunSettings), not a config key, handed to each placement's build."""
    host, placement = host_with_copies()
    Omni("echo", host=host, placement="copies", fail_fast=True)
    assert placement.fail_fast is True
    Omni("echo", host=host, placement="copies")
    assert placement.fail_fast is False


def test_a_declared_setting_is_validated_and_an_undeclared_key_refused():
    host, _ = host_with_copies()
    with pytest.raises(InvalidParameter, match="copies"):
        Omni("echo", host=host, copies=0)
    with pytest.raises(UserError, match="no config key 'replicas'"):
        Omni("echo", host=kernel_only(), replicas=2)


def test_the_cli_makes_flags_of_the_declared_settings():
    host, placement = host_with_copies()
    result = CliRunner().invoke(main, ["run", "--pipeline", "echo", "--prompt", "a b", "--placement", "copies",
                                       "--copies", "2"], obj={"host": host})
    assert result.exit_code == 0, result.output
    assert placement.built == [(2, ["echo"])]
    bad = CliRunner().invoke(main, ["run", "--pipeline", "echo", "--prompt", "a", "--copies", "x"], obj={"host": host})
    assert bad.exit_code == 2 and "'x' is not a valid int" in bad.output
    assert len(bad.output.strip().splitlines()) == 1
