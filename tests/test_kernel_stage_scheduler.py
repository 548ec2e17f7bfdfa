"""StageScheduler behaviour: streaming, concurrency, abort at any step, per-request failures, helpers."""

from __future__ import annotations

import pytest

from omni_kernel import Omni
from omni_kernel.builtin.echo import KernelPlugin
from omni_kernel.core.errors import EngineDead, InputError, InvalidParameter, RequestAborted, RequestError, UserError
from omni_kernel.core.graph import EdgeSpec, NodeSpec, PipelinePlan
from omni_kernel.core.request import Request
from omni_kernel.core.stage import Inputs
from omni_kernel.core.stage_scheduler import StageScheduler
from omni_kernel.events import RequestFailed, RequestFinished, StageFinished, TokenDelta
from omni_kernel.plugins import PluginHost
from omni_kernel.testing import drain

from kernel_fakes import TagConnector, bad_prompt, holds, registry_with, stage_text

TWO_NODES = PipelinePlan("two", [NodeSpec("a", "t.ar"), NodeSpec("b", "t.text", final=True)],
                         [EdgeSpec("a", "b", "to_text")])


def kernel_host() -> PluginHost:
    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel")
    return host


def two_node_scheduler(log=None, connector=None, **stage_kwargs) -> Omni:
    """An Omni of the two-node pipeline over fake stages, on a host of its own."""
    host = PluginHost()
    connectors = [connector or TagConnector("to_text", "ar", "text")]
    host.registry = registry_with({"t.ar": "ar", "t.text": "text"}, connectors,
                                  [] if log is None else log, **stage_kwargs)
    return Omni(TWO_NODES, host=host)


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
    result = Omni("echo", host=kernel_host()).generate("one two three four", max_tokens=2)
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
        assert [e for e in after if e.request_id == victim] == [RequestFailed(victim, None, "aborted", "aborted")]
        assert ("finish", "b", victim) not in log
    for rid in set(prompts) - {victim}:
        result = outcome(before + after, rid).result
        assert result.text == stage_text("b", f"to_text[{stage_text('a', prompts[rid])}]")
    assert not scheduler.scheduler.in_flight and not scheduler.has_unfinished()


def test_closing_a_stream_early_aborts_its_request():
    omni = Omni("echo", host=kernel_host())
    stream = omni.generate_stream("a b c d e f")
    first = next(stream)
    assert isinstance(first, TokenDelta)
    rid = first.request_id
    stream.close()
    stage = omni.graph.stages["echo"]
    assert rid not in omni.scheduler.in_flight and rid not in stage.engine.request_ids()
    assert not omni.has_unfinished()


# ---- failures stay with their request ----------------------------------------------------------------------

def test_runner_refusing_one_request_at_add_fails_only_that_request():
    scheduler = two_node_scheduler(fail_add=bad_prompt("bad"))
    for rid, prompt in {"ok1": "fine", "bad": "bad one", "ok2": "also fine"}.items():
        scheduler.submit(Request("two", prompt, request_id=rid))
    events = drain(scheduler)
    failed = outcome(events, "bad")
    assert isinstance(failed, RequestFailed) and failed.node_id == "a" and failed.user_error
    assert (failed.kind, failed.field) == ("invalid_parameter", "prompt") and "contains bad" in failed.error
    assert isinstance(failed.exception(), InvalidParameter) and failed.exception().field == "prompt"
    for rid in ("ok1", "ok2"):
        assert isinstance(outcome(events, rid), RequestFinished)


def test_runner_raising_during_a_step_fails_only_its_batch():
    log: list = []
    scheduler = two_node_scheduler(log, max_batch=1, fail_run=bad_prompt("boom", RuntimeError("kaput")))
    for rid, prompt in {"ok1": "fine", "boom": "boom", "ok2": "also fine"}.items():
        scheduler.submit(Request("two", prompt, request_id=rid))
    events = drain(scheduler)
    failed = outcome(events, "boom")
    assert isinstance(failed, RequestFailed) and not failed.user_error and failed.error == "RuntimeError: kaput"
    assert failed.kind == "runtime" and type(failed.exception()) is RequestError
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
    assert failed.error.startswith("ValueError: cannot convert")
    assert [type(e) for e in events if e.request_id == "bad"][-2:] == [StageFinished, RequestFailed]
    for rid in ("ok1", "ok2"):
        assert isinstance(outcome(events, rid), RequestFinished)
    assert all(not holds(stage, "bad") for stage in scheduler.graph.stages.values())


