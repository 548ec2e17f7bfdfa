"""StepScheduler and PhaseScheduler: batch keys, step counts, phases, continuous admission, abort, background work."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from omni_kernel.core.request import StageInput
from omni_kernel.core.scheduler import PhaseScheduler, StepScheduler


def item(rid: str, steps: int = 2, shape: str = "s") -> StageInput:
    return StageInput(rid, shape, processed=steps)


def advance(scheduler) -> tuple:
    batch = scheduler.schedule()
    done = scheduler.update(batch, {rid: f"{rid}@{step}" for rid, step in zip(batch.request_ids, batch.steps)})
    return batch, [(o.request_id, o.finished) for o in done]


def test_step_scheduler_batches_the_front_requests_that_share_a_key_up_to_max_batch():
    scheduler = StepScheduler(max_batch=2, batch_key=lambda i: i.prompt, num_steps=lambda i: i.processed)
    for rid, shape in [("a", "big"), ("b", "small"), ("c", "big"), ("d", "big")]:
        scheduler.add(item(rid, 1, shape))
    batch, done = advance(scheduler)
    assert batch.request_ids == ("a", "c") and done == [("a", "done"), ("c", "done")]
    assert advance(scheduler)[0].request_ids == ("b",)
    assert advance(scheduler)[0].request_ids == ("d",)
    assert not scheduler.has_unfinished() and not scheduler.schedule()


def test_each_request_takes_its_own_number_of_steps_and_a_new_one_joins_between_steps():
    scheduler = StepScheduler(max_batch=8, num_steps=lambda i: i.processed)
    scheduler.add(item("long", 3))
    batch, done = advance(scheduler)
    assert batch.steps == (0,) and done == [("long", None)]
    scheduler.add(item("short", 1))
    batch, done = advance(scheduler)
    assert (batch.request_ids, batch.steps) == (("long", "short"), (1, 0))
    assert done == [("long", None), ("short", "done")]
    assert advance(scheduler)[1] == [("long", "done")] and scheduler.request_ids() == set()


def test_a_request_missing_from_the_results_failed_and_is_not_advanced():
    scheduler = StepScheduler(max_batch=2, num_steps=lambda i: i.processed)
    scheduler.add(item("ok", 2))
    scheduler.add(item("bad", 2))
    batch = scheduler.schedule()
    scheduler.abort("bad")  # what the engine does for a request whose step failed
    assert [o.request_id for o in scheduler.update(batch, {"ok": 1})] == ["ok"]
    assert scheduler.request_ids() == {"ok"} and scheduler.schedule().steps == (1,)


def phases(item: StageInput) -> tuple[str, ...]:
    """A plugin's phases: one setup step, `item.processed` work steps, one teardown step."""
    return ("setup", *["work"] * item.processed, "teardown")


def test_a_step_count_below_one_is_refused():
    with pytest.raises(ValueError, match="at least one step"):
        StepScheduler(num_steps=lambda i: 0).add(item("x"))
    with pytest.raises(ValueError, match="at least one step, named by a phase"):
        PhaseScheduler(phases=lambda i: ()).add(item("x"))
    with pytest.raises(TypeError):
        PhaseScheduler(num_steps=lambda i: 1)  # its steps are its phases


def test_phase_scheduler_takes_the_plugins_phases_and_batches_only_one_phase():
    scheduler = PhaseScheduler(max_batch=4, phases=phases)
    scheduler.add(item("a", 2))
    scheduler.add(item("b", 2))
    scheduler.add(item("c", 1))
    seen = []
    while scheduler.has_unfinished():
        batch, done = advance(scheduler)
        seen.append((batch.phase, batch.request_ids, batch.steps, [r for r, f in done if f]))
    assert seen == [("setup", ("a", "b", "c"), (0, 0, 0), []),
                    ("work", ("a", "b", "c"), (1, 1, 1), []),
                    ("work", ("a", "b"), (2, 2), []),  # c is at its teardown step: a different phase
                    ("teardown", ("a", "b", "c"), (3, 3, 2), ["a", "b", "c"])]  # c waited one step for them


def test_phase_order_runs_the_first_listed_phase_any_request_is_in():
    scheduler = PhaseScheduler(max_batch=4, phases=phases, phase_order=("teardown", "setup", "work"))
    scheduler.add(item("a", 3))
    assert advance(scheduler)[0].phase == "setup"
    assert advance(scheduler)[0].phase == "work"
    scheduler.add(item("b", 3))
    batch, _ = advance(scheduler)
    assert (batch.phase, batch.request_ids) == ("setup", ("b",))  # the newcomer goes first ...
    batch, _ = advance(scheduler)
    assert (batch.phase, batch.request_ids, batch.steps) == ("work", ("a", "b"), (2, 1))  # ... and joins a


