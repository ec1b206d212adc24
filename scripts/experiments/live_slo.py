"""Live: every policy served for real on this machine (server.py + the load generator via
fastserve/compare.py, in its setting where order matters: a batch of 16), throughput at an SLO scaled to the tiny
model (Fig. 11's live counterpart), and FCFS / skip-join per rate with its interval over seeds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from fastserve.compare import ORDER_MATTERS, format_ratio, ratios
from scripts.experiments.common import MAIN, REPO, SCALES, SLO_S, Ctx, tiny_profile

# Swept rates of the live section (req/s): around the tiny model's knee on this 2-core machine at the scaled SLO,
# in compare's setting (a batch of at most 16). The simulator is no guide here: with the tiny model it reads the
# knee too high (the engine's per-iteration work, the HTTP server and the load generator share the two cores; no
# profile measures them).
LIVE_RATES = {"ShareGPT": "2,4,8", "Alpaca": "16,32,64"}


def section_live_slo(ctx: Ctx) -> str:
    from scheduler.cost_model import ProfiledCostModel

    profile = tiny_profile(ctx)
    tiny, big = ProfiledCostModel.from_json(profile), ProfiledCostModel.from_json(REPO / SCALES[MAIN][1])
    slo = SLO_S * tiny.t_dec(1, 16) / big.t_dec(1, 16)
    max_len, n, seeds = ctx.args.live_max_model_len, ctx.args.live_prompts, ctx.args.live_seeds
    setting = (f"a batch of at most {ORDER_MATTERS['max_num_seqs']} sequences, "
               f"{ORDER_MATTERS['num_gpu_blocks_override']} device KV blocks of 16 tokens and "
               f"{ORDER_MATTERS['num_host_blocks_override']} host blocks")
    lines = ["## Live: throughput at the SLO on this machine, tiny model", "",
             f"Command: `{ctx.cmd('live_slo')}` (runs `python -m fastserve.compare`)", "",
             "Every policy served for real: `server.py` (tiny model, one torch thread) started once per policy and "
             "dataset, `fastserve bench serve --sweep` against it over loopback HTTP (streaming, token-id prompts of "
             f"the dataset's lengths, ignore_eos), {n} requests per rate, {seeds} seeds (the policies in turn seed "
             f"by seed). The setting is `fastserve compare`'s, where order matters: {setting} (with the engine's "
             "default of 256 sequences every request joins the batch and no order can change anything). Scaled "
             "to this machine the way the paper's setup is: the SLO is 0.3 s x t_dec(1, 16) of the tiny model / "
             "t_dec(1, 16) of OPT-13B on an A100 40GB "
             f"= **{slo * 1e3:.0f} ms/token** (the tiny model's decode step measured here: "
             f"{tiny.t_dec(1, 16) * 1e3:.1f} ms); --max-model-len {max_len} (loadgen drops longer requests, as "
             "vLLM's benchmark does), proactive KV policy. Latency: mean per-token latency of the requests that "
             "arrive in the middle 80% of a run, averaged over seeds. Rates (`--live-rates-sharegpt`, "
             "`--live-rates-alpaca`) bracket FCFS's knee on this machine. A policy's throughput at the SLO is the "
             "highest swept rate at which it (and every lower rate) meets it: the resolution is a factor of 2. "
             "Short wall-clock runs on a shared 2-core machine: noisy, and each run is partly a burst.", ""]
    table = ["| dataset | policy | rate 1 | rate 2 | rate 3 | at SLO (mean) | at SLO (P95) |",
             "|---|---|---|---|---|---|---|"]
    verdicts: list[str] = []
    figs: list[str] = []
    for ds in ctx.datasets:
        rates = [float(r) for r in getattr(ctx.args, f"live_rates_{ds.lower()}").split(",")]
        with tempfile.TemporaryDirectory() as tmp:
            fig = ctx.figdir / f"fig11_live_{ds.lower()}.png"
            cmd = [sys.executable, "-m", "fastserve.compare", "--dataset-name", "lengths",
                   "--dataset-path", str(ctx.datasets[ds]), "--num-prompts", str(n),
                   "--sweep", ",".join(f"{r:g}" for r in rates), "--slo-per-token", f"{slo:.6f}",
                   "--seed", str(ctx.args.seed), "--seeds", str(seeds), "--result-dir", tmp, "--plot", str(fig),
                   "--", "--model", str(REPO / "models" / "tiny-opt"), "--profile", str(profile),
                   "--max-model-len", str(max_len)]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            summary_path = Path(tmp) / "summary.json"
            if proc.returncode != 0 or not summary_path.exists():
                return "\n".join(lines + [f"The live sweep on {ds} failed (rc {proc.returncode}):", "", "```",
                                           (proc.stdout + proc.stderr)[-2000:], "```", ""])
            summary = json.loads(summary_path.read_text())["policies"]
        figs.append(f"![fig11 {ds}](figures/{fig.name})")
        where = f"{ds} ({', '.join(f'{r:g}' for r in rates)} req/s; {n} requests)"
        for policy, s in summary.items():
            cells = [f"{m * 1e3:.0f} / {p * 1e3:.0f}" + (f" ({f} failed)" if f else "")
                     for m, p, f in zip(s["mean_per_token_s"], s["p95_per_token_s"], s["failed"])]
            at = [s["throughput_at_slo_mean"], s["throughput_at_slo_p95"]]
            table.append(f"| {where} | {policy} | " + " | ".join(cells) + " | "
                         + " | ".join("below the sweep" if a is None else f"{a:g}{'+' if a == rates[-1] else ''}"
                                      for a in at) + " |")
        pair = {p: summary[p] for p in ("fcfs", "skip-join-mlfq")}
        verdicts += [f"{ds} at {x:g} req/s {format_ratio(r)}" for x, r in zip(rates, ratios(pair)["skip-join-mlfq"])]
    lines += [" ".join(figs), "", "Cells: mean / P95 per-token latency (ms). Throughput at the SLO in req/s (`+`: the "
              "top swept rate met it; the throughput is above).", "", *table, "",
              f"FCFS / skip-join mean per-token latency, paired per seed (mean [95% interval] over {seeds} seeds): "
              + "; ".join(verdicts) + ".", ""]
    return "\n".join(lines)
