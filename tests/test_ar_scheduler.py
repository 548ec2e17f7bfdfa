"""ARScheduler without torch: a fake model writes (position, token) into a fake slot pool through the block
tables and reads its whole context back, so wrong tables, lost blocks or bad prefix hits change the output."""

import random

import pytest

from omni_kernel.core.ar_scheduler import ARPrompt, ARScheduler
from omni_kernel.core.engine import Engine
from omni_kernel.core.errors import EngineDead
from omni_kernel.core.kv_blocks import BlockManager
from omni_kernel.core.request import StageInput
from omni_kernel.testing import drain


def next_token(context) -> int:
    return hash(tuple(context)) % 97


def solo(prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class FakeRunner:
    """Writes each chunk's tokens into a fake slot pool through its block table and samples a token that
    depends on the whole context it reads back; never decides when a request is finished."""

    def __init__(self, block_size):
        self.block_size = block_size
        self.pool: dict[int, tuple[int, int]] = {}
        self.steps: list = []

    def add_request(self, item):
        pass

    def slot(self, table, pos):
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def run(self, batch):
        self.steps.append(batch)
        results = {}
        for chunk in batch.chunks:
            for i, tok in enumerate(chunk.token_ids):
                self.pool[self.slot(chunk.block_table, chunk.start + i)] = (chunk.start + i, tok)
            if chunk.samples:
                context = [self.pool[self.slot(chunk.block_table, p)] for p in range(chunk.context_len)]
                assert [p for p, _ in context] == list(range(chunk.context_len))
                results[chunk.request_id] = next_token([t for _, t in context])
        return results

    def free(self, request_id):
        pass


def make_engine(num_blocks=64, block_size=4, budget=32, max_seqs=8):
    bm = BlockManager(num_blocks, block_size)
    runner = FakeRunner(block_size)
    scheduler = ARScheduler(bm, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    return Engine(scheduler, runner), scheduler, runner, bm


def item(rid, prompt, max_tokens):
    return StageInput(rid, "p", processed=ARPrompt(prompt, max_tokens))


def collect(outputs, records=None, tokens=None):
    """Each finished request's generated tokens (and, into `records`, its ARSequence with its step counters) from
    an engine's RequestOutputs; `tokens` holds what earlier steps already generated."""
    tokens, finished = {} if tokens is None else tokens, {}
    for out in outputs:
        assert out.error is None, out.error
        tokens.setdefault(out.request_id, []).append(out.result)
        if out.finished:
            assert out.finished == "max_tokens"
            finished[out.request_id] = tokens.pop(out.request_id)
            if records is not None:
                records[out.request_id] = out.record
    return finished


def run_all(engine, records=None, tokens=None):
    return collect(drain(engine), records, tokens)


def random_requests(n, seed=0, max_prompt=40, max_out=12):
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(5) for _ in range(rng.randint(1, max_prompt))], rng.randint(1, max_out))
            for i in range(n)]


def test_budget_max_seqs_and_exact_outputs():
    engine, scheduler, runner, bm = make_engine(budget=24, max_seqs=5)
    reqs = random_requests(12)
    for rid, prompt, m in reqs:
        engine.add_request(item(rid, prompt, m))
    finished = run_all(engine)
    assert finished == {rid: solo(p, m) for rid, p, m in reqs}
    assert all(b.num_tokens <= 24 and len(b.chunks) <= 5 for b in runner.steps)
    assert bm.num_used == 0 and not scheduler.sequences


def test_long_prompt_is_prefilled_in_chunks_and_samples_once():
    engine, _, runner, _ = make_engine(budget=16)
    engine.add_request(item("long", list(range(50)), 2))
    run_all(engine)
    chunks = [b.chunks[0] for b in runner.steps]
    assert [c.num_tokens for c in chunks] == [16, 16, 16, 2, 1]
    assert [c.samples for c in chunks] == [False, False, False, True, True]
    assert [c.start for c in chunks] == [0, 16, 32, 48, 50]


def test_decodes_come_first_under_a_tight_budget():
    engine, _, runner, _ = make_engine(budget=8, max_seqs=8)
    for i in range(3):
        engine.add_request(item(f"d{i}", [i + 1], 20))
    engine.step()  # three one-token prompts
    engine.add_request(item("big", list(range(30)), 1))
    engine.step()
    batch = runner.steps[-1]
    assert [c.request_id for c in batch.chunks] == ["d0", "d1", "d2", "big"]
    assert [c.num_tokens for c in batch.chunks] == [1, 1, 1, 5]


def test_preemption_by_recompute_keeps_outputs_exact():
    engine, scheduler, runner, bm = make_engine(num_blocks=16, block_size=4, budget=32, max_seqs=8)
    reqs = random_requests(10, seed=3, max_prompt=20, max_out=24)
    for rid, prompt, m in reqs:
        engine.add_request(item(rid, prompt, m))
    finished = run_all(engine)
    assert scheduler.num_preemptions > 0
    assert any(b.preempted for b in runner.steps)
    assert finished == {rid: solo(p, m) for rid, p, m in reqs}
    assert bm.num_used == 0


