"""StepScheduler and DiffusionScheduler: batch keys, step counts, phases, continuous admission, abort."""

from __future__ import annotations

import pytest

from omni_kernel.core.request import StageInput
from omni_kernel.core.scheduler import DiffusionScheduler, StepScheduler


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


def test_a_step_count_below_one_is_refused():
    with pytest.raises(ValueError, match="at least one step"):
        StepScheduler(num_steps=lambda i: 0).add(item("x"))
    with pytest.raises(ValueError, match=">= 0 denoise steps"):
        DiffusionScheduler(num_steps=lambda i: -1).add(item("x"))


def test_diffusion_scheduler_names_the_phases_and_batches_only_one_phase():
    scheduler = DiffusionScheduler(max_batch=4, num_steps=lambda i: i.processed)
    scheduler.add(item("a", 2))
    scheduler.add(item("b", 2))
    scheduler.add(item("c", 1))
    phases = []
    while scheduler.has_unfinished():
        batch, done = advance(scheduler)
        phases.append((batch.phase, batch.request_ids, batch.steps, [r for r, f in done if f]))
    assert phases == [("prepare", ("a", "b", "c"), (0, 0, 0), []),
                      ("denoise", ("a", "b", "c"), (1, 1, 1), []),
                      ("denoise", ("a", "b"), (2, 2), []),  # c is at its decode step: a different phase
                      ("decode", ("a", "b", "c"), (3, 3, 2), []),  # and c waited one step to rejoin them
                      ("export", ("a", "b", "c"), (4, 4, 3), ["a", "b", "c"])]
