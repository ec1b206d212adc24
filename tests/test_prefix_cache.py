"""memory/prefix_cache.py: hash chains, reference counts, LRU eviction (docs/kv-cache.md, "Prefix caching").

The property tests run jobs over random token lists built from a few shared prefixes, with a shadow of what
each block holds: a job writes its blocks' contents when it computes them and reads them back on a hit, so a
block handed out (or evicted) while a job still held it would show as a wrong read."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memory.block_allocator import OutOfBlocks
from memory.prefix_cache import CachingBlockAllocator, block_hashes, extend_chain, hash_block

BS = 4


def test_hash_chain_names_a_block_by_everything_before_it():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    assert len(a) == 2  # full blocks only
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS)
    assert a == b
    c = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], BS)
    assert c[1] != a[1]  # same tokens in block 1, different history
    assert block_hashes([1, 2, 3, 4], BS, salt="t1") != block_hashes([1, 2, 3, 4], BS, salt="t2")
    assert block_hashes([1, 2, 3, 4], BS, salt=None) == block_hashes([1, 2, 3, 4], BS, salt="")
    known = block_hashes([1, 2, 3, 4], BS)
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS, known=known) == a and known == a
    assert hash_block(None, [1, 2, 3, 4]) == a[0]


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**40), max_size=40), cut=st.integers(0, 10),
       salt=st.sampled_from([None, "", "t"]), bs=st.integers(1, 5))
def test_extend_chain_names_as_hash_block_does(tokens, cut, salt, bs):
    """The packed, one-buffer-per-digest chain (what the KV manager names blocks with) against the slow reference,
    hash_block block by block, from an empty chain and from one already started (`cut` blocks)."""
    reference, parent = [], None
    for i in range(len(tokens) // bs):
        parent = hash_block(parent, tokens[i * bs:(i + 1) * bs], salt)
        reference.append(parent)
    cut = min(cut, len(reference))
    chain = reference[:cut]
    extend_chain(chain, tokens[cut * bs:], bs, salt if not chain else None)
    assert chain == reference
    for i in range(cut, len(reference)):  # one block at a time, as a decoding job's blocks fill
        chain = reference[:i]
        extend_chain(chain, tokens[i * bs:(i + 1) * bs], bs, salt if not chain else None)
        assert chain == reference[:i + 1]


def test_bulk_verbs_agree_with_the_single_ones():
    pool = CachingBlockAllocator(6)
    blocks = pool.allocate("a", 5)
    names = block_hashes(list(range(5 * BS)), BS)
    pool.register(blocks[1], names[1])  # one already named: the bulk call skips it as register() would
    pool.register_many(blocks, names)
    assert pool.names_of(blocks) == names and pool.blocks_named(names + [None]) == blocks + [None]
    assert pool.num_unheld(blocks) == 0 and pool.num_free == 1
    pool.free("a", blocks[3:])
    assert pool.num_unheld(blocks) == 2 and pool.num_free == 3
    assert pool.evictable_names(blocks[::-1] + blocks) == {blocks[4]: names[4], blocks[3]: names[3]}
    with pytest.raises(AssertionError):
        pool.register_many(blocks[3:], names[3:])  # not held any more
    pool.check_invariants()


def test_share_release_evict_lru():
    pool = CachingBlockAllocator(4)
    x = pool.allocate("a", 2)
    hx = block_hashes(list(range(8)), BS)
    assert pool.register(x[0], hx[0]) and pool.register(x[1], hx[1])
    assert not pool.register(x[1], hx[1])  # already named
    assert pool.lookup(hx) == x
    pool.share("b", x[:1])
    assert pool.ref_count(x[0]) == 2 and pool.num_used == 2 and pool.num_refs == 3
    pool.free("a", x)
    # x[1] is kept (evictable), x[0] still held by b.
    assert pool.evictable_order() == [x[1]] and pool.num_free == 3 and pool.lookup(hx) == x
    pool.free("b", x[:1])
    assert pool.evictable_order() == [x[1], x[0]]  # the tail is evicted before the head
    with pytest.raises(AssertionError):
        pool.free("b", x[:1])
    y = pool.allocate("c", 3)  # two free blocks, then the least recent evictable
    assert x[1] in y and pool.lookup(hx) == [x[0]]  # the chain's tail went; its head still serves a hit
    with pytest.raises(OutOfBlocks):
        pool.allocate("c", 2)
    pool.check_invariants()


def test_a_taken_name_leaves_the_block_private():
    pool = CachingBlockAllocator(3)
    h = block_hashes([7, 7, 7, 7], BS)[0]
    a, b = pool.allocate("a", 1)[0], pool.allocate("b", 1)[0]
    assert pool.register(a, h) and not pool.register(b, h)
    pool.free("b", [b])
    assert pool.num_evictable == 0 and pool.num_free == 2  # b went back to the free list
    pool.free("a", [a])
    assert pool.evictable_order() == [a]
    assert pool.evict_all() == 1 and pool.num_cached == 0 and pool.num_free == 3
    pool.check_invariants()


def test_one_block_allocations_evict_as_the_general_path_does():
    """allocate(owner, 1) takes the free list's head, else evicts the least recently released block through the same
    hook as a larger allocation; register_fresh names a copy's blocks except where the name is taken."""
    pool = CachingBlockAllocator(3)
    evicted = []
    pool.on_evict = lambda blocks, names: evicted.append((list(blocks), list(names)))
    blocks = pool.allocate("a", 3)
    names = block_hashes(list(range(3 * BS)), BS)
    pool.register_many(blocks, names)
    pool.free("a", blocks)  # released last block first: blocks[2] is the least recent
    assert pool.allocate("b", 1) == [blocks[2]] and evicted == [([blocks[2]], [names[2]])]
    assert pool.owner_of(blocks[2]) == "b" and pool.ref_count(blocks[2]) == 1 and pool.num_evictions == 1
    assert pool.allocate("b", 2) == [blocks[1], blocks[0]] and evicted[1] == ([blocks[1], blocks[0]], names[1::-1])
    with pytest.raises(OutOfBlocks):
        pool.allocate("c", 1)
    pool.free("b", [blocks[0], blocks[1]])  # unnamed now: back to the free list
    pool.register_fresh([blocks[2]], [names[0]])
    assert pool.hash_of(blocks[2]) == names[0]
    fresh = pool.allocate("c", 2)
    pool.register_fresh(fresh, [names[0], names[1]])  # names[0] is taken by blocks[2]: that block stays unnamed
    assert pool.names_of(fresh) == [None, names[1]] and pool.block_of(names[0]) == blocks[2]
    pool.check_invariants()


