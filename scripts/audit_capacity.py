"""Why two of issue 24's goals are not met at capacity: the numbers behind docs/benchmarks.md, "Skip-join at
capacity", part 7. It runs one steady-state point (scripts/steady_state.py's trace and metrics) in the simulator
with the engine's objects observed from outside (their methods wrapped, nothing changed), and prints:

- `misses`: where proactive's uploads come from (the planner, ahead of need, or the scheduler's pick: a swap
  miss), and, for each swap miss, where the job stood at the tick before: still being offloaded (evicted and wanted
  straight back), or on the host at rank r of the planner's ENST order. `--reserve` repeats the run with room kept
  free for the planner's first host job (the batch's fresh starts and host picks may not use it), the remedy the
  issue suggests: its misses and latency beside the default's.
- `work`: FCFS's and skip-join's iterations, decode sequences per iteration and the executor's busy seconds for
  the same trace: whether a served-rate gap is work the policy adds or only the order it finishes jobs in.

    python scripts/audit_capacity.py misses --scale opt-13b --dataset sharegpt --rate 2.970 --reserve
    python scripts/audit_capacity.py work --scale opt-13b --dataset alpaca --rate 133.27 --max-started-jobs 384

--max-started-jobs N (work): a fresh job may start only while fewer than N jobs hold KV (the bound on
processor sharing the analysis tries; not an engine flag).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from steady_state import MIN_REQUESTS, Setup, run_point  # noqa: E402

import engine.executor.simulated as simulated  # noqa: E402
import memory.kv_manager as kv_manager  # noqa: E402
from memory.residency import Residency  # noqa: E402

SHOWN = ("mean_per_token_s", "p95_per_token_s", "p99_per_token_s", "served_rate", "uploads", "swap_misses")


@contextlib.contextmanager
def wrapped(owner, name: str, make) -> Iterator[None]:
    """owner.name = make(original) for the duration (the audit observes; the wrapper calls the original)."""
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def audit_misses(setup: Setup, rate: float, seed: int, reserve: bool) -> dict:
    """Runs the point; returns its metrics plus the sources of uploads and the standing of each swap miss."""
    seen: dict = {"ranks": {}, "top": None, "room": 0}
    counts: collections.Counter = collections.Counter()
    ranks: collections.Counter = collections.Counter()
    in_plan = [False]

    def plan(orig):
        def wrapper(kv, batch, estimated_wait, now):
            in_plan[0] = True
            try:
                orig(kv, batch, estimated_wait, now)
            finally:
                in_plan[0] = False
            host = sorted(kv.host_resident(), key=lambda e: estimated_wait(e.job, now))
            seen["ranks"] = {e.job.job_id: i for i, e in enumerate(host)}
            # --reserve: the first host job's copy plus the watermark the planner keeps (proactive.py).
            seen["top"] = host[0].job.job_id if host else None
            seen["room"] = len(host[0].host) + len(batch) + kv.reserved_blocks if host else 0
        return wrapper

    def start_upload(orig):
        def wrapper(self, kv, *args, **kwargs):
            counts["uploads by the planner" if in_plan[0] else "uploads at the scheduler's pick (swap misses)"] += 1
            if not in_plan[0]:
                rank = seen["ranks"].get(kv.job.job_id)
                counts["  of which off the host at the tick before (offloading)" if rank is None
                       else "  of which on the host at the tick before"] += 1
                if rank is not None:
                    ranks[min(rank, 10)] += 1
            return orig(self, kv, *args, **kwargs)
        return wrapper

    def can_fit(orig):
        def wrapper(self, job, n):
            if reserve and seen["room"]:
                kv = self._jobs.get(job.job_id)
                if kv is None or kv.residency in (Residency.NONE, Residency.HOST):
                    return -(-(job.num_computed + n) // self.block_size) <= self.device.num_free - seen["room"]
            return orig(self, job, n)
        return wrapper

    with (wrapped(kv_manager, "plan_transfers", plan), wrapped(kv_manager.KVManager, "start_upload", start_upload),
          wrapped(kv_manager.KVManager, "can_fit", can_fit)):
        out = run_point(setup, "skip-join-mlfq", rate, seed)
    out["upload_sources"] = dict(counts)
    out["miss_rank_at_tick_before"] = {("10+" if r == 10 else str(r)): n for r, n in sorted(ranks.items())}
    return out


def audit_work(setup: Setup, policy: str, rate: float, seed: int, max_started_jobs: int | None) -> dict:
    """Runs the point; returns its metrics plus the executor's iterations, decodes per iteration and busy time."""
    work: collections.Counter = collections.Counter()

    def submit(orig):
        def wrapper(self, batch):
            decodes = [s.start_pos + 1 for s in batch.seqs if s.start_pos > 0 and len(s.token_ids) == 1]
            prefills = [len(s.token_ids) for s in batch.seqs if s.start_pos == 0]
            work["iterations"] += 1
            work["decodes"] += len(decodes)
            work["prefill_tokens"] += sum(prefills)
            before = self.busy_s
            result = orig(self, batch)
            work["busy_s"] += self.busy_s - before
            return result
        return wrapper

    def may_start(orig):
        def wrapper(self, job, n):
            if max_started_jobs is not None:
                kv = self._jobs.get(job.job_id)
                if not (kv is not None and (kv.device or kv.host)):
                    if sum(1 for e in self._jobs.values() if e.device or e.host) >= max_started_jobs:
                        return False
            return orig(self, job, n)
        return wrapper

    with (wrapped(simulated.SimulatedExecutor, "submit", submit),
          wrapped(kv_manager.KVManager, "may_start", may_start)):
        out = run_point(setup, policy, rate, seed)
    out |= dict(work)
    out["decodes_per_iteration"] = work["decodes"] / max(1, work["iterations"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("misses", "work"))
    ap.add_argument("--scale", default="opt-13b")
    ap.add_argument("--dataset", default="sharegpt", help="sharegpt or alpaca (../shared/datasets' length files)")
    ap.add_argument("--dataset-path", help="another lengths CSV")
    ap.add_argument("--num-prompts", type=int, default=MIN_REQUESTS)
    ap.add_argument("--rate", type=float, required=True, help="req/s (the capacity tables give C per setup)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-device-blocks", type=int, default=None, help="override the profile's device KV blocks")
    ap.add_argument("--reserve", action="store_true", help="misses: also run with room kept for the planner")
    ap.add_argument("--max-started-jobs", type=int, default=None, help="work: also run skip-join with this bound")
    args = ap.parse_args(argv)
    engine = (("num_device_blocks", args.num_device_blocks),) if args.num_device_blocks else ()
    setup = Setup(args.scale, args.dataset, args.num_prompts, engine, args.dataset_path)
    if args.what == "misses":
        for reserve in (False, True) if args.reserve else (False,):
            out = audit_misses(setup, args.rate, args.seed, reserve)
            print("reserve for the planner" if reserve else "default", {k: round(out[k], 4) for k in SHOWN})
            for k, v in out["upload_sources"].items():
                print(f"  {k}: {v}")
            print("  swap misses by the job's rank in ENST order at the tick before:", out["miss_rank_at_tick_before"])
        return 0
    runs = [("fcfs", None), ("skip-join-mlfq", None)]
    if args.max_started_jobs is not None:
        runs.append(("skip-join-mlfq", args.max_started_jobs))
    for policy, bound in runs:
        out = audit_work(setup, policy, args.rate, args.seed, bound)
        label = policy if bound is None else f"{policy}, at most {bound} started"
        print(f"{label}: mean {out['mean_per_token_s']:.4f} s/token, P95 {out['p95_per_token_s']:.4f}, served "
              f"{out['served_rate']:.2f} req/s; {out['iterations']} iterations, {out['decodes_per_iteration']:.1f} "
              f"decodes each, {out['prefill_tokens']} prefill tokens, executor busy "
              f"{out['busy_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
