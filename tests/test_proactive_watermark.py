"""The proactive planner's watermark is the room the batch's next iteration adds (memory/proactive.py, rule 1):
a block for each job whose next token starts a new block, not one for every job of the batch. One block per job
kept free ~16x the room a decode batch grows into, and at capacity the planner pushed idle jobs out to keep it,
each coming back as an upload (docs/kv-cache.md, "Offload policies", the proactive rule)."""

from __future__ import annotations

from memory.kv_manager import KVManager, Residency
from memory.proactive import batch_growth
from scheduler.job import Job
from tests.test_kv_manager import ManualBackend, grow


def job(i: int, prompt: int) -> Job:
    return Job(f"j{i}", prompt, 64, 0.0)


def test_batch_growth_counts_the_jobs_whose_next_token_starts_a_block():
    """Block size 4. Decoding jobs with contexts 8 and 12 (their blocks full: the token this step samples opens a
    new one) count one each; contexts 5, 6 and 7 (room left in the last block) none; a prefill of 6 tokens (its
    first token goes at position 6, in its second block) none, of 8 one; a chunk of a prefill one."""
    jobs = []
    for i, ctx in enumerate((8, 12, 5, 6, 7)):
        j = job(i, ctx - 1)
        j.num_generated, j.num_computed, j.num_scheduled = 1, ctx - 1, 1  # a decode: the last token to compute
        jobs.append(j)
    assert batch_growth(jobs, 4) == 2
    prefill6, prefill8 = job(10, 6), job(11, 8)
    prefill6.num_scheduled, prefill8.num_scheduled = 6, 8
    assert batch_growth([prefill6], 4) == 0 and batch_growth([prefill8], 4) == 1
    chunk = job(12, 30)
    chunk.num_computed, chunk.num_scheduled = 8, 8  # 8 of 30 computed, 8 more now: another chunk follows
    assert batch_growth([chunk], 4) == 1
    assert batch_growth([], 4) == 0


def _full_device(batch_ctx: int) -> tuple[KVManager, ManualBackend, Job, Job]:
    """8 device blocks of 4 tokens, all held: the batch job d (context batch_ctx, 2 blocks) and the idle jobs a
    (4 blocks) and b (2 blocks)."""
    be = ManualBackend()
    kv = KVManager(8, 4, num_host_blocks=16, policy="proactive", transfers=be)
    d, a, b = job(0, batch_ctx), job(1, 16), job(2, 8)
    for j in (d, a, b):
        grow(kv, j, j.prompt_len)
    assert kv.device.num_free == 0
    d.num_scheduled = 1  # (a decode: its context's blocks are held)
    return kv, be, d, a


def test_no_offload_when_the_batch_needs_no_new_block():
    """The batch job's context (6 tokens) leaves room in its last block: its next iteration adds no block, so
    the watermark is 0 and no idle job goes to the host although not one block is free. Counting a block per
    batch job (the old rule) offloads the idle job a for room nobody uses."""
    kv, be, d, a = _full_device(6)
    kv.plan([d], lambda j, now: {"j1": 9.0, "j2": 1.0}.get(j.job_id, 0.0), now=0.0)
    assert [kv.residency(f"j{i}") for i in range(3)] == [Residency.DEVICE] * 3
    assert kv.stats.num_offloads == 0 and not be.calls


def test_offload_when_the_batch_needs_a_new_block():
    """The batch job's context (8 tokens) fills its 2 blocks: the token it samples now needs a third, so the
    planner offloads the idle job that runs last (a, ENST 9 s) to keep one block free. A watermark that counted
    nothing would leave the batch job short next iteration."""
    kv, be, d, a = _full_device(8)
    kv.plan([d], lambda j, now: {"j1": 9.0, "j2": 1.0}.get(j.job_id, 0.0), now=0.0)
    assert [kv.residency(f"j{i}") for i in range(3)] == [Residency.DEVICE, Residency.OFFLOADING, Residency.DEVICE]
    be.complete_all()
    kv.poll()
    assert kv.device.num_free == 4
    kv.check_invariants()
