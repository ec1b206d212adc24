"""Prefix caching on two tiers: cached blocks the device evicts live on in the host tier, hits there
are uploaded before the prefill reads them, a waiting request's host prefix is uploaded ahead of need by ENST,
offloads and uploads copy only what the other tier lacks, and every block is accounted for (KVManager.audit).

The KVManager tests drive the bookkeeping with copies whose completion the test controls; the engine tests run
the small random-weight model and compare every output with the run that has caching off."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sampling_params import SamplingParams
from memory.kv_manager import CACHE_OWNER, KVManager, Residency
from memory.prefix_cache import block_hashes
from memory.transfers import Direction
from scheduler.job import Job
from tests.conftest import SMALL_PRE_LN, settle_kv_copies
from tests.test_kv_manager import ManualBackend
from tests.test_prefix_caching import BS, engine_of, same_outputs, tokens


class Source:
    """PrefixSource over token lists the test sets per job."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def token_ids(self, job, start, end):
        return self.tokens[job.job_id][start:end]

    def cache_salt(self, job):
        return None

    def may_reuse(self, job):
        return True


def make_kv(device=8, host=16, policy="reactive"):
    be, src = ManualBackend(), Source()
    kv = KVManager(device, BS, num_host_blocks=host, policy=policy, transfers=be)
    kv.enable_prefix_caching(src)
    assert kv.host_caching
    return kv, be, src


def new_job(src: Source, name: str, toks: list[int]) -> Job:
    j = Job(name, len(toks), 4, 0.0)
    src.tokens[name] = list(toks)
    return j


def prefill(kv: KVManager, j: Job) -> None:
    n = j.context_len - j.num_computed
    assert kv.can_fit(j, n)
    kv.allocate(j, n)  # (a hit sets num_computed to the cached length)
    assert j.ready
    j.num_computed = j.context_len
    kv.check_invariants()


def land(kv: KVManager, be: ManualBackend) -> None:
    be.complete_all()
    kv.poll()
    kv.check_invariants()


def prefix_evicted_to_host(kv: KVManager, be: ManualBackend, src: Source, prefix: list[int]) -> None:
    """A job over `prefix` (four blocks of an 8-block device) runs and ends, then a 28-token job evicts most of its
    cached blocks from the device: the prefix is cached on the host, not (all) on the device."""
    a = new_job(src, "a", prefix + [5])
    prefill(kv, a)
    kv.free("a")
    land(kv, be)
    z = new_job(src, "z", tokens(28, 2))
    prefill(kv, z)
    kv.free("z")
    land(kv, be)


def test_released_blocks_go_to_the_host_and_an_evicted_prefix_comes_back_from_it():
    kv, be, src = make_kv(device=6, host=16)
    prefix = tokens(16, 1)  # four full blocks
    a = new_job(src, "a", prefix + [7])
    prefill(kv, a)
    kv.free("a")  # its four named blocks are released: the cache copies them to the host
    assert [d for d, _ in be.calls] == [Direction.OFFLOAD] and len(be.calls[0][1]) == 4
    land(kv, be)
    assert kv.host.num_cached == 4 and kv.host.num_used == 0  # cached on the host, held by no one
    b = new_job(src, "b", tokens(24, 2))  # needs the whole device: evicts a's cached blocks
    prefill(kv, b)
    assert kv.stats.cache_evicted_to_host == 4 and kv.device.lookup([kv.host.hash_of(0)]) == []
    kv.free("b")
    land(kv, be)
    c = new_job(src, "c", prefix + tokens(5, 3))
    calls = len(be.calls)
    kv.allocate(c, c.context_len)  # the host holds its first four blocks: parked there, uploaded
    assert kv.residency("c") is Residency.UPLOADING and not c.ready and c.num_computed == 16
    upload = be.calls[calls]
    assert upload[0] is Direction.UPLOAD and len(upload[1]) == 4
    assert kv.stats.host_hit_tokens == 16 and kv.cached_tokens("c") == 16 and kv.stats.num_prefix_uploads == 1
    assert kv.device.num_hits == 16
    kv.check_invariants()
    land(kv, be)
    assert kv.residency("c") is Residency.DEVICE and c.ready
    kv.allocate(c, c.context_len - c.num_computed)  # the uncached rest
    c.num_computed = c.context_len
    kv.free("c")
    land(kv, be)
    counts = kv.audit()
    assert counts["device"]["jobs"] == counts["host"]["jobs"] == 0
    assert counts["device"]["refs"] == counts["host"]["refs"] == 0
    kv.clear_prefix_cache()
    counts = kv.audit()
    assert counts["device"]["free"] == 6 and counts["host"]["free"] == 16


