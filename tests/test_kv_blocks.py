"""KV block bookkeeping: unit cases and a hypothesis state machine over every interleaving of verbs."""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from omni_kernel.core.kv_blocks import BlockManager


def test_allocate_append_free_accounting():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", list(range(10)), 10) == 0
    assert len(bm.table("a")) == 3 and bm.num_used == 3 and bm.num_free == 5
    assert bm.can_append("a", 12) and not bm.can_append("a", 100)
    bm.append_slots("a", 13)
    assert len(bm.table("a")) == 4
    bm.free("a")
    assert bm.num_free == 8 and bm.num_used == 0


def test_prefix_hit_only_after_commit_and_leaves_one_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(12))
    bm.allocate("a", prompt, 12)
    assert bm.match_prefix(prompt + [99]) == []  # nothing computed yet
    bm.commit("a", prompt, 12)
    assert bm.match_prefix(prompt + [99]) == bm.table("a")
    assert len(bm.match_prefix(prompt)) == 2  # the last token is always left to compute
    assert bm.allocate("b", prompt + [99], 13) == 12
    assert bm.table("b")[:3] == bm.table("a")
    assert bm.blocks[bm.table("a")[0]].ref_count == 2
    assert bm.hit_tokens == 12


def test_freed_hashed_blocks_stay_cached_then_get_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", [1, 2, 3, 4, 5], 5)
    bm.commit("a", [1, 2, 3, 4, 5], 5)
    bm.free("a")
    assert bm.num_cached == 2 and bm.num_free == 4
    assert bm.allocate("b", [1, 2, 3, 4, 9], 5) == 4  # both cached blocks come back
    bm.free("b")
    bm.allocate("c", [7] * 8, 8)  # needs every block: the cache is evicted
    assert bm.num_cached == 0 and bm.match_prefix([1, 2, 3, 4, 5]) == []


def test_can_allocate_counts_cached_hits_taken_from_free():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate("a", [1, 2, 3, 4, 5], 5)
    bm.commit("a", [1, 2, 3, 4, 5], 4)
    bm.free("a")
    assert bm.can_allocate([1, 2, 3, 4, 6], 5)
    assert not bm.can_allocate([1, 2, 3, 4, 6, 7, 8], 7)


def test_prefix_caching_off_and_collision_guard():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    bm.allocate("a", [1, 2, 3], 3)
    bm.commit("a", [1, 2, 3], 3)
    assert bm.match_prefix([1, 2, 3]) == [] and bm.num_cached == 0
    with pytest.raises(ValueError):
        bm.allocate("a", [1], 1)
    with pytest.raises(MemoryError):
        bm.allocate("b", [0] * 20, 20)


class BlockMachine(RuleBasedStateMachine):
    """Sequences draw tokens from a tiny alphabet so prefixes are shared often."""

    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=2)
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.counter = 0

    def _new(self, tokens):
        if not self.bm.can_allocate(tokens, len(tokens)):
            return None
        sid = f"s{self.counter}"
        self.counter += 1
        cached = self.bm.allocate(sid, tokens, len(tokens))
        assert cached % self.bm.block_size == 0 and cached < len(tokens)
        self.tokens[sid], self.computed[sid] = list(tokens), cached
        return sid

    @rule(target=seqs, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def allocate(self, tokens):
        return self._new(tokens)

    @rule(target=seqs, seq=seqs, extra=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def share_prefix(self, seq, extra):
        if seq not in self.tokens:
            return None
        return self._new(self.tokens[seq][: self.computed[seq]] + extra)

    @rule(seq=seqs)
    def compute(self, seq):
        if seq in self.tokens:
            self.computed[seq] = len(self.tokens[seq])
            self.bm.commit(seq, self.tokens[seq], self.computed[seq])

    @rule(seq=seqs, token=st.integers(0, 2))
    def append(self, seq, token):
        if seq in self.tokens and self.computed[seq] == len(self.tokens[seq]):
            if self.bm.can_append(seq, len(self.tokens[seq]) + 1):
                self.tokens[seq].append(token)
                self.bm.append_slots(seq, len(self.tokens[seq]))

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if seq in self.tokens:
            self.bm.free(seq)
            del self.tokens[seq], self.computed[seq]

    @rule(tokens=st.lists(st.integers(0, 2), min_size=20, max_size=24))
    def evict_by_pressure(self, tokens):
        self._new(tokens)  # a long sequence forces eviction of cached blocks when it fits at all

    @precondition(lambda self: self.bm.num_cached > 0)
    @rule()
    def reset_cache(self):
        self.bm.reset_prefix_cache()

    @invariant()
    def bookkeeping_holds(self):
        bm = self.bm
        refs = Counter(b for sid in self.tokens for b in bm.table(sid))
        free = set(bm.empty) | set(bm.cached)
        assert len(free) == len(bm.empty) + len(bm.cached)
        for block in bm.blocks:
            assert block.ref_count == refs.get(block.block_id, 0)
            assert (block.ref_count == 0) == (block.block_id in free)
            assert (block.block_id in bm.cached) == (block.ref_count == 0 and block.hash is not None)
        assert bm.num_free + bm.num_used == bm.num_blocks
        assert bm.num_used == len(refs)
        for h, block_id in bm.by_hash.items():
            assert bm.blocks[block_id].hash == h
        for sid, tokens in self.tokens.items():
            assert len(bm.table(sid)) == bm.blocks_for(len(tokens))

    def teardown(self):
        for sid in list(self.tokens):
            self.bm.free(sid)
        assert self.bm.num_free == self.bm.num_blocks and self.bm.num_used == 0
        assert all(b.ref_count == 0 for b in self.bm.blocks)


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