def test_a_future_on_an_earlier_step_holds_the_request_until_it_is_done_then_it_goes_on():
    scheduler = StepScheduler(max_batch=2, num_steps=lambda i: i.processed)
    scheduler.add(item("bg", 3))
    scheduler.add(item("other", 3))
    background: Future = Future()
    batch = scheduler.schedule()
    out = scheduler.update(batch, {"bg": background, "other": "o@0"})
    assert [o.request_id for o in out] == ["other"]  # no output for bg yet: its step is not done
    assert scheduler.schedule().request_ids == ("other",)  # held: not scheduled again
    scheduler.update(scheduler.schedule(), {"other": "o@1"})
    assert scheduler.collect() == [] and scheduler.wait(0) is True  # other is ready
    background.set_result("made")
    collected = scheduler.collect()
    assert [(o.request_id, o.result, o.finished) for o in collected] == [("bg", "made", None)]
    assert collected[0].record.step == 1 and collected[0].record.pending is None
    batch = scheduler.schedule()
    assert (batch.request_ids, batch.steps) == (("bg", "other"), (1, 2))  # bg goes on with its next step
    done = scheduler.update(batch, {"bg": "b@1", "other": "o@2"})
    assert [(o.request_id, o.finished) for o in done] == [("bg", None), ("other", "done")]
    last: Future = Future()
    assert scheduler.update(scheduler.schedule(), {"bg": last}) == []  # a Future on its last step ...
    assert scheduler.has_unfinished() and not scheduler.schedule()
    last.set_result("file")
    assert [(o.request_id, o.result, o.finished) for o in scheduler.collect()] == [("bg", "file", "done")]
    assert not scheduler.has_unfinished()  # ... finishes it once done


def test_a_failed_background_step_fails_its_request():
    scheduler = StepScheduler(num_steps=lambda i: i.processed)
    scheduler.add(item("bg", 3))
    background: Future = Future()
    scheduler.update(scheduler.schedule(), {"bg": background})
    background.set_exception(OSError("disk full"))
    (out,) = scheduler.collect()
    assert isinstance(out.error, OSError) and out.finished is None and not scheduler.has_unfinished()


# ---- open requests: an input that streams in (StageInput.stream, StepScheduler.extend) ----------------------

def more(steps: int):
    """What a stage's input processor does with a chunk, here: the request's input with `steps` steps."""
    return lambda item: StageInput(item.request_id, item.prompt, processed=steps, stream=True)


def test_an_open_request_runs_the_steps_it_has_then_waits_for_its_next_chunk():
    scheduler = StepScheduler(max_batch=4, num_steps=lambda i: i.processed)
    scheduler.add(StageInput("s", "", processed=0, stream=True))
    scheduler.add(item("plain", 3))
    assert advance(scheduler)[0].request_ids == ("plain",)  # "s" has nothing to run yet
    scheduler.extend("s", more(1), last=False)
    batch, done = advance(scheduler)
    assert batch.request_ids == ("s", "plain") and done == [("s", None), ("plain", None)]
    batch, done = advance(scheduler)
    assert batch.request_ids == ("plain",) and done == [("plain", "done")]  # "s" waits, unfinished
    assert scheduler.has_unfinished() and not scheduler.wait(0) and not scheduler.schedule()
    scheduler.extend("s", more(2), last=True)
    assert scheduler.wait(0)
    batch, done = advance(scheduler)
    assert batch.steps == (1,) and done == [("s", "done")]
    assert not scheduler.has_unfinished()


def test_a_last_chunk_that_adds_no_step_finishes_the_request_at_the_next_collect():
    scheduler = StepScheduler(num_steps=lambda i: i.processed)
    scheduler.add(StageInput("s", "", processed=1, stream=True))
    assert advance(scheduler)[1] == [("s", None)]
    scheduler.extend("s", more(1), last=True)
    assert scheduler.wait(0) and not scheduler.schedule()
    assert [(o.request_id, o.result, o.finished) for o in scheduler.collect()] == [("s", None, "done")]
    assert not scheduler.has_unfinished()


def test_extend_refuses_what_it_cannot_take_and_ignores_a_request_it_does_not_hold():
    scheduler = StepScheduler(num_steps=lambda i: i.processed)
    assert scheduler.extend("gone", more(1), last=True) is None
    scheduler.add(item("closed", 1))
    with pytest.raises(ValueError, match="takes no more input"):
        scheduler.extend("closed", more(2), last=False)
    scheduler.add(StageInput("s", "", processed=2, stream=True))
    with pytest.raises(ValueError, match="took back steps"):
        scheduler.extend("s", more(1), last=False)
    assert scheduler.abort("s") is not None and scheduler.extend("s", more(3), last=True) is None
