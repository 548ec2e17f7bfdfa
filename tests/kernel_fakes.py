"""Small fake stages for kernel tests: the real Stage/Engine/StepScheduler over a scripted model runner."""

from __future__ import annotations

import attrs

from omni_kernel.core.engine import Engine
from omni_kernel.core.errors import InvalidParameter
from omni_kernel.core.graph import Join
from omni_kernel.core.registry import NodeType, Registry
from omni_kernel.core.request import Piece, StageInput, StageOutput
from omni_kernel.core.scheduler import StepScheduler
from omni_kernel.core.stage import Outputs, Stage
from omni_kernel.events import StageFinished, TokenDelta


def chunks(text: str, n: int) -> list[str]:
    """Split text into n pieces (some may be empty) that join back to it."""
    size = -(-len(text) // n) if text else 0
    return [text[i * size:(i + 1) * size] for i in range(n - 1)] + [text[(n - 1) * size:]]


def stage_text(node_id: str, prompt: str) -> str:
    return f"{node_id}<{prompt}>"


def default_steps(node_id: str, item: StageInput) -> int:
    return 1 + (len(item.prompt) + ord(node_id[0])) % 3


class ScriptedRunner:
    """Step k of a request returns piece k of `node<prompt>`; logs what it is asked.

    `fail_add(item)` / `fail_run(item)` decide which requests raise, to test per-request failures; with
    `alone=True` a run failure is returned for that request only instead of raised for the batch.
    """

    def __init__(self, node_id: str, log: list, steps, fail_add=None, fail_run=None, alone=False):
        self.node_id = node_id
        self.log = log
        self.steps = steps
        self.fail_add = fail_add or (lambda item: None)
        self.fail_run = fail_run or (lambda item: None)
        self.alone = alone
        self.live: dict[str, StageInput] = {}

    def add_request(self, record) -> None:
        item = record.item
        error = self.fail_add(item)
        if error is not None:
            raise error
        self.log.append(("add", self.node_id, item.request_id))
        self.live[item.request_id] = item

    def run(self, batch) -> dict:
        results = {}
        for rid, step in zip(batch.request_ids, batch.steps):
            item = self.live[rid]
            error = self.fail_run(item)
            if error is not None and not self.alone:
                raise error
            self.log.append(("step", self.node_id, rid))
            results[rid] = error or chunks(stage_text(self.node_id, item.prompt), self.steps(self.node_id, item))[step]
        return results

    def free(self, record) -> None:
        if self.live.pop(record.request_id, None) is not None:
            self.log.append(("free", self.node_id, record.request_id))


class ScriptedOutputs(Outputs):
    """Streams each step's piece; on finish, the whole text with a trace."""

    def __init__(self, node_id: str, log: list):
        super().__init__(node_id)
        self.log = log

    def process(self, outputs) -> tuple[list, list[str]]:
        events, _ = super().process([o for o in outputs if o.error is not None])
        for out in (o for o in outputs if o.error is None):
            rid = out.request_id
            events.append(TokenDelta(rid, self.node_id, out.result))
            if out.finished:
                self.log.append(("finish", self.node_id, rid))
                prompt = out.item.prompt
                events.append(StageFinished(rid, self.node_id, StageOutput(
                    rid, self.node_id, text=stage_text(self.node_id, prompt), stop_reason="done",
                    trace={f"{self.node_id}.steps": out.record.step, f"{self.node_id}.prompt": prompt})))
        return events, []


@attrs.frozen(eq=False)
class FakeEngineSettings:
    """A fake node's engine settings. Compared by identity: every node gets an engine of its own."""

    node_id: str
    log: list
    options: dict


def fake_engine(node_id: str, log: list, max_batch: int = 2, steps=default_steps, **runner_kwargs) -> Engine:
    runner = ScriptedRunner(node_id, log, steps, **runner_kwargs)
    scheduler = StepScheduler(max_batch=max_batch, num_steps=lambda item: steps(node_id, item))
    return Engine(scheduler, runner)


def fake_node_type(name: str, kind: str, log: list, join: Join | None = None, **options) -> NodeType:
    """A node type whose stages run `fake_engine(node id, log, **options)`, one engine per node."""
    return NodeType(name, kind, inputs={"image"}, join=join,
                    engine_settings=lambda node, config, policy: FakeEngineSettings(node.id, log, options),
                    engine=lambda s: fake_engine(s.node_id, s.log, **s.options),
                    stage=lambda node, config, policy, settings, engine: Stage(
                        node, kind, None, engine, ScriptedOutputs(node.id, log)))


def merge_text(inputs: dict[str, StageInput], request) -> StageInput:
    """A join's merge step: its inputs' prompts, by name, in one prompt."""
    return StageInput(request.request_id, "join[" + "|".join(f"{name}={inputs[name].prompt}"
                                                             for name in sorted(inputs)) + "]")


def text_join(*inputs: str) -> Join:
    return Join(inputs, merge_text)


def holds(stage: Stage, request_id: str) -> bool:
    """Whether the stage (its engine or its runner) still keeps the request."""
    return request_id in stage.engine.request_ids() or request_id in stage.engine.runner.live


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
                          trace={f"connector.{output.node_id}.{self.name}": True})


@attrs.frozen
class StreamTagConnector(TagConnector):
    """A TagConnector that can stream: each streamed TokenDelta's text is one piece."""

    def splitter(self, request) -> WordSplitter:
        return WordSplitter()


class WordSplitter:
    """Cuts a source's streamed text after each space; the rest at its end."""

    def __init__(self):
        self.buffer = ""

    def feed(self, event) -> list[Piece]:
        if not isinstance(event, TokenDelta):
            return []
        self.buffer += event.text
        cut = self.buffer.rfind(" ") + 1
        pieces = [Piece(word + " ") for word in self.buffer[:cut].split(" ")[:-1]]
        self.buffer = self.buffer[cut:]
        return pieces

    def end(self, output) -> list[Piece]:
        rest, self.buffer = self.buffer, ""
        return [Piece(rest)] if rest else []


def registry_with(node_kinds: dict[str, str], connectors, log: list, joins=None, **stage_kwargs) -> Registry:
    """A registry of fake node types (name -> kind; `joins`: name -> the inputs it joins) and the given
    connectors."""
    registry = Registry()
    for name, kind in node_kinds.items():
        join = text_join(*joins[name]) if joins and name in joins else None
        registry.add_node_type(fake_node_type(name, kind, log, join=join, **stage_kwargs), "tests")
    for connector in connectors:
        registry.add_connector(connector, "tests")
    return registry


def bad_prompt(word: str, error=None):
    """A fail_* predicate: raise for prompts containing `word`."""
    return lambda item: (error or InvalidParameter("prompt", f"contains {word}")) if word in item.prompt else None