def test_a_copy_whose_device_block_is_handed_out_before_it_lands_is_void():
    kv, be, src = make_kv(device=4, host=8)
    a = new_job(src, "a", tokens(9, 1))  # two full blocks + one
    prefill(kv, a)
    kv.free("a")  # copies of its two named blocks start
    assert kv.pending_transfers() == 1 and kv.host.num_used == 2
    b = new_job(src, "b", tokens(16, 2))
    prefill(kv, b)  # takes every device block, a's two among them, while their copy runs
    assert kv.stats.cache_evicted_dropped == 2
    land(kv, be)
    assert kv.host.num_cached == 0 and kv.host.num_free == 8  # the stale copies were never named
    kv.audit()


def test_an_offload_and_an_upload_copy_only_what_the_other_tier_lacks():
    kv, be, src = make_kv(device=8, host=16)
    prefix = tokens(16, 1)
    a = new_job(src, "a", prefix + [3])
    prefill(kv, a)
    kv.free("a")
    land(kv, be)  # a's four blocks: cached on the device and on the host
    c = new_job(src, "c", prefix + tokens(10, 2))  # hits a's blocks on the device
    prefill(kv, c)
    assert kv.cached_tokens("c") == 16
    calls = len(be.calls)
    kv.evict(c)  # preempted: it alone holds its blocks, so it is offloaded...
    offload = [pairs for d, pairs in be.calls[calls:] if d is Direction.OFFLOAD]
    assert offload == [list(zip(kv._jobs["c"].device[4:], kv._jobs["c"].host[4:]))]  # ...but its prefix is not copied
    assert kv.stats.blocks_not_copied == 4
    land(kv, be)
    assert kv.residency("c") is Residency.HOST and kv.host.ref_count(kv._jobs["c"].host[0]) == 1
    calls = len(be.calls)
    kv.allocate(c, 1)  # back: the device still caches all six of its full blocks (named when it was evicted)
    uploads = [pairs for d, pairs in be.calls[calls:] if d is Direction.UPLOAD]
    assert uploads == [] or all(len(p) <= 1 for p in uploads)  # at most its partial last block comes up
    assert kv.stats.blocks_not_copied >= 4 + 6
    land(kv, be)
    kv.free("c")
    land(kv, be)
    kv.audit()
    assert kv.device.num_refs == kv.host.num_refs == 0


def test_the_host_frees_cached_blocks_only_when_full_least_recent_first():
    kv, be, src = make_kv(device=4, host=4)
    chains = [tokens(8, s) for s in (1, 2, 3)]
    for i, t in enumerate(chains):
        j = new_job(src, f"j{i}", t + [1])
        prefill(kv, j)
        kv.free(j.job_id)
        land(kv, be)
    # Three two-block chains through a four-block host: the first went when the third needed room.
    assert kv.host.num_cached == 4 and kv.host.num_evictions == 2
    assert kv.host.lookup(block_hashes(chains[0], BS)) == []
    assert [len(kv.host.lookup(block_hashes(c, BS))) for c in chains[1:]] == [2, 2]
    kv.audit()


