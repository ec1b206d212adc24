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
the live engine's effective cost. Prints the live run's mean/P95 per-token latency (e2e / output tokens) and,
per scale and policy, the simulated ones, with the share of the run the executor was busy (a batch of any size running).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from engine.config import DEFAULT_MODEL_DIR
from engine.simulation import p95, run_trace, simulated_engine

POLICIES = ("fcfs", "skip-join-mlfq", "srpt")


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
        return run_trace(engine, trace).summary()


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
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        result = json.loads(args.result.read_text())
        trace = trace_of(result)
        profile = json.loads(args.profile.read_text())
        scales = [float(s) for s in args.cost_scale.split(",")]
    except (OSError, ValueError, KeyError) as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    mean, tail = live_latencies(result)
    print(f"{args.result}: {len(trace)} requests arriving over {max(t[0] for t in trace):.1f} s, live "
          f"{result.get('label') or 'run'}: mean {mean * 1e3:.2f} ms/token, P95 {tail * 1e3:.2f}")
    print(f"{'scale':>6} {'policy':>16} {'mean ms/token':>14} {'P95':>8} {'busy share':>12} {'vs fcfs (mean)':>15}")
    for scale in scales:
        base = None
        for policy in args.policies.split(","):
            s = replay(args.model, scaled_profile(profile, scale), trace, policy, args.max_num_seqs,
                       args.num_device_blocks, args.num_host_blocks, args.dtype)
            base = base if base is not None else s["mean_per_token_s"]
            print(f"{scale:>6.2f} {policy:>16} {s['mean_per_token_s'] * 1e3:>14.2f} {s['p95_per_token_s'] * 1e3:>8.2f} "
                  f"{s['utilization']:>12.3f} {base / s['mean_per_token_s']:>14.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
