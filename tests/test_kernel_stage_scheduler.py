"""StageScheduler behaviour: streaming, concurrency, abort at any step, per-request failures, helpers."""

from __future__ import annotations

import pytest

from kernel_fakes import TagConnector, bad_prompt, holds, registry_with, stage_text
from omni_kernel import Omni
from omni_kernel.errors import InputError, RequestAborted, RequestError, UserError
from omni_kernel.events import RequestFailed, RequestFinished, StageFinished, TokenDelta
from omni_kernel.graph import EdgeSpec, NodeSpec, PipelinePlan
from omni_kernel.identity import KernelPlugin
from omni_kernel.params import ARParams
from omni_kernel.planner import PipelineRegistry
from omni_kernel.plugins import PluginHost
from omni_kernel.request import Request
from omni_kernel.stage import Stage
from omni_kernel.stage_scheduler import StageScheduler, raise_for

TWO_NODES = PipelinePlan("two", [NodeSpec("a", "t.ar"), NodeSpec("b", "t.text", final=True)],
                         [EdgeSpec("a", "b", "to_text")])


def kernel_host() -> PluginHost:
    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel")
    return host


def two_node_scheduler(log=None, connector=None, **stage_kwargs) -> StageScheduler:
    registry = registry_with({"t.ar": "ar", "t.text": "text"}, [connector or TagConnector("to_text", "ar", "text")],
                             [] if log is None else log, **stage_kwargs)
    return StageScheduler(PipelineRegistry(registry).build(TWO_NODES))


def drain(scheduler: StageScheduler, limit: int = 200) -> list:
    events = []
    for _ in range(limit):
        if not scheduler.has_unfinished():
            return events
        events += scheduler.step()
    raise AssertionError("the scheduler never finished")


def texts(events, request_id: str, node_id: str | None = None) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenDelta) and e.request_id == request_id
                   and (node_id is None or e.node_id == node_id))


def outcome(events, request_id: str):
    ends = [e for e in events if isinstance(e, (RequestFinished, RequestFailed)) and e.request_id == request_id]
    assert len(ends) == 1, ends
    return ends[0]


# ---- the echo pipeline through the Python API ----------------------------------------------------------------

def test_streamed_deltas_concatenate_to_the_final_text():
    omni = Omni("echo", host=kernel_host())
    prompt = "héllo 世界:  omni\tstreams\n this back "
    events = list(omni.generate_stream(prompt, stream=True))
    deltas = [e for e in events if isinstance(e, TokenDelta)]
    assert len(deltas) > 3 and "".join(d.text for d in deltas) == prompt
    assert isinstance(events[-1], RequestFinished) and events[-1].result.text == prompt
    trace = events[-1].result.trace
    assert trace["ar.streaming"] is True and trace["ar.stop_reason"] == "eos" and trace["request.pipeline"] == "echo"
    assert all("." in key for key in trace)


def test_max_tokens_budget_stops_early():
    result = Omni("echo", host=kernel_host()).generate("one two three four", ar=ARParams(max_tokens=2))
    assert (result.text, result.output.stop_reason, result.trace["ar.output_tokens"]) == ("one two", "max_tokens", 2)


def test_concurrent_requests_each_get_their_own_text():
    omni = Omni("echo", host=kernel_host())
    prompts = {f"r{i}": " ".join(f"w{i}{j}" for j in range(i + 2)) for i in range(5)}
    for rid, prompt in prompts.items():
        omni.submit(omni.request(prompt, request_id=rid))
    events = drain(omni.scheduler)
    for rid, prompt in prompts.items():
        assert texts(events, rid) == prompt
        assert outcome(events, rid).result.text == prompt
    assert not omni.has_unfinished()


def test_request_ids_must_be_unique_and_pipeline_must_match():
    omni = Omni("echo", host=kernel_host())
    omni.submit(omni.request("x", request_id="same"))
    with pytest.raises(UserError, match="request_id"):
        omni.submit(omni.request("y", request_id="same"))
    with pytest.raises(UserError, match="pipeline"):
        omni.submit(Request("other", "y"))


# ---- abort -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("abort_after", range(8))
@pytest.mark.parametrize("victim", ["r0", "r1"])
def test_abort_at_any_step_frees_the_request_in_every_stage(abort_after, victim):
    log: list = []
    scheduler = two_node_scheduler(log)
    prompts = {"r0": "abc", "r1": "hello", "r2": "z"}
    for rid, prompt in prompts.items():
        scheduler.submit(Request("two", prompt, request_id=rid))
    before = []
    for _ in range(abort_after):
        before += scheduler.step()
    already_done = any(isinstance(e, RequestFinished) and e.request_id == victim for e in before)
    scheduler.abort(victim)
    scheduler.abort(victim)  # a second abort (or one of an unknown id) is a no-op
    scheduler.abort("nobody")
    after = drain(scheduler)
    assert all(not holds(stage, victim) for stage in scheduler.graph.stages.values())
    if already_done:
        assert not [e for e in after if e.request_id == victim]
    else:
        assert [e for e in after if e.request_id == victim] == [RequestFailed(victim, None, "aborted")]
        assert ("finish", "b", victim) not in log
    for rid in set(prompts) - {victim}:
        result = outcome(before + after, rid).result
        assert result.text == stage_text("b", f"to_text[{stage_text('a', prompts[rid])}]")
    assert not scheduler.in_flight and not scheduler.has_unfinished()


def test_closing_a_stream_early_aborts_its_request():
    omni = Omni("echo", host=kernel_host())
    stream = omni.generate_stream("a b c d e f")
    first = next(stream)
    assert isinstance(first, TokenDelta)
    rid = first.request_id
    stream.close()
    stage = omni.graph.stages["echo"]
    assert rid not in omni.scheduler.in_flight and not holds_echo(stage, rid)
    assert not omni.has_unfinished()