def test_requests_arriving_while_others_decode():
    engine, _, _, bm = make_engine(num_blocks=24, budget=16, max_seqs=4)
    reqs = random_requests(9, seed=5)
    pending = list(reqs)

    def arrive(_=()):  # one new request before each step while any are left
        if pending:
            engine.add_request(item(*pending.pop(0)))

    arrive()
    finished = collect(drain(engine, on_step=arrive, until=lambda: not pending and not engine.has_unfinished()))
    assert finished == {rid: solo(p, m) for rid, p, m in reqs}
    assert bm.num_used == 0


def test_abort_frees_every_block_and_spares_the_others():
    engine, scheduler, runner, bm = make_engine(budget=32)
    reqs = random_requests(6, seed=7, max_out=30)
    for rid, prompt, m in reqs:
        engine.add_request(item(rid, prompt, max(m, 10)))
    tokens = {}
    for _ in range(4):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).append(out.result)
    engine.abort("r1")
    engine.abort("r4")
    assert "r1" not in bm.tables and "r4" not in bm.tables
    finished = run_all(engine, tokens=tokens)
    assert set(finished) == {"r0", "r2", "r3", "r5"}
    for rid, prompt, m in reqs:
        if rid in finished:
            assert finished[rid] == solo(prompt, max(m, 10))
    assert bm.num_used == 0 and not scheduler.has_unfinished()


def test_shared_prefix_hits_are_counted_and_outputs_unchanged():
    engine, scheduler, runner, bm = make_engine(num_blocks=64, block_size=4, budget=64)
    system = [1, 2, 3, 4] * 6
    engine.add_request(item("first", system + [9], 3))
    run_all(engine)
    engine.add_request(item("second", system + [8, 7], 3))
    records = {}
    finished = run_all(engine, records=records)
    first_chunk = [c for b in runner.steps for c in b.chunks if c.request_id == "second"][0]
    assert first_chunk.start == 24 and records["second"].prefix_hit_tokens == 24
    assert finished["second"] == solo(system + [8, 7], 3)
    assert bm.hit_tokens == 24


def test_a_request_done_in_its_first_step_still_feeds_the_prefix_cache():
    engine, _, runner, bm = make_engine(num_blocks=64, block_size=4, budget=64)
    engine.add_request(item("a", list(range(20)), 1))
    run_all(engine)
    engine.add_request(item("b", list(range(20)) + [5], 1))
    records = {}
    run_all(engine, records=records)
    assert records["b"].prefix_hit_tokens == 20 and runner.steps[-1].chunks[0].start == 20


def test_a_failed_step_commits_nothing():
    bm = BlockManager(16, 4)
    scheduler = ARScheduler(bm, max_num_batched_tokens=64)
    scheduler.add(item("a", list(range(12)), 1))
    batch = scheduler.schedule()
    scheduler.abort("a")  # the engine aborts a request whose step failed before it updates
    assert scheduler.update(batch, {}) == []
    assert bm.num_used == 0 and bm.num_cached == 0 and not bm.by_hash


def test_the_scheduler_decides_eos_budget_and_context_window():
    def finish(prompt, max_tokens=None, ignore_eos=False, eos=(), window=None, steps=50):
        scheduler = ARScheduler(BlockManager(64, 4), eos_token_ids=eos, context_window=window)
        engine = Engine(scheduler, FakeRunner(4))
        engine.add_request(StageInput("r", "p", processed=ARPrompt(prompt, max_tokens, ignore_eos)))
        outs = [o for _ in range(steps) for o in engine.step()]
        return [o.finished for o in outs if o.finished], sum(1 for o in outs), outs[-1].record
    first = solo([1, 2, 3], 1)[0]
    assert finish([1, 2, 3], eos={first})[:2] == (["eos"], 1)
    assert finish([1, 2, 3], max_tokens=1, eos={first}, ignore_eos=True)[:2] == (["max_tokens"], 1)
    assert finish([1, 2, 3], max_tokens=4, window=5)[:2] == (["context_window"], 2)
    assert finish([1, 2, 3], max_tokens=2, window=5)[:2] == (["max_tokens"], 2)  # a tie: the budget wins
    reasons, count, seq = finish([1, 2, 3], max_tokens=5)
    assert reasons == ["max_tokens"] and count == 5
    assert (seq.num_prompt, seq.num_output, seq.num_prefill_steps, seq.num_decode_steps) == (3, 5, 1, 4)


def test_an_unprocessed_input_and_a_pool_too_small_are_reported():
    scheduler = ARScheduler(BlockManager(2, 2))
    with pytest.raises(TypeError, match="ARPrompt"):
        scheduler.add(StageInput("x", "p"))
    engine, *_ = make_engine(num_blocks=2, block_size=2, budget=8)
    engine.add_request(item("huge", [1, 2, 3], 5))
    outs = [o for _ in range(10) for o in engine.step()]
    assert [type(o.error) for o in outs if o.error] == [EngineDead] and "KV pool" in str(outs[-1].error)
    assert not engine.has_unfinished()