def test_a_waiting_job_with_its_prefix_on_the_host_is_uploaded_ahead_of_need_by_enst():
    kv, be, src = make_kv(device=10, host=32, policy="proactive")
    p_x, p_y = tokens(16, 1), tokens(12, 2)  # four and three blocks
    for name, p in (("py", p_y), ("px", p_x)):
        j = new_job(src, name, p + [5])
        prefill(kv, j)
        kv.free(name)
        land(kv, be)
    z = new_job(src, "z", tokens(28, 3))  # seven blocks: evicts py's cached blocks and px's last one
    prefill(kv, z)
    assert kv.device.num_free == 3 and kv.stats.cache_evicted_to_host == 4
    land(kv, be)
    x, y = new_job(src, "x", p_x + tokens(2, 4)), new_job(src, "y", p_y + tokens(2, 5))
    assert kv.expected_hit(x) == 16 and kv.expected_hit(y) == 12  # admission sees the host's hits
    enst = {"x": 5.0, "y": 1.0, "z": 0.0}
    kv.plan([], lambda j, now: enst[j.job_id], 0.0)
    assert kv.stats.num_prefix_prefetches == 2
    # y (smallest ENST) came up first; x (four blocks) no longer fits the free room and z is due sooner.
    assert kv.residency("y") is Residency.UPLOADING and kv.residency("x") is Residency.HOST
    assert kv.residency("z") is Residency.DEVICE
    land(kv, be)
    assert kv.residency("y") is Residency.DEVICE and y.ready and y.num_computed == 12
    kv.free("z")
    assert kv.can_fit(y, y.context_len - y.num_computed)
    kv.allocate(y, y.context_len - y.num_computed)  # scheduled: it computes only its uncached rest
    y.num_computed = y.context_len
    assert kv.note_scheduled(y, 1.0) == 0.0 and kv.stats.num_prefix_uploads_on_demand == 0
    kv.free("y")
    land(kv, be)
    assert kv.may_evict_for(x)  # a job not started: it may make room as a new job does
    assert kv.can_fit(x, x.context_len - x.num_computed)
    kv.allocate(x, x.context_len - x.num_computed)  # picked while still on the host: uploaded on demand
    assert not x.ready and kv.stats.num_prefix_uploads_on_demand == 1
    land(kv, be)
    kv.free("x")
    land(kv, be)
    counts = kv.audit()
    assert counts["device"]["refs"] == counts["host"]["refs"] == 0


def test_the_audit_finds_a_block_held_by_no_live_job():
    kv, be, src = make_kv()
    kv.audit()
    kv.device.allocate("gone", 1)  # a reference an ended job never gave back
    with pytest.raises(AssertionError):
        kv.audit()
    kv2, _, _ = make_kv()
    kv2.host.allocate(CACHE_OWNER, 1)  # a cache copy the manager does not know of
    with pytest.raises(AssertionError):
        kv2.audit()


def test_the_host_tier_switch_leaves_the_device_alone_caching(small_checkpoint):
    engine = engine_of(small_checkpoint(SMALL_PRE_LN), enable_prefix_caching=True, prefix_caching_host_tier=False,
                       num_host_blocks_override=32)
    assert engine.kv.prefix_caching and not engine.kv.host_caching
    import server
    parser = server.build_parser()
    for argv, want in (([], True), (["--no-prefix-caching-host-tier"], False)):
        engine_config, _ = server._configs(parser.parse_args(argv))
        assert engine_config.prefix_caching_host_tier is want


# -- through the engine: outputs equal those without caching -----------------------------------------------------

PARAMS = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)


def run(engine, arrivals: dict[int, list], params=PARAMS, audit=True) -> dict:
    """Add requests at given steps (a callable prompt gets the outputs so far: a follow-up turn); run to the end,
    auditing every block after each step."""
    done, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished():
        for rid, prompt in arrivals.get(step, []):
            if callable(prompt):
                try:
                    prompt = prompt(done)
                except KeyError:  # its first turn has not finished yet: it comes a step later
                    arrivals.setdefault(step + 1, []).append((rid, prompt))
                    continue
            engine.add_request(rid, prompt, params)
        outs = engine.step()
        for out in outs:
            if out.finished:
                done[out.request_id] = out
        if audit:
            engine.kv.audit()
        if not outs and engine.kv.pending_transfers():
            time.sleep(0.002)
        step += 1
        assert step < 5000
    settle_kv_copies(engine)
    return done