def holds_echo(stage, rid) -> bool:
    sched = stage.engine.scheduler
    return rid in stage.engine.runner.executor.sequences or any(
        i.request_id == rid for i in [*sched.waiting, *sched.running])


# ---- failures stay with their request ----------------------------------------------------------------------

def test_executor_refusing_one_request_at_add_fails_only_that_request():
    scheduler = two_node_scheduler(fail_add=bad_prompt("bad"))
    for rid, prompt in {"ok1": "fine", "bad": "bad one", "ok2": "also fine"}.items():
        scheduler.submit(Request("two", prompt, request_id=rid))
    events = drain(scheduler)
    failed = outcome(events, "bad")
    assert isinstance(failed, RequestFailed) and failed.node_id == "a" and failed.user_error
    assert "contains bad" in failed.error
    for rid in ("ok1", "ok2"):
        assert isinstance(outcome(events, rid), RequestFinished)


def test_executor_raising_during_a_step_fails_only_its_batch():
    log: list = []
    scheduler = two_node_scheduler(log, step_wise=True, fail_execute=bad_prompt("boom", RuntimeError("kaput")))
    for rid, prompt in {"ok1": "fine", "boom": "boom", "ok2": "also fine"}.items():
        scheduler.submit(Request("two", prompt, request_id=rid))
    events = drain(scheduler)
    failed = outcome(events, "boom")
    assert isinstance(failed, RequestFailed) and not failed.user_error and failed.error == "RuntimeError: kaput"
    assert ("free", "a", "boom") in log and ("add", "b", "boom") not in log
    for rid in ("ok1", "ok2"):
        assert isinstance(outcome(events, rid), RequestFinished)
    assert all(not holds(stage, "boom") for stage in scheduler.graph.stages.values())


def test_connector_raising_fails_only_that_request():
    scheduler = two_node_scheduler(connector=TagConnector("to_text", "ar", "text", fail_on="nope"))
    for rid, prompt in {"ok1": "fine", "bad": "nope", "ok2": "also fine"}.items():
        scheduler.submit(Request("two", prompt, request_id=rid))
    events = drain(scheduler)
    failed = outcome(events, "bad")
    assert isinstance(failed, RequestFailed) and failed.node_id == "b"
    assert failed.error.startswith("connector to_text: cannot convert")
    assert [type(e) for e in events if e.request_id == "bad"][-2:] == [StageFinished, RequestFailed]
    for rid in ("ok1", "ok2"):
        assert isinstance(outcome(events, rid), RequestFinished)
    assert all(not holds(stage, "bad") for stage in scheduler.graph.stages.values())


class PickyStage(Stage):
    def check(self, request):
        if request.image is not None:
            raise InputError(f"node {self.node_id} takes no image")

    def prepare(self, item):
        if "explode" in item.prompt:
            raise KeyError("explode")
        return item


def test_stage_check_refuses_before_anything_runs_and_prepare_failures_stay_local():
    omni = Omni("echo", host=kernel_host())
    stage = omni.graph.stages["echo"]
    omni.graph.stages["echo"] = PickyStage(stage.node, stage.kind, stage.engine)
    with pytest.raises(InputError, match="takes no image"):
        omni.submit(omni.request("x", image="cat.png"))
    assert not omni.scheduler.in_flight
    omni.submit(omni.request("fine words", request_id="ok"))
    omni.submit(omni.request("explode now", request_id="bad"))
    events = drain(omni.scheduler)
    assert outcome(events, "bad").error == "KeyError: 'explode'"
    assert outcome(events, "ok").result.text == "fine words"


def test_generate_raises_user_errors_as_user_errors_and_others_as_request_errors():
    omni = Omni("echo", host=kernel_host())
    with pytest.raises(UserError, match="must not be empty"):
        omni.generate("")
    scheduler = two_node_scheduler(fail_execute=bad_prompt("boom", RuntimeError("kaput")))
    with pytest.raises(RequestError, match="kaput") as info:
        scheduler.generate(Request("two", "boom"))
    assert not isinstance(info.value, UserError)
    assert scheduler.generate(Request("two", "fine")).text == stage_text("b", f"to_text[{stage_text('a', 'fine')}]")


# ---- helpers never lose another request's events -------------------------------------------------------------

def test_generate_while_others_are_in_flight_keeps_their_events():
    scheduler = two_node_scheduler()
    others = {"r1": "first request", "r2": "second"}
    for rid, prompt in others.items():
        scheduler.submit(Request("two", prompt, request_id=rid))
    early = scheduler.step()
    mine = list(scheduler.generate_stream(Request("two", "mine", request_id="me")))
    assert {e.request_id for e in mine} == {"me"}
    assert outcome(mine, "me").result.text == stage_text("b", f"to_text[{stage_text('a', 'mine')}]")
    assert scheduler.generate(Request("two", "again")).text.startswith("b<")
    rest = early + drain(scheduler)
    for rid, prompt in others.items():
        assert texts(rest, rid, "a") == stage_text("a", prompt)
        assert texts(rest, rid, "b") == outcome(rest, rid).result.text
        assert [e for e in rest if isinstance(e, StageFinished) and e.request_id == rid][0].node_id == "a"


def test_aborted_generate_raises_request_aborted():
    scheduler = two_node_scheduler()
    stream = scheduler.generate_stream(Request("two", "x", request_id="gone"))
    next(stream)
    scheduler.abort("gone")
    assert [e for e in stream] == [RequestFailed("gone", None, "aborted")]
    assert isinstance(raise_for(RequestFailed("gone", None, "aborted")), RequestAborted)
