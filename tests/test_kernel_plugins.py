"""Plugin loading: fake entry points, a broken plugin, the OMNI_PLUGINS allowlist, duplicates, inline plugins."""

from __future__ import annotations

import importlib.metadata
import logging
import types

import pytest

from omni_kernel import hookimpl
from omni_kernel.builtin.echo import ECHO_NODE, KernelPlugin
from omni_kernel.core.errors import DuplicateRegistration
from omni_kernel.core.graph import NodeSpec, PipelinePlan
from omni_kernel.core.registry import NodeType
from omni_kernel.plugins import ENTRY_POINT_GROUP, PluginHost, load_host


class FakeEntryPoint:
    def __init__(self, name, target, version="1.2.3"):
        self.name, self.target = name, target
        self.dist = types.SimpleNamespace(version=version) if version else None
        self.loads = 0

    def load(self):
        self.loads += 1
        if isinstance(self.target, BaseException):
            raise self.target
        return self.target


@pytest.fixture
def entry_points(monkeypatch):
    """Replace the installed plugins with a list the test fills in."""
    installed: list[FakeEntryPoint] = []

    def fake(group=None, **kwargs):
        assert group == ENTRY_POINT_GROUP
        return list(installed)

    monkeypatch.setattr(importlib.metadata, "entry_points", fake)
    return installed


@pytest.fixture
def warnings(omni_logger, monkeypatch):
    monkeypatch.setattr(omni_logger, "propagate", True)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    omni_logger.addHandler(handler)
    yield records
    omni_logger.removeHandler(handler)


def pipeline_plugin(name: str, node_type: str = "kernel.echo"):
    """A plugin class registering pipeline `name` made of one node."""

    class Plugin:
        @hookimpl
        def omni_register_pipelines(self, register):
            register(PipelinePlan(name, [NodeSpec("n", node_type, final=True)]))

    return Plugin


def test_broken_plugin_warns_once_with_name_and_version_and_the_others_load(entry_points, warnings):
    good_a, good_b = pipeline_plugin("alpha"), pipeline_plugin("beta")
    entry_points += [FakeEntryPoint("a_good", good_a), FakeEntryPoint("broken", ImportError("No module named 'torchx'"),
                                                                       "0.9.1"),
                     FakeEntryPoint("b_good", good_b, None)]
    host = load_host()
    assert sorted(host.registry.pipelines) == ["alpha", "beta", "echo"]
    mine = [r for r in warnings if r.levelno >= logging.WARNING]
    assert len(mine) == 1
    message = mine[0].getMessage()
    assert "broken" in message and "0.9.1" in message and "No module named 'torchx'" in message
    status = {p.name: (p.version, p.status) for p in host.plugins}
    assert status == {"omni_kernel": (status["omni_kernel"][0], "loaded"), "a_good": ("1.2.3", "loaded"),
                      "broken": ("0.9.1", "failed"), "b_good": ("unknown", "loaded")}


def unbuilt_node(name: str) -> NodeType:
    """A node type whose parts are never called (these tests only register it)."""
    return NodeType(name, "ar", engine_settings=lambda node, config, policy: None, engine=lambda settings: None,
                    stage=lambda node, config, policy, settings, engine: None)


def test_a_plugin_written_for_the_old_node_type_form_is_refused_at_load_in_one_line(entry_points, warnings):
    class OldForm:
        @hookimpl
        def omni_register_node_types(self, register):
            register(NodeType("old.node", "ar", lambda node, config: None))

    entry_points += [FakeEntryPoint("old", OldForm, version="0.3.0")]
    host = load_host()
    assert "old.node" not in host.registry.node_types
    message = warnings[0].getMessage()
    assert "old 0.3.0" in message and "NodeType(factory=...) is the old form" in message
    assert "engine_settings=, engine= and stage=" in message and "\n" not in message


def test_plugin_whose_hook_raises_is_skipped_whole(entry_points, warnings):
    class HalfBroken:
        @hookimpl
        def omni_register_node_types(self, register):
            register(unbuilt_node("half.node"))

        @hookimpl
        def omni_register_pipelines(self, register):
            raise RuntimeError("bad plan")

    entry_points += [FakeEntryPoint("half", HalfBroken), FakeEntryPoint("ok", pipeline_plugin("ok"))]
    host = load_host()
    assert "half.node" not in host.registry.node_types and "ok" in host.registry.pipelines
    assert host.pm.get_plugin("half") is None and {p.name: p.status for p in host.plugins}["half"] == "failed"
    assert "RuntimeError: bad plan" in warnings[0].getMessage()


def test_allowlist_restricts_which_plugins_load(entry_points, monkeypatch):
    entry_points += [FakeEntryPoint("one", pipeline_plugin("p1")), FakeEntryPoint("two", pipeline_plugin("p2")),
                     FakeEntryPoint("three", pipeline_plugin("p3"))]
    monkeypatch.setenv("OMNI_PLUGINS", " one, three ,")
    host = load_host()
    assert sorted(host.registry.pipelines) == ["echo", "p1", "p3"]
    assert {p.name: p.status for p in host.plugins}["two"] == "skipped"
    assert entry_points[1].loads == 0  # a plugin left out is never imported
    assert sorted(load_host(allowlist="two").registry.pipelines) == ["echo", "p2"]


