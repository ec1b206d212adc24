"""`fastserve replay`: a load generator run replayed in the simulator: the same requests (arrival times, prompt
and output lengths, read from a `fastserve bench serve --save-result` JSON) under each scheduling policy, the
oracle SRPT included, on a virtual clock with a job profile's costs. It answers "how much could any scheduler
have gained on that trace" and "how close is the live run to the profile".

    fastserve replay --result results/live/fcfs.json --profile PROFILE.json \\
        --max-num-seqs 8 --num-device-blocks 987 --cost-scale 1,1.3

--cost-scale multiplies every profiled cost (prefill and decode), once per value: the live engine's
per-iteration work that no profile measures (HTTP streaming, detokenization, the event loop, a load generator
sharing the cores) makes live iterations slower than the profile's, and near capacity a few percent of
iteration time decides whether a queue builds. The scale at which the simulated FCFS matches the live one is
the live engine's effective cost; --match-live finds it (bisection: the scale at which the simulated run under the
live run's policy has the live run's mean over the middle 80% of arrivals). Prints the live run's mean/P95
per-token latency (e2e / output tokens) and, per scale and policy, the simulated ones, the mean over the requests
arriving in the middle 80% of the trace (as `fastserve compare` counts), the share of the run the executor was busy
(a batch of any size running), and each policy's gain over FCFS on that middle-80% mean.

    fastserve replay --result results/compare/fcfs-seed0.json --profile PROFILE.json \\
        --max-num-seqs 16 --num-device-blocks 1024 --num-host-blocks 8192 --match-live
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from engine.config import DEFAULT_MODEL_DIR
from engine.model.registry import load_model_config
from engine.simulation import p95, run_trace, simulated_engine

POLICIES = ("fcfs", "skip-join-mlfq", "srpt")
WINDOW = (0.1, 0.9)  # the middle 80% of the arrival span, as fastserve compare counts
MATCH_RANGE = (0.25, 8.0)  # --match-live's bisection bounds on the cost scale
MATCH_STEPS = 9  # geometric halvings: the scale to within a factor 32 ** (1 / 512), under 1%


def trace_of(result: dict) -> list[tuple[float, int, int]]:
    """(arrival_s from the first, prompt_len, output_len) of each completed request of a loadgen result."""
    starts, prompts, outputs = result["start_times"], result["input_lens"], result["output_lens"]
    ok = [i for i, n in enumerate(outputs) if n > 0]
    if not ok:
        raise ValueError("the result has no completed request with output tokens")
    t0 = min(starts[i] for i in ok)
    return [(starts[i] - t0, prompts[i], outputs[i]) for i in ok]


def live_latencies(result: dict) -> tuple[float, float]:
    """Mean and P95 per-token latency (e2e / output tokens) of the live run's completed requests."""
    xs = [e / n for e, n in zip(result["e2els"], result["output_lens"]) if n > 0]
    return statistics.fmean(xs), p95(xs)


def window_mean(arrivals: list[float], per_token: list[float]) -> float:
    """Mean of per_token[i] over the i whose arrival lies in the middle 80% of the arrivals' span."""
    first, last = min(arrivals), max(arrivals)
    lo, hi = first + WINDOW[0] * (last - first), first + WINDOW[1] * (last - first)
    return statistics.fmean(x for a, x in zip(arrivals, per_token) if lo <= a <= hi)


def live_window_mean(result: dict) -> float:
    """The live run's mean per-token latency over its completed requests arriving in the middle 80%."""
    done = [(s, e / n) for s, e, n in zip(result["start_times"], result["e2els"], result["output_lens"]) if n > 0]
    return window_mean([s for s, _ in done], [x for _, x in done])


def scaled_profile(profile: dict, scale: float) -> dict:
    """The profile with every prefill and decode cost multiplied by scale."""
    out = json.loads(json.dumps(profile))
    out["prefill"]["seconds"] = [s * scale for s in out["prefill"]["seconds"]]
    out["decode"]["seconds"] = [[s * scale for s in row] for row in out["decode"]["seconds"]]
    return out