class PickyInputs(Inputs):
    """Processes inputs once (counted); `check` refuses early for downstream nodes."""

    def __init__(self, node_id):
        self.node_id = node_id
        self.processed: list[str] = []

    def check(self, item):
        if "never" in item.prompt:
            raise InputError(f"node {self.node_id} can never serve {item.prompt!r}")

    def process(self, item):
        self.processed.append(item.prompt)
        if "explode" in item.prompt:
            raise KeyError("explode")
        return item


def picky_scheduler() -> StageScheduler:
    scheduler = two_node_scheduler()
    for node_id, stage in scheduler.graph.stages.items():
        stage.inputs = PickyInputs(node_id)
    return scheduler


def test_inputs_are_processed_once_entry_at_submit_downstream_at_hand_off():
    scheduler = picky_scheduler()
    a, b = scheduler.graph.stages["a"].inputs, scheduler.graph.stages["b"].inputs
    scheduler.submit(Request("two", "fine", request_id="ok"))
    assert (a.processed, b.processed) == (["fine"], [])
    events = drain(scheduler)
    assert b.processed == [f"to_text[{stage_text('a', 'fine')}]"] and a.processed == ["fine"]
    assert isinstance(outcome(events, "ok"), RequestFinished)


def test_process_and_check_errors_are_synchronous_at_submit():
    scheduler = picky_scheduler()
    with pytest.raises(KeyError, match="explode"):
        scheduler.submit(Request("two", "explode now"))
    with pytest.raises(InputError, match="can never serve"):  # node b's check: node a drops what it took
        scheduler.submit(Request("two", "never mind", request_id="never"))
    assert not scheduler.scheduler.in_flight and not scheduler.has_unfinished()
    assert not holds(scheduler.graph.stages["a"], "never")


def test_step_engine_hands_each_output_to_its_owner_and_keeps_a_failure_to_its_requests(caplog):
    """The kernel's stepping rule (core/stepping.py), which a stage worker follows too: each output goes to the
    stage that runs its request (none: dropped), a stage's broken output processor fails its own requests, and a
    step that raises fails every request on the engine, each logged once."""
    from omni_kernel.core.scheduler import RequestOutput
    from omni_kernel.core.stepping import step_engine
    from omni_kernel.events import StageFailed

    class Owner:
        def __init__(self, node_id, broken=False):
            self.node_id, self.broken = node_id, broken

        def events_for(self, outputs):
            if self.broken:
                raise ValueError("broken outputs")
            return [TokenDelta(o.request_id, self.node_id, o.result) for o in outputs]

    class Engine:
        def __init__(self, outputs):
            self.outputs = outputs

        def step(self):
            if isinstance(self.outputs, Exception):
                raise self.outputs
            return self.outputs

    good, broken = Owner("good"), Owner("broken", broken=True)
    owners = {"r1": good, "r2": broken, "r3": good}
    outputs = [RequestOutput(rid, result=rid) for rid in ("r1", "r2", "r3", "gone")]
    pairs = step_engine(Engine(outputs), owners.get, lambda: list(owners.items()))
    assert [(s.node_id, type(e).__name__, e.request_id) for s, e in pairs] == [
        ("good", "TokenDelta", "r1"), ("good", "TokenDelta", "r3"), ("broken", "StageFailed", "r2")]
    assert "ValueError: broken outputs" in pairs[2][1].error
    caplog.clear()
    pairs = step_engine(Engine(RuntimeError("engine down")), owners.get, lambda: list(owners.items()))
    assert [(s.node_id, e.request_id) for s, e in pairs] == [("good", "r1"), ("broken", "r2"), ("good", "r3")]
    assert all(isinstance(e, StageFailed) and "engine down" in e.error for _, e in pairs)
    assert [r.getMessage() for r in caplog.records] == ["stage engine failed: RuntimeError: engine down"]


def test_a_failed_hand_off_fails_that_request_only():
    scheduler = picky_scheduler()
    scheduler.graph.connectors[("a", "b")] = TagConnector("explode", "ar", "text")
    scheduler.submit(Request("two", "fine", request_id="r"))
    failed = outcome(drain(scheduler), "r")
    assert isinstance(failed, RequestFailed) and failed.node_id == "b" and failed.error == "KeyError: 'explode'"