def test_shared_blocks_count_their_owners():
    pool = CachingBlockAllocator(2)
    x = pool.allocate("a", 1)
    pool.register(x[0], block_hashes(list(range(BS)), BS)[0])
    pool.share("b", x)
    pool.share("c", x)
    assert pool.ref_count(x[0]) == 3 and pool.owners(x[0]) == {"a", "b", "c"} and pool.num_refs == 3
    with pytest.raises(AssertionError):
        pool.share("b", x)  # b holds it already
    pool.free("a", x)
    pool.free("c", x)
    assert pool.owners(x[0]) == {"b"} and pool.owner_of(x[0]) == "b" and pool.holders() == {x[0]: {"b"}}
    pool.check_invariants()
    with pytest.raises(AssertionError):
        pool.free("a", x)  # a let go of it already
    pool.free("b", x)
    assert pool.ref_count(x[0]) == 0 and pool.evictable_order() == x and pool.num_refs == 0
    pool.check_invariants()


# -- property tests ---------------------------------------------------------------------------------------------

class Model:
    """Jobs over a CachingBlockAllocator as memory/kv_manager.py drives it, with a shadow of block contents."""

    def __init__(self, num_blocks: int) -> None:
        self.pool = CachingBlockAllocator(num_blocks)
        self.content: dict[int, bytes] = {}  # block -> the hash of what was last written into it
        self.jobs: dict[str, list[int]] = {}
        self.n = 0

    def start(self, tokens: list[int]) -> bool:
        pool = self.pool
        hashes = block_hashes(tokens, BS)
        hit = pool.lookup(hashes, max_blocks=(len(tokens) - 1) // BS)  # at least one token to compute
        for i, b in enumerate(hit):
            assert self.content[b] == hashes[i], "a cached block was overwritten"
        need = -(-len(tokens) // BS) - len(hit)
        evictable_hits = sum(1 for b in hit if pool.ref_count(b) == 0)
        if need + evictable_hits > pool.num_free:
            return False
        jid = f"j{self.n}"
        self.n += 1
        pool.share(jid, hit)
        for b in hit:  # a hit is never at risk from this job's own allocation
            assert pool.ref_count(b) >= 1
        held = [b for blocks in self.jobs.values() for b in blocks] + hit
        new = pool.allocate(jid, need)
        assert not set(new) & set(held), "a block held by a job was handed out again"
        blocks = hit + new
        for i in range(len(hit), len(hashes)):  # compute, then register each full block
            self.content[blocks[i]] = hashes[i]
            pool.register(blocks[i], hashes[i])
        if len(tokens) % BS:
            self.content[blocks[-1]] = b"partial"
        pool.count_query(len(tokens), len(hit) * BS)
        self.jobs[jid] = blocks
        return True

    def finish(self, i: int) -> None:
        jid = sorted(self.jobs)[i % len(self.jobs)]
        self.pool.free(jid, self.jobs.pop(jid))


prefixes = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=13), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(prefixes=prefixes, data=st.data(), num_blocks=st.integers(4, 24))
def test_random_shared_prefixes_keep_every_block_accounted_for(prefixes, data, num_blocks):
    model = Model(num_blocks)
    pool = model.pool
    for _ in range(data.draw(st.integers(1, 40))):
        if model.jobs and data.draw(st.booleans()):
            model.finish(data.draw(st.integers(0, 100)))
        else:
            p = data.draw(st.sampled_from(prefixes))
            tail = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=9))
            model.start(p + tail)
        pool.check_invariants()
        # Every reference is a job's: the tables add up to the pool's counts.
        assert pool.num_refs == sum(len(b) for b in model.jobs.values())
        assert pool.num_used == len({b for blocks in model.jobs.values() for b in blocks})
        for jid, blocks in model.jobs.items():
            assert all(jid in pool.owners(b) for b in blocks)
        assert pool.num_hits <= pool.num_queries
    for jid in list(model.jobs):
        pool.free(jid, model.jobs.pop(jid))
    pool.check_invariants()
    assert pool.num_refs == 0 and pool.num_used == 0 and pool.num_free == num_blocks  # references back to zero
    pool.evict_all()
    assert pool.num_cached == 0 and pool.num_free == num_blocks


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 3), min_size=1, max_size=6), data=st.data())
def test_eviction_is_least_recently_released_first(sizes, data):
    total = sum(sizes)
    pool = CachingBlockAllocator(total)
    jobs = []
    for k, n in enumerate(sizes):  # distinct chains (token k), all registered
        blocks = pool.allocate(f"j{k}", n)
        for b, h in zip(blocks, block_hashes([k] * (n * BS), BS)):
            pool.register(b, h)
        jobs.append((f"j{k}", blocks))
    order = data.draw(st.permutations(range(len(jobs))))
    expected = []
    for k in order:
        jid, blocks = jobs[k]
        pool.free(jid, blocks)
        expected += list(reversed(blocks))
    assert pool.evictable_order() == expected
    # A hit takes a block out of the order; released again, it goes to the most recent end.
    k = order[0]
    jid, blocks = jobs[k]
    pool.share("again", blocks[:1])
    pool.free("again", blocks[:1])
    expected.remove(blocks[0])
    expected.append(blocks[0])
    assert pool.evictable_order() == expected
    # Allocation evicts in exactly that order.
    m = data.draw(st.integers(1, total))
    got = pool.allocate("new", m)
    assert got == expected[:m]
    assert pool.num_evictions == m
    pool.check_invariants()