def replay(model: Path, profile: dict, trace, policy: str, max_num_seqs: int, device_blocks: int | None,
           host_blocks: int | None, dtype: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        path.write_text(json.dumps(profile))
        engine = simulated_engine(model, path, dtype=dtype, scheduling_policy=policy, max_num_seqs=max_num_seqs,
                                  num_device_blocks=device_blocks, num_host_blocks=host_blocks)
        result = run_trace(engine, trace)
    per_token = {int(o.request_id): o.metrics.e2e_s / max(1, len(o.outputs[0].token_ids)) for o in result.outputs}
    arrivals = [a for a, _, _ in trace]
    return result.summary() | {"window_mean_per_token_s": window_mean(arrivals, [per_token[i]
                                                                                 for i in range(len(trace))])}


def matched_scale(run, target: float) -> float:
    """The cost scale in MATCH_RANGE at which run(scale)["window_mean_per_token_s"] (rising with the scale) is
    target, by geometric bisection; a bound when the target lies outside what the range gives."""
    lo, hi = MATCH_RANGE
    if run(lo)["window_mean_per_token_s"] >= target:
        return lo
    if run(hi)["window_mean_per_token_s"] <= target:
        return hi
    for _ in range(MATCH_STEPS):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if run(mid)["window_mean_per_token_s"] < target else (lo, mid)
    return (lo * hi) ** 0.5


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--result", type=Path, required=True, help="a `fastserve bench serve --save-result` JSON")
    ap.add_argument("--profile", type=Path, required=True, help="job profile JSON (fastserve profile)")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR,
                    help="the served model's directory (default: the built-in tiny model's)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-device-blocks", type=int, default=None)
    ap.add_argument("--num-host-blocks", type=int, default=None)
    ap.add_argument("--cost-scale", default="1", help="comma-separated multipliers of the profile's costs")
    ap.add_argument("--match-live", action="store_true",
                    help="instead of --cost-scale: the scale at which the simulated run under the live run's policy "
                         "(the result's label; fcfs when it names none of --policies) has the live run's mean over "
                         f"the middle 80%% of arrivals (bisection over {MATCH_RANGE[0]:g}-{MATCH_RANGE[1]:g})")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        result = json.loads(args.result.read_text())
        trace = trace_of(result)
        profile = json.loads(args.profile.read_text())
        scales = [float(s) for s in args.cost_scale.split(",")]
        load_model_config(args.model)  # a missing or unknown model: one line here, not a traceback later
    except (OSError, ValueError, KeyError) as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    policies = args.policies.split(",")
    mean, tail = live_latencies(result)
    live_window = live_window_mean(result)
    settings = (args.model, trace, args.max_num_seqs, args.num_device_blocks, args.num_host_blocks, args.dtype)
    print(f"{args.result}: {len(trace)} requests arriving over {max(t[0] for t in trace):.1f} s, live "
          f"{result.get('label') or 'run'}: mean {mean * 1e3:.2f} ms/token, P95 {tail * 1e3:.2f}, mean over the "
          f"middle 80% {live_window * 1e3:.2f}")
    if args.match_live:
        policy = result.get("label") if result.get("label") in policies else "fcfs"
        scales = [matched_scale(lambda x: replay_at(profile, x, policy, settings), live_window)]
        print(f"matched cost scale: {scales[0]:.3f} (simulated {policy} against the live run)")
    print(f"{'scale':>6} {'policy':>16} {'mean ms/token':>14} {'P95':>8} {'mean, mid 80%':>14} "
          f"{'busy share':>11} {'vs fcfs (mid 80%)':>18}")
    for scale in scales:
        base = None
        for policy in policies:
            s = replay_at(profile, scale, policy, settings)
            base = base if base is not None else s["window_mean_per_token_s"]
            print(f"{scale:>6.2f} {policy:>16} {s['mean_per_token_s'] * 1e3:>14.2f} "
                  f"{s['p95_per_token_s'] * 1e3:>8.2f} {s['window_mean_per_token_s'] * 1e3:>14.2f} "
                  f"{s['utilization']:>11.3f} {base / s['window_mean_per_token_s']:>17.2f}x")
    return 0


def replay_at(profile: dict, scale: float, policy: str, settings: tuple) -> dict:
    """replay() with the profile's costs x scale; settings: (model, trace, max_num_seqs, device blocks, host
    blocks, dtype)."""
    model, trace, seqs, device, host, dtype = settings
    return replay(model, scaled_profile(profile, scale), trace, policy, seqs, device, host, dtype)


if __name__ == "__main__":
    raise SystemExit(main())