def test_duplicate_registration_names_both_claimants(entry_points, warnings):
    entry_points += [FakeEntryPoint("first", pipeline_plugin("shared")),
                     FakeEntryPoint("second", pipeline_plugin("shared"))]
    host = load_host()
    assert host.registry.pipelines["shared"].plugin == "first"
    message = warnings[0].getMessage()
    assert "'shared'" in message and "'first'" in message and "'second'" in message
    assert {p.name: p.status for p in host.plugins}["second"] == "failed"


def test_inline_plugins_register_directly_and_duplicates_raise():
    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel", "0.1.0")
    assert host.registry.node_types["kernel.echo"].item is ECHO_NODE
    assert host.registry.by_plugin("omni_kernel") == {"node types": ["kernel.echo"], "connectors": [],
                                                      "pipelines": ["echo"], "commands": []}

    class Clash:
        @hookimpl
        def omni_register_node_types(self, register):
            register(unbuilt_node("mine.node"))
            register(unbuilt_node("kernel.echo"))

    with pytest.raises(DuplicateRegistration, match="node type 'kernel.echo'.*'omni_kernel'.*'clash'"):
        host.register(Clash(), "clash")
    assert "mine.node" not in host.registry.node_types  # all or nothing
    assert host.pm.get_plugin("clash") is None
    host.register(pipeline_plugin("later")(), "later")  # the host still works
    assert "later" in host.registry.pipelines


def test_module_plugins_and_every_hook(entry_points):
    import click

    module = types.ModuleType("fake_plugin_module")

    class Connector:
        name, source_kind, target_kind = "fake.conn", "ar", "ar"

        def convert(self, output, request):
            raise NotImplementedError

    @hookimpl
    def omni_register_connectors(register):
        register(Connector())

    @hookimpl
    def omni_register_commands(register):
        register(click.Command("hello", callback=lambda: click.echo("hi")))

    module.omni_register_connectors = omni_register_connectors
    module.omni_register_commands = omni_register_commands
    entry_points.append(FakeEntryPoint("mod", module))
    host = load_host()
    assert host.registry.by_plugin("mod") == {"node types": [], "connectors": ["fake.conn"], "pipelines": [],
                                              "commands": ["hello"]}


def test_no_entry_points_leaves_the_kernel_echo(entry_points):
    host = load_host()
    assert [p.name for p in host.plugins] == ["omni_kernel"] and list(host.registry.pipelines) == ["echo"]


def test_misspelled_hook_fails_that_plugin_only(entry_points, warnings):
    class Misspelled:
        @hookimpl
        def omni_register_node_type(self, register):  # singular: not a hook
            register(unbuilt_node("typo.node"))

        @hookimpl
        def omni_register_pipelines(self, register):
            register(PipelinePlan("typo", [NodeSpec("n", "kernel.echo", final=True)]))

    entry_points += [FakeEntryPoint("a_typo", Misspelled), FakeEntryPoint("b_next", pipeline_plugin("next"))]
    host = load_host()
    info = {p.name: p for p in host.plugins}
    assert info["a_typo"].status == "failed" and "omni_register_node_type" in info["a_typo"].error
    assert "\n" not in info["a_typo"].error and "unknown hook" in info["a_typo"].error
    assert host.registry.by_plugin("a_typo") == {"node types": [], "connectors": [], "pipelines": [], "commands": []}
    assert host.pm.get_plugin("a_typo") is None
    assert info["b_next"].status == "loaded" and "next" in host.registry.pipelines
    assert "omni_register_node_type" in warnings[0].getMessage()


def test_plugin_command_shadowing_a_builtin_is_refused(entry_points, warnings):
    import click

    class Shadow:
        @hookimpl
        def omni_register_commands(self, register):
            register(click.Command("run", callback=lambda: None))

        @hookimpl
        def omni_register_pipelines(self, register):
            register(PipelinePlan("shadowed", [NodeSpec("n", "kernel.echo", final=True)]))

    entry_points.append(FakeEntryPoint("x", Shadow))
    host = load_host()
    error = {p.name: p for p in host.plugins}["x"].error
    assert error == "command 'run' of plugin 'x' would shadow the built-in omni command"
    assert "run" not in host.registry.commands and "shadowed" not in host.registry.pipelines
    assert "'run'" in warnings[0].getMessage()


def test_same_plugin_twice_is_a_duplicate_registration():
    host = PluginHost()
    plugin = pipeline_plugin("once")()
    host.register(plugin, "once")
    with pytest.raises(DuplicateRegistration, match="'once'"):
        host.register(pipeline_plugin("other")(), "once")  # same name
    with pytest.raises(DuplicateRegistration, match="'again'.*'once'"):
        host.register(plugin, "again")  # same object
    assert [p.name for p in host.plugins] == ["once"] and "other" not in host.registry.pipelines


def test_allowlist_naming_an_unknown_plugin_warns(entry_points, warnings, monkeypatch):
    entry_points += [FakeEntryPoint("one", pipeline_plugin("p1")), FakeEntryPoint("two", pipeline_plugin("p2"))]
    monkeypatch.setenv("OMNI_PLUGINS", "one,tow")
    host = load_host()
    assert sorted(host.registry.pipelines) == ["echo", "p1"]
    mine = [r.getMessage() for r in warnings if r.levelno >= logging.WARNING]
    assert len(mine) == 1 and "tow" in mine[0] and "one" in mine[0] and "two" in mine[0]