def history_arrivals():
    """A long first turn; unrelated requests that push its blocks off a small device; its follow-up turns."""
    first = tokens(30, 11)

    def follow(rid, seed):
        return lambda done: done[rid].prompt_token_ids + done[rid].outputs[0].token_ids + tokens(3, seed)

    return {
        0: [("t1", first)],
        12: [(f"u{i}", tokens(14, 20 + i)) for i in range(4)],
        40: [("t2", follow("t1", 30))],
        60: [(f"v{i}", tokens(14, 40 + i)) for i in range(4)],
        90: [("t3", follow("t2", 31)), ("w", tokens(9, 50))],
    }


@pytest.mark.parametrize("kv_policy", ["reactive", "proactive"])
def test_a_history_evicted_to_the_host_comes_back_with_the_uncached_outputs(small_checkpoint, kv_policy):
    model_dir = small_checkpoint(SMALL_PRE_LN)
    small = dict(num_gpu_blocks_override=16, num_host_blocks_override=64, kv_policy=kv_policy, max_num_seqs=4)
    want = run(engine_of(model_dir, **small), history_arrivals(), audit=False)
    engine = engine_of(model_dir, enable_prefix_caching=True, **small)
    got = run(engine, history_arrivals())
    same_outputs(got, want)
    st_ = engine.kv.stats
    assert st_.cache_evicted_to_host > 0 and st_.host_hit_tokens > 0 and st_.num_prefix_uploads > 0
    assert got["t2"].num_cached_tokens >= 28 and got["t3"].num_cached_tokens > got["t2"].num_cached_tokens
    off = engine_of(model_dir, enable_prefix_caching=True, prefix_caching_host_tier=False, **small)
    got_off = run(off, history_arrivals())
    same_outputs(got_off, want)
    assert off.kv.stats.host_hit_tokens == 0
    # Device alone: the history was evicted, so the follow-up found less of it than with the host tier.
    assert got_off["t2"].num_cached_tokens < got["t2"].num_cached_tokens
    counts = engine.kv.audit()
    assert counts["device"]["refs"] == counts["host"]["refs"] == 0 and counts["host"]["copies"] == 0
    engine.kv.clear_prefix_cache()
    counts = engine.kv.audit()
    assert counts["device"]["free"] == 16 and counts["host"]["free"] == 64


SHARED = [tokens(n, 100 + i) for i, n in enumerate((13, 21, 26))]


