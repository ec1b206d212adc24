"""The experiments: what regenerates docs/experiments.md and docs/figures/ (`make experiments`, which runs
`python -m scripts.experiments`; the runner is __main__.py).

The sections of the document: one module per section or group of sections, each exposing
`section_<name>(ctx: Ctx) -> str` (its markdown, from a "## " heading; figures go to ctx.figdir). What they share
(scales, Ctx, the SLO table, plotting) is in common.py; how a comparison is measured (steady state, loads in
units of FCFS's capacity, seeds, the oracle, the cache of runs) is steady_state.py.

Adding a section: write `section_<name>` in a new module here (or in the module of its group), then add one
line to SECTIONS below, at the place the section goes in the document; its flags, if any, go in
__main__.py's parser (read back as ctx.args.<flag>). Modules are imported only when their section runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

# section name -> the module of this package that defines section_<name>; in the document's order.
SECTIONS: dict[str, str] = {
    "slo": "slo",
    "capacity": "steady",
    "capacity_llama": "capacity_llama",
    "fig1": "fig1",
    "fig5": "fig5",
    "fig8": "fig8",
    "fig12": "latency_curves",
    "fig13": "latency_curves",
    "fig14": "fig14",
    "fig14_past": "fig14_past",
    "fig15": "fig15",
    "past_capacity": "past_capacity",
    "enst_ablation": "sched",
    "alpha": "sched",
    "robustness": "sched",
    "kv_steady": "sched",
    "azure": "azure",
    "chunked": "chunked",
    "live_slo": "live_slo",
    "live": "live",
}
# Sections run before the others, whatever their place in the document: the SLO table (the paper's headline, and its
# OPT-13B ShareGPT searches fill the cache past_capacity reads).
RUN_FIRST = ("slo",)
# Sections run after the others: the slowest (Fig. 15's reactive and recompute runs past the knee), so that with
# --update every other section has landed before it starts.
RUN_LAST = ("fig15",)


def run_order(names: list[str] | tuple[str, ...]) -> list[str]:
    """`names` in the order they run: RUN_FIRST, then the document's order, then RUN_LAST."""
    ends = RUN_FIRST + RUN_LAST
    return ([n for n in RUN_FIRST if n in names] + [n for n in SECTIONS if n in names and n not in ends]
            + [n for n in RUN_LAST if n in names])


def section(name: str) -> Callable:
    """The function that writes section `name` (its module is imported now)."""
    module = importlib.import_module(f"{__name__}.{SECTIONS[name]}")
    return getattr(module, f"section_{name}")
