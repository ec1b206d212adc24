"""Fig. 5: the first iteration vs a decode iteration, by prompt length (the tiny model measured here, and
OPT-13B's roofline profile).
"""

from __future__ import annotations

from experiment_sections.common import MAIN, REPO, SCALES, Ctx, _ms, _plt, _save, tiny_profile


def section_fig5(ctx: Ctx) -> str:
    from scheduler.cost_model import ProfiledCostModel

    plt = _plt()
    profiles = {"tiny-opt, measured here (CPU, 1 thread)": tiny_profile(ctx),
                "OPT-13B / 1xA100-40GB (roofline estimate)": REPO / SCALES[MAIN][1]}
    lens = [1, 16, 64, 256, 1024]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    lines = ["## Fig. 5: first iteration vs decode iteration, by prompt length", "", f"Command: `{ctx.cmd('fig5')}`",
             "", "![fig5](figures/fig5_first_vs_decode.png)", "",
             "t_init(s): the first iteration of one prompt of s tokens alone; t_dec(1, s): one decode step of a "
             "single job with context s. The tiny model's profile is measured on this machine by "
             "`scripts/profile_model.py --quick` (single-threaded; the machine is shared, so it is noisy); the "
             "OPT-13B one is the roofline estimate in profiles/sim/.", "",
             "| profile | s | t_init(s) | t_dec(1, s) | ratio |", "|---|---|---|---|---|"]
    for ax, (name, path) in zip(axes, profiles.items()):
        cost = ProfiledCostModel.from_json(path)
        ti = [cost.t_init(s) for s in lens]
        td = [cost.t_dec(1, s) for s in lens]
        ax.plot(lens, [1e3 * x for x in ti], marker="o", label="first iteration t_init(s)")
        ax.plot(lens, [1e3 * x for x in td], marker="s", label="decode t_dec(1, s)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt / context length (tokens)")
        ax.set_ylabel("ms")
        ax.set_title(name, fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        for s, a, b in zip(lens, ti, td):
            lines.append(f"| {name} | {s} | {_ms(a)} | {_ms(b)} | {a / b:.1f}x |")
    _save(fig, ctx.figdir / "fig5_first_vs_decode.png")
    c13 = ProfiledCostModel.from_json(REPO / SCALES[MAIN][1])
    lines += ["", f"At OPT-13B scale a 1024-token first iteration costs {c13.t_init(1024) / c13.t_dec(1, 1024):.1f}x a "
              "decode step, and short prompts cost about one decode step: the first iteration grows with the "
              "prompt while a decode step barely does. The paper's measured Fig. 5 shows the same shape on a "
              "real A100; our OPT-13B numbers are a roofline model (50% of peak FLOP/s, 70% of HBM bandwidth), "
              "not measured kernels. This is why skip-join places a job by its first-iteration cost.", ""]
    return "\n".join(lines)
