"""The kernel's own layer classes keep the contracts that plugins implement (omni_kernel/protocols.py).

`runtime_checkable` only checks that methods exist, so this compares each method's parameters instead.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

from omni_kernel.core import protocols

# (protocol, kernel class that satisfies it as "module:Class"); update when a layer is added or renamed.
IMPLEMENTATIONS = [
    ("Stage", "omni_kernel.core.stage:Stage"),
    ("Scheduler", "omni_kernel.core.scheduler:StepScheduler"),
    ("Scheduler", "omni_kernel.core.scheduler:PhaseScheduler"),
    ("Scheduler", "omni_kernel.core.ar_scheduler:ARScheduler"),
    ("Stepped", "omni_kernel.core.engine:Engine"),
    ("ModelRunner", "omni_kernel.builtin.echo:IdentityRunner"),
    ("InputProcessor", "omni_kernel.core.stage:Inputs"),
    ("InputProcessor", "omni_kernel.builtin.echo:EchoInputs"),
    ("OutputProcessor", "omni_kernel.core.stage:Outputs"),
    ("OutputProcessor", "omni_kernel.builtin.echo:EchoOutputs"),
    ("StreamStage", "omni_kernel.core.stage:Stage"),
    ("StreamInputs", "omni_kernel.core.stage:Inputs"),
    ("StreamScheduler", "omni_kernel.core.scheduler:StepScheduler"),
]
PLUGIN_ONLY = {"Connector", "StreamConnector", "Splitter"}  # the kernel has no implementation; plugins bring them


def load(path: str) -> type:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def methods(protocol: type) -> list[str]:
    return sorted(n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_"))


def parameters(function) -> list[tuple[str, str, bool]]:
    """Name, kind and whether it is required, for every parameter after self."""
    params = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.kind.name, p.default is p.empty) for p in params]


def mismatches(protocol: type, cls: type) -> dict[str, str]:
    found = {}
    for name in methods(protocol):
        wanted, method = getattr(protocol, name), getattr(cls, name, None)
        if not callable(method):
            found[name] = "missing"
        elif parameters(method) != parameters(wanted):
            found[name] = f"{inspect.signature(method)}, the protocol has {inspect.signature(wanted)}"
    return found


@pytest.mark.parametrize("protocol, path", IMPLEMENTATIONS)
def test_kernel_class_has_the_protocols_signatures(protocol, path):
    assert mismatches(getattr(protocols, protocol), load(path)) == {}


def test_every_protocol_has_a_kernel_implementation_listed():
    declared = {n for n, v in vars(protocols).items()
                if isinstance(v, type) and getattr(v, "_is_protocol", False) and v.__module__ == protocols.__name__}
    assert declared - PLUGIN_ONLY == {protocol for protocol, _ in IMPLEMENTATIONS}


def test_a_changed_signature_is_a_mismatch():
    protocol = protocols.Scheduler
    first, second, *_ = methods(protocol)
    members = {name: getattr(protocol, name) for name in methods(protocol)}
    assert mismatches(protocol, type("Same", (), members)) == {}
    members[first] = lambda self, *args, extra: None
    del members[second]
    found = mismatches(protocol, type("Changed", (), members))
    assert sorted(found) == sorted([first, second]) and found[second] == "missing"