def test_unknown_request_parameters_and_inputs_are_refused_by_name():
    omni = Omni("echo", host=kernel_host())
    with pytest.raises(InvalidParameter, match="has no request parameter 'max_tokns'; valid request parameters: "
                                               "frequency_penalty, ignore_eos, max_tokens, min_p") as info:
        omni.generate("x", max_tokns=3)
    assert info.value.field == "max_tokns"
    with pytest.raises(InvalidParameter, match="takes no input image"):
        omni.generate("x", image="cat.png")
    with pytest.raises(InvalidParameter, match="temperature"):
        omni.generate("x", temperature="hot")
    with pytest.raises(InvalidParameter, match="has no config key 'ar_kv_memroy'"):
        Omni("echo", host=kernel_host(), ar_kv_memroy=1)
    assert not omni.has_unfinished()


class BrokenScheduler:
    """Delegates to a real scheduler until told to break."""

    def __init__(self, inner):
        self.inner, self.broken = inner, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def schedule(self):
        if self.broken:
            raise RuntimeError("scheduler state corrupted")
        return self.inner.schedule()


def test_a_scheduler_exception_marks_the_engine_dead_and_fails_what_it_holds():
    scheduler = two_node_scheduler()
    stage_b = scheduler.graph.stages["b"]
    stage_b.engine.scheduler = BrokenScheduler(stage_b.engine.scheduler)
    for rid in ("r1", "r2"):
        scheduler.submit(Request("two", "some words", request_id=rid))
    events = []
    while not stage_b.engine.request_ids():
        events += scheduler.step()
    stage_b.engine.scheduler.broken = True
    events += drain(scheduler)
    for rid in ("r1", "r2"):
        failed = outcome(events, rid)
        assert isinstance(failed, RequestFailed) and failed.kind == "engine_dead" and failed.node_id == "b"
        assert isinstance(failed.exception(), EngineDead) and "scheduler state corrupted" in failed.error
    scheduler.submit(Request("two", "late", request_id="late"))  # stage a still works; b refuses at once
    late = outcome(drain(scheduler), "late")
    assert late.kind == "engine_dead" and not scheduler.has_unfinished()


def test_a_stage_whose_step_raises_fails_its_requests_and_the_loop_goes_on():
    scheduler = two_node_scheduler()
    stage_a = scheduler.graph.stages["a"]
    stage_a.outputs.process = lambda outputs: 1 / 0
    scheduler.submit(Request("two", "x", request_id="r"))
    failed = outcome(drain(scheduler), "r")
    assert failed.kind == "runtime" and "ZeroDivisionError" in failed.error
    assert not holds(stage_a, "r")


def test_a_request_that_fails_alone_in_a_batch_does_not_take_its_neighbours():
    log: list = []
    scheduler = two_node_scheduler(log, max_batch=4, alone=True, fail_run=bad_prompt("nan", ValueError("nan")))
    for rid, prompt in {"ok1": "fine", "nan": "nan here", "ok2": "also fine"}.items():
        scheduler.submit(Request("two", prompt, request_id=rid))
    events = drain(scheduler)
    assert outcome(events, "nan").error == "ValueError: nan"
    for rid in ("ok1", "ok2"):
        assert isinstance(outcome(events, rid), RequestFinished)


def test_generate_raises_user_errors_as_user_errors_and_others_as_request_errors():
    omni = Omni("echo", host=kernel_host())
    with pytest.raises(UserError, match="the prompt is empty"):
        omni.generate("")
    scheduler = two_node_scheduler(fail_run=bad_prompt("boom", RuntimeError("kaput")))
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
    assert [e for e in stream] == [RequestFailed("gone", None, "aborted", "aborted")]
    assert isinstance(RequestFailed("gone", None, "aborted", "aborted").exception(), RequestAborted)


def test_wait_says_whether_a_step_would_make_progress():
    omni = Omni("echo", host=kernel_host())
    assert omni.scheduler.wait(0) is False
    omni.submit(omni.request("a b", request_id="w"))
    assert omni.scheduler.wait(0) is True
    drain(omni.scheduler)
    assert omni.scheduler.wait(0) is False
