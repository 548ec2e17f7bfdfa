"""Streaming edges in the StageScheduler: the target starts on the source's first chunk, before the source finishes;
each chunk reaches it in order, the last says the source finished; a failure or an abort on either side ends the
request on both; several outputs each reach the caller as their node makes them; a placement that cannot carry
chunks is refused before anything is built."""

from __future__ import annotations

import attrs
import pytest

from omni_kernel import Omni
from omni_kernel.core.engine import Engine
from omni_kernel.core.errors import InputError, RequestAborted, UserError
from omni_kernel.core.graph import EdgeSpec, NodeSpec, PipelinePlan
from omni_kernel.core.registry import NodeType
from omni_kernel.core.request import StageInput, StageOutput, StreamChunk
from omni_kernel.core.scheduler import StepScheduler
from omni_kernel.core.stage import Inputs, Stage
from omni_kernel.events import RequestFailed, RequestFinished, StageFinished, TokenDelta
from omni_kernel.plugins import PluginHost

from kernel_fakes import (
    FakeEngineSettings,
    ScriptedOutputs,
    StreamTagConnector,
    WordSplitter,
    bad_prompt,
    holds,
    registry_with,
    stage_text,
)

STREAMED = PipelinePlan("streamed", [NodeSpec("a", "t.ar", final=True), NodeSpec("b", "t.say", final=True)],
                        [EdgeSpec("a", "b", "words", stream=True)])


class ChunkInputs(Inputs):
    """Keeps each chunk's text as one step of the request (its processed input: the chunks so far)."""

    def __init__(self, log: list):
        self.log = log

    def process(self, item: StageInput) -> StageInput:
        return attrs.evolve(item, processed=() if item.stream else (item.prompt,))

    def extend(self, item: StageInput, chunk: StreamChunk) -> StageInput:
        self.log.append(("chunk", chunk.node_id, chunk.request_id, chunk.index, chunk.text, chunk.last))
        if "boom" in chunk.text:
            raise InputError(f"cannot say {chunk.text!r}")
        pieces = (chunk.text,) if chunk.text else ()
        return attrs.evolve(item, processed=item.processed + pieces)


class SayRunner:
    """Step k of a request says its chunk k, upper-cased."""

    def __init__(self, log: list):
        self.log = log
        self.live: dict[str, StageInput] = {}

    def add_request(self, record) -> None:
        self.log.append(("add", "b", record.request_id))
        self.live[record.request_id] = record.item

    def run(self, batch) -> dict:
        out = {}
        for record, step in zip(batch.records, batch.steps):
            self.log.append(("step", "b", record.request_id))
            out[record.request_id] = record.item.processed[step].upper()
        return out

    def free(self, record) -> None:
        self.live.pop(record.request_id, None)


class SayOutputs(ScriptedOutputs):
    def process(self, outputs) -> tuple[list, list[str]]:
        events, _ = super(ScriptedOutputs, self).process([o for o in outputs if o.error is not None])
        for out in (o for o in outputs if o.error is None):
            if out.result is not None:
                events.append(TokenDelta(out.request_id, "b", out.result))
            if out.finished:
                self.log.append(("finish", "b", out.request_id))
                text = "".join(out.item.processed).upper()
                events.append(StageFinished(out.request_id, "b", StageOutput(out.request_id, "b", text=text,
                                                                            stop_reason="done")))
        return events, []


def say_node_type(log: list) -> NodeType:
    return NodeType("t.say", "say", stream_input=True,
                    engine_settings=lambda node, config, policy: FakeEngineSettings(node.id, log, {}),
                    engine=lambda s: Engine(StepScheduler(max_batch=4, num_steps=lambda item: len(item.processed)),
                                            SayRunner(s.log)),
                    stage=lambda node, config, policy, settings, engine: Stage(
                        node, "say", ChunkInputs(log), engine, SayOutputs(node.id, log)))


def streamed_host(log: list, **stage_kwargs) -> PluginHost:
    host = PluginHost()
    host.registry = registry_with({"t.ar": "ar"}, [StreamTagConnector("words", "ar", "say")], log, **stage_kwargs)
    host.registry.add_node_type(say_node_type(log), "tests")
    return host


