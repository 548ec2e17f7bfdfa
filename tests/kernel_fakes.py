"""Small fake stages for kernel tests: the real Stage/Engine/scheduler/ModelRunner over scripted executors."""

from __future__ import annotations

import attrs

from omni_kernel.engine import Engine
from omni_kernel.errors import InvalidParameter
from omni_kernel.events import StageFinished, TokenDelta
from omni_kernel.graph import NodeSpec
from omni_kernel.registry import NodeType, Registry
from omni_kernel.request import StageInput, StageOutput
from omni_kernel.runner import ModelRunner
from omni_kernel.scheduler import RequestScheduler, StepScheduler
from omni_kernel.stage import Stage


def chunks(text: str, n: int) -> list[str]:
    """Split text into n pieces (some may be empty) that join back to it."""
    size = -(-len(text) // n) if text else 0
    return [text[i * size:(i + 1) * size] for i in range(n - 1)] + [text[(n - 1) * size:]]


def stage_text(node_id: str, prompt: str) -> str:
    return f"{node_id}<{prompt}>"


def default_steps(node_id: str, item: StageInput) -> int:
    return 1 + (len(item.prompt) + ord(node_id[0])) % 3


class ScriptedExecutor:
    """Finishes a request after `steps` steps, streaming `node<prompt>` in pieces; logs what it is asked.

    `fail_add(item)` / `fail_execute(item)` decide which requests raise, to test per-request failures.
    """

    def __init__(self, node_id: str, log: list, steps=default_steps, fail_add=None, fail_execute=None):
        self.node_id = node_id
        self.log = log
        self.steps = steps
        self.fail_add = fail_add or (lambda item: None)
        self.fail_execute = fail_execute or (lambda item: None)
        self.live: dict[str, list] = {}

    def add_request(self, item: StageInput) -> None:
        error = self.fail_add(item)
        if error is not None:
            raise error
        self.log.append(("add", self.node_id, item.request_id))
        self.live[item.request_id] = [item, chunks(stage_text(self.node_id, item.prompt),
                                                   self.steps(self.node_id, item)), 0]

    def execute(self, batch) -> list:
        events = []
        for rid in batch.request_ids:
            item, pieces, done = self.live[rid]
            error = self.fail_execute(item)
            if error is not None:
                raise error
            self.log.append(("step", self.node_id, rid))
            events.append(TokenDelta(rid, self.node_id, pieces[done]))
            self.live[rid][2] = done = done + 1
            if done == len(pieces):
                self.log.append(("finish", self.node_id, rid))
                events.append(StageFinished(rid, self.node_id, StageOutput(
                    rid, self.node_id, text="".join(pieces), stop_reason="done",
                    trace={f"{self.node_id}.steps": done, f"{self.node_id}.prompt": item.prompt})))
        return events

    def free(self, request_id: str) -> None:
        if self.live.pop(request_id, None) is not None:
            self.log.append(("free", self.node_id, request_id))


def fake_stage(node: NodeSpec, kind: str, log: list, step_wise: bool = False, **executor_kwargs) -> Stage:
    executor = ScriptedExecutor(node.id, log, **executor_kwargs)
    scheduler = StepScheduler(max_batch=1) if step_wise else RequestScheduler(max_num_seqs=2)
    return Stage(node, kind, Engine(scheduler, ModelRunner(executor, node.id)))


def holds(stage: Stage, request_id: str) -> bool:
    """Whether any layer of the stage still keeps the request."""
    engine = stage.engine
    sched = engine.scheduler
    queued = [*getattr(sched, "waiting", ()), *getattr(sched, "running", ()), *getattr(sched, "queue", ())]
    return (any(i.request_id == request_id for i in queued) or request_id in engine.runner.executor.live
            or any(e.request_id == request_id for e in engine.pending))


@attrs.frozen
class TagConnector:
    """Wraps the source text as `name[text]` so a test can see which connector ran on which edge."""

    name: str
    source_kind: str
    target_kind: str
    fail_on: str | None = None

    def convert(self, output: StageOutput, request) -> StageInput:
        if self.fail_on is not None and self.fail_on in request.prompt:
            raise ValueError(f"cannot convert {request.prompt!r}")
        return StageInput(request.request_id, f"{self.name}[{output.text}]", image=request.image,
                          params=request.params.get(self.target_kind), options=request.options,
                          trace={f"connector.{output.node_id}.{self.name}": True})


def registry_with(node_kinds: dict[str, str], connectors, log: list, **stage_kwargs) -> Registry:
    """A registry of fake node types (name -> kind) and the given connectors."""
    registry = Registry()
    for name, kind in node_kinds.items():
        registry.add_node_type(NodeType(name, kind, lambda node, config, k=kind: fake_stage(node, k, log,
                                                                                              **stage_kwargs)),
                               "tests")
    for connector in connectors:
        registry.add_connector(connector, "tests")
    return registry


def bad_prompt(word: str, error=None):
    """A fail_* predicate: raise for prompts containing `word`."""
    return lambda item: (error or InvalidParameter("prompt", f"contains {word}")) if word in item.prompt else None