@st.composite
def workloads(draw):
    """Requests over a few shared prefixes (cut at random lengths) with random tails, arriving at random steps,
    some of them follow-up turns of earlier ones."""
    arrivals: dict[int, list] = {}
    names = []
    for i in range(draw(st.integers(5, 10))):
        step = draw(st.integers(0, 40))
        if names and draw(st.booleans()):
            prev = draw(st.sampled_from(names))  # a first turn
            tail = draw(st.lists(st.integers(3, 511), min_size=1, max_size=4))

            def prompt(done, prev=prev, tail=tail):
                return done[prev].prompt_token_ids + done[prev].outputs[0].token_ids + tail
            step = 45 + step  # often after its first turn has finished (run() defers it if not)
            arrivals.setdefault(step, []).append((f"r{i}", prompt))
            continue
        base = draw(st.sampled_from(SHARED))
        cut = draw(st.integers(len(base) // 2, len(base)))
        tail = draw(st.lists(st.integers(3, 511), min_size=1, max_size=6))
        arrivals.setdefault(step, []).append((f"r{i}", base[:cut] + tail))
        names.append(f"r{i}")
    return arrivals


@pytest.fixture(scope="module")
def prop_model(small_checkpoint):
    return small_checkpoint(SMALL_PRE_LN)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(arrivals=workloads(), kv_policy=st.sampled_from(["reactive", "proactive"]),
       device=st.integers(12, 15))
def test_random_shared_prefixes_on_a_small_device_give_the_uncached_outputs(prop_model, arrivals, kv_policy,
                                                                           device):
    small = dict(num_gpu_blocks_override=device, num_host_blocks_override=48, kv_policy=kv_policy, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True)
    want = run(engine_of(prop_model, **small), arrivals, params, audit=False)
    engine = engine_of(prop_model, enable_prefix_caching=True, **small)
    got = run(engine, arrivals, params)
    same_outputs(got, want)
    counts = engine.kv.audit()
    assert counts["device"]["refs"] == counts["host"]["refs"] == 0


def test_the_property_workloads_evict_to_the_host_and_reuse_from_it(prop_model):
    """The property test's space is not idle: a fixed draw of it has blocks evicted to the host and hits there."""
    arrivals = {0: [("a", SHARED[2] + [5, 6])], 5: [("b", SHARED[1] + [7])], 9: [("c", tokens(30, 7))],
                14: [("d", tokens(30, 8))], 200: [("e", SHARED[2][:25] + [9, 9])]}
    small = dict(num_gpu_blocks_override=12, num_host_blocks_override=48, kv_policy="proactive", max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True)
    want = run(engine_of(prop_model, **small), arrivals, params, audit=False)
    engine = engine_of(prop_model, enable_prefix_caching=True, **small)
    got = run(engine, arrivals, params)
    same_outputs(got, want)
    s = engine.kv.stats
    assert s.cache_evicted_to_host > 0 and s.host_hit_tokens > 0 and got["e"].num_cached_tokens == 24


def test_a_prefetched_job_gives_its_room_back_when_nothing_can_run():
    """A waiting job whose prefix came up ahead of need holds device blocks the scheduler cannot evict (it evicts
    started jobs only); when a tick runs nothing, they go back to the cache (named) and the job waits with no KV,
    so the jobs ahead of it get the room (the soak's livelock, before this rule)."""
    kv, be, src = make_kv(device=8, host=32, policy="proactive")
    p = tokens(16, 1)
    prefix_evicted_to_host(kv, be, src, p)
    w = new_job(src, "w", p + tokens(3, 3))
    assert kv.expected_hit(w) == 16
    kv.plan([new_job(src, "x", [1])], lambda j, now: 1.0, 0.0)  # a tick that ran something: w comes up
    land(kv, be)
    assert kv.residency("w") is Residency.DEVICE and w.num_computed == 16 and kv.stats.num_prefix_prefetches == 1
    kv.plan([], lambda j, now: 1.0, 0.0)  # a tick that ran nothing
    assert kv.residency("w") is Residency.NONE and w.num_computed == 0 and kv.stats.num_prefix_releases == 1
    assert kv.device.num_refs == 0 and kv.device.num_free == 8
    assert kv.expected_hit(w) == 16  # still cached
    kv.allocate(w, w.context_len)  # its first allocation finds the prefix again, on the device
    assert w.ready and w.num_computed == 16 and kv.cached_tokens("w") == 16
    kv.free("w")
    land(kv, be)
    kv.audit()


def test_a_chunk_over_an_uploaded_prefix_given_back_unstarted_leaves_admission_counting_nothing():
    """Chunked prefill and a prefix on the host (proactive): a new job's first chunk is allocated over a prefix the
    host holds (parked, uploaded), then nothing can run, so it gives the uploaded blocks back (_release_unstarted).
    It holds no KV then, so admission must not count the rest of its prompt as a started job's (before: it stayed
    in the partly-prefilled set, check_invariants failed and started_blocks counted its context for nothing)."""
    kv, be, src = make_kv(device=8, host=16, policy="proactive")
    prefix = tokens(16, 1)
    prefix_evicted_to_host(kv, be, src, prefix)
    before = kv.started_blocks()
    c = new_job(src, "c", prefix + tokens(5, 3))
    kv.allocate(c, 2)  # a chunk of 2 after the 16 the host holds: parked there, uploaded
    assert kv.residency("c") is Residency.UPLOADING and c.num_computed == 16
    land(kv, be)
    kv.plan([], lambda j, now: 0.0, now=0.0)  # nothing ran: the unstarted job gives its blocks back
    assert kv.residency("c") is Residency.NONE and c.num_computed == 0
    kv.check_invariants()
    assert kv.started_blocks() == before


def test_allocate_says_in_place_only_when_the_kv_admission_counts_did_not_shrink():
    """KVManager.allocate's Allocation says in_place, letting the scheduler keep an admission refusal past it, only
    for a job on the device with no copy in flight (its blocks grow; started_blocks cannot shrink). An upload can
    shrink it (blocks that another job holds on the device are shared, not taken, while the copy counts the job's
    blocks once): there it says upload, not in_place. Fails if the upload's allocate said in_place, or the resident
    one did not, or either misreports the blocks it put in the table."""
    kv, be, src = make_kv(device=8, host=16)
    p = tokens(2 * BS, 1)
    j = new_job(src, "j", p + tokens(3, 2))
    prefill(kv, j)
    kv.evict(j)  # offloaded (it shares nothing yet); its named device blocks stay cached once the copy lands
    land(kv, be)
    k = new_job(src, "k", p + tokens(3, 3))
    prefill(kv, k)  # hits j's prefix on the device: k holds it now
    assert kv.cached_tokens("k") == 2 * BS and kv.residency("j") is Residency.HOST
    before = kv.started_blocks()
    assert kv.can_fit(j, 1)
    got = kv.allocate(j, 1)  # j's upload shares the two blocks k holds
    assert got is not None and got.upload and not got.in_place and list(got.new_blocks) == kv.block_table("j")
    assert kv.started_blocks() < before and not j.ready
    land(kv, be)
    for job in (j, k):  # resident, no copy in flight: the token after a full last block takes a new block
        job.num_generated += BS - 3
        job.num_computed = job.context_len
        before = kv.started_blocks()
        table = list(kv.block_table(job.job_id))
        assert kv.can_fit(job, 1)
        got = kv.allocate(job, 1)
        assert got is not None and got.in_place and not got.upload
        assert list(got.new_blocks) == kv.block_table(job.job_id)[len(table):] and len(got.new_blocks) == 1
        assert kv.started_blocks() == before + 1
        kv.check_invariants()


@pytest.mark.parametrize("leaves", ["ends", "offloaded"])
def test_a_waiting_job_whose_prefix_reaches_the_host_later_is_parked_once_the_device_evicts_it(leaves):
    """The planner looks only at waiting jobs whose first block the host caches (HostPrefixTier.jobs_to_park's
    candidates): a job that starts waiting while its prefix is on the device alone (the host's copy still in
    flight: the cache's own copy of a finished job's blocks, or an offload) becomes one when the copy lands, stays
    one while the device caches as much as the host, and is parked once the device has evicted the prefix's tail.
    Fails without either step."""
    kv, be, src = make_kv(device=10, host=32, policy="proactive")
    p = tokens(16, 1)  # four blocks
    a = new_job(src, "a", p + [5])
    prefill(kv, a)
    if leaves == "ends":
        kv.free("a")  # its named blocks stay cached on the device; their copy to the host starts
    else:
        kv.evict(a)  # offloaded: its blocks are named on the host when the copy lands, and stay cached on the device
    x = new_job(src, "x", p + tokens(2, 4))
    assert kv.expected_hit(x) == 16 and kv.host.lookup(kv._jobs["x"].hashes) == []
    land(kv, be)  # the host names the prefix now
    if leaves == "offloaded":
        kv.free("a")  # (its host copy stays cached there; the planner has no job of its own to bring back)
        land(kv, be)
    tick = [new_job(src, "q", [1])]  # a tick that ran something
    kv.plan(tick, lambda j, now: 1.0, 0.0)
    assert kv.residency("x") is Residency.NONE and kv.stats.num_prefix_prefetches == 0  # the device has it all
    z = new_job(src, "z", tokens(36, 3))  # nine blocks: the device evicts three of the prefix's four (tail first)
    prefill(kv, z)
    assert len(kv.device.lookup(kv._jobs["x"].hashes)) == 1
    kv.plan(tick, lambda j, now: 1.0, 0.0)
    assert kv.stats.num_prefix_prefetches == 1 and kv.residency("x") is not Residency.NONE
    kv.check_invariants()