def four_steps(node_id: str, item: StageInput) -> int:
    return 4


def run(omni: Omni, prompt: str, request_id: str = "r") -> list:
    omni.submit(omni.request(prompt, request_id=request_id))
    events = []
    while omni.has_unfinished():
        events += omni.step()
    return events


def test_the_target_starts_on_the_first_chunk_and_gets_every_chunk_in_order():
    log: list = []
    omni = Omni(STREAMED, host=streamed_host(log, steps=four_steps))
    events = run(omni, "one two three four five six")
    source = stage_text("a", "one two three four five six")
    chunks = [entry for entry in log if entry[0] == "chunk"]
    assert [c[4] for c in chunks] == [w + " " for w in source.split(" ")[:-1]] + [source.split(" ")[-1]]
    assert [c[3] for c in chunks] == list(range(len(chunks)))
    assert [c[5] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert log.index(("add", "b", "r")) < log.index(("finish", "a", "r"))
    assert log.index(("step", "b", "r")) < log.index(("finish", "a", "r"))  # it speaks while the source writes
    result = next(e.result for e in events if isinstance(e, RequestFinished))
    assert result.outputs["b"].text == source.upper()
    assert result.trace["stream.a.b.chunks"] == len(chunks)
    assert 0 <= result.trace["stream.a.b.first_chunk_ms"] <= result.trace["request.elapsed_ms"]


def test_each_output_reaches_the_caller_as_its_node_makes_it():
    omni = Omni(STREAMED, host=streamed_host([]))
    events = run(omni, "x y")
    kinds = [(type(e).__name__, e.node_id if isinstance(e, StageFinished) else None) for e in events
             if isinstance(e, (StageFinished, RequestFinished))]
    assert kinds == [("StageFinished", "a"), ("StageFinished", "b"), ("RequestFinished", None)]
    result = events[-1].result
    assert result.finals == ("a", "b") and result.output.node_id == "a"
    assert {k: v.text for k, v in result.final_outputs.items()} == {"a": stage_text("a", "x y"),
                                                                   "b": stage_text("a", "x y").upper()}
    assert set(result.to_json()["outputs"]) == {"a", "b"}


def test_an_empty_last_chunk_finishes_the_target_when_its_steps_are_done():
    """Every piece went out while the source wrote (its text ended with a space): the last chunk is empty, and the
    target, waiting with every step done, finishes at its next step without running."""
    splitter = WordSplitter()
    assert [p.text for p in splitter.feed(TokenDelta("r", "a", "x "))] == ["x "] and splitter.end(None) == []
    stage = Omni(STREAMED, host=streamed_host([])).graph.stages["b"]
    stage.hand_off(StageInput("q", "", stream=True))
    assert stage.engine.step() == [] and not stage.engine.wait(0)  # open, nothing to run: no busy wait
    stage.append(StreamChunk("q", "b", 0, "hi "))
    assert [(o.result, o.finished) for o in stage.engine.step()] == [("HI ", None)]
    stage.append(StreamChunk("q", "b", 1, "", last=True))
    assert stage.engine.wait(0)
    assert [(o.result, o.finished) for o in stage.engine.step()] == [(None, "done")]
    assert not stage.engine.has_unfinished()


def test_a_source_failure_fails_the_request_with_its_error_and_frees_the_target():
    log: list = []
    calls: list = []

    def third_step_fails(item):
        calls.append(item)
        return bad_prompt("late")(item) if len(calls) == 3 else None

    omni = Omni(STREAMED, host=streamed_host(log, steps=four_steps, alone=True, fail_run=third_step_fails))
    events = run(omni, "late words come here")
    failed = [e for e in events if isinstance(e, RequestFailed)]
    assert len(failed) == 1 and failed[0].node_id == "a" and failed[0].kind == "invalid_parameter"
    assert any(e[0] == "chunk" for e in log)  # the target had started
    assert not holds(omni.graph.stages["b"], "r") and not holds(omni.graph.stages["a"], "r")


def test_a_target_failure_ends_the_sources_work_for_that_request():
    log: list = []
    omni = Omni(STREAMED, host=streamed_host(log, steps=lambda node_id, item: 6))
    events = run(omni, "say boom now and more")
    failed = [e for e in events if isinstance(e, RequestFailed)]
    assert len(failed) == 1 and failed[0].node_id == "b" and failed[0].kind == "bad_input"
    assert ("finish", "a", "r") not in log  # the source stopped before its end
    assert not holds(omni.graph.stages["a"], "r") and not holds(omni.graph.stages["b"], "r")


def test_an_abort_mid_stream_stops_both_stages():
    log: list = []
    omni = Omni(STREAMED, host=streamed_host(log, steps=lambda node_id, item: 8))
    omni.submit(omni.request("w1 w2 w3 w4 w5 w6 w7 w8", request_id="r"))
    while not any(e[0] == "step" and e[1] == "b" for e in log):
        omni.step()
    omni.abort("r")
    events = []
    while omni.has_unfinished():
        events += omni.step()
    assert [e.kind for e in events if isinstance(e, RequestFailed)] == ["aborted"]
    assert ("finish", "a", "r") not in log
    assert not holds(omni.graph.stages["a"], "r") and not holds(omni.graph.stages["b"], "r")
    assert isinstance(next(e for e in events if isinstance(e, RequestFailed)).exception(), RequestAborted)


def test_concurrent_streams_stay_apart():
    log: list = []
    omni = Omni(STREAMED, host=streamed_host(log, steps=four_steps, max_batch=8))
    prompts = {f"r{i}": " ".join(f"w{i}{j}" for j in range(i + 2)) for i in range(4)}
    for rid, prompt in prompts.items():
        omni.submit(omni.request(prompt, request_id=rid))
    events = []
    while omni.has_unfinished():
        events += omni.step()
    finished = {e.request_id: e.result for e in events if isinstance(e, RequestFinished)}
    assert {rid: r.outputs["b"].text for rid, r in finished.items()} == {
        rid: stage_text("a", prompt).upper() for rid, prompt in prompts.items()}


def test_the_target_is_checked_at_submit_as_the_opening_of_a_stream():
    """A node whose input streams in is checked with what it will be handed: no prompt, `stream` set."""
    seen = []
    host = streamed_host([])
    say = host.registry.node_types["t.say"].item
    host.registry.node_types["t.say"] = attrs.evolve(host.registry.node_types["t.say"],
                                                     item=attrs.evolve(say, check=lambda *args: seen.append(args[-1])))
    omni = Omni(STREAMED, host=host)
    omni.host.builder.check_request(omni.plan, omni.host.builder.prepare(omni.plan), omni.request("hello"))
    assert [(item.prompt, item.stream) for item in seen] == [("", True)]


@attrs.frozen
class InprocOnly:
    """A placement that builds its stages here but declares no `streams`: it cannot carry chunks."""

    name: str = "elsewhere"
    settings = None

    def check(self, settings, plan, placement_of) -> None:
        pass

    def build(self, nodes, settings, host_factory, handle, fail_fast=False):
        raise AssertionError("a streaming target under it must be refused before it builds")


@pytest.mark.parametrize("placement", ["elsewhere", "b=elsewhere"])
def test_a_placement_that_cannot_carry_chunks_is_refused_in_one_line(placement):
    host = streamed_host([])
    host.registry.add_placement(InprocOnly(), "tests")
    with pytest.raises(UserError) as info:
        Omni(STREAMED, host=host, placement=placement)
    message = str(info.value)
    assert "\n" not in message and "'elsewhere' cannot carry streamed chunks to node 'b'" in message
    assert "a -> b" in message


def test_the_source_alone_may_run_under_such_a_placement_check():
    host = streamed_host([])
    host.registry.add_placement(InprocOnly(), "tests")
    host.builder.prepare(STREAMED, None, None)  # inproc: fine
    from omni_kernel.core.placement import RunSettings

    host.builder.prepare(STREAMED, None, RunSettings("a=elsewhere"))  # only the target needs to take chunks
