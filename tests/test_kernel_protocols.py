"""The kernel's own layer classes keep the contracts that plugins implement (omni_kernel/protocols.py)."""

from omni_kernel import protocols
from omni_kernel.ar_scheduler import ARScheduler
from omni_kernel.graph import NodeSpec
from omni_kernel.identity import IdentityARExecutor, build_echo_stage
from omni_kernel.kv_blocks import BlockManager
from omni_kernel.scheduler import RequestScheduler, StepScheduler


def test_kernel_layers_satisfy_the_protocols():
    stage = build_echo_stage(NodeSpec("echo", "kernel.echo", final=True), {})
    assert isinstance(stage, protocols.Stage)
    assert isinstance(stage.engine, protocols.Engine)
    assert isinstance(stage.engine.runner, protocols.ModelRunner)
    assert isinstance(IdentityARExecutor("echo"), protocols.Executor)
    for scheduler in (RequestScheduler(), StepScheduler(), ARScheduler(BlockManager(8, 4))):
        assert isinstance(scheduler, protocols.Scheduler)


def test_protocols_reject_what_lacks_a_method():
    class NoAbort:
        def add(self, item): ...
        def schedule(self): ...
        def update(self, done, results=None): ...
        def has_unfinished(self): ...

    assert not isinstance(NoAbort(), protocols.Scheduler)
    assert not isinstance(object(), protocols.Connector)
