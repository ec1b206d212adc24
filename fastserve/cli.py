"""`fastserve`: the project's one command (installed by `pip install .`, or `pip install -e .` as `make install` does).

    fastserve serve [MODEL] [flags]     the OpenAI-compatible server (server.py; MODEL = --model, as `vllm serve`)
    fastserve bench serve [flags]       the load generator, with vLLM `vllm bench serve`'s flags (fastserve/bench/)
    fastserve bench soak [flags]        a soak at 1.5x capacity, then checks KV, /metrics and memory
    fastserve simulate [flags]          the engine, scheduler and KV manager on a virtual clock (fastserve/simulate.py)
    fastserve compare [flags] [-- SERVER FLAGS]
                                        FCFS vs skip-join MLFQ served live on the tiny model, the same load
                                        (fastserve/compare.py with `make compare`'s settings)
    fastserve replay [flags]            a load generator result replayed in the simulator (fastserve/replay.py)
    fastserve profile [flags]           measure a model's job profile on this machine (fastserve/profile.py)
    fastserve make-model [flags]        write a random-weight OPT checkpoint (fastserve/make_model.py)

`fastserve COMMAND --help` lists a command's flags. A bad command or flag is one line on stderr, exit 2.
`python server.py ...` and `python -m fastserve ...` work too, and so does `python -m fastserve.NAME` for each
command's module.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

PROG = "fastserve"
USAGE = f"usage: {PROG} {{serve,bench serve,simulate,compare,replay,profile,make-model}} ...  ({PROG} --help for more)"

# `make compare`'s settings: the tiny model at 1.0x FCFS's capacity C (measured first, one seed a step from 8 req/s),
# 150 requests a run, 3 seeds, a per-token SLO of 45 ms; the servers in compare.py's setting (ORDER_MATTERS: a batch
# of 16). Flags given after these win (argparse keeps the last).
COMPARE_ARGS = ["--policies", "fcfs,skip-join-mlfq", "--num-prompts", "150", "--sweep", "1C", "--seeds", "3",
                "--capacity-start", "8", "--capacity-seeds", "1", "--slo-per-token", "0.045",
                "--result-dir", "results/compare"]
# ShareGPT's lengths, when the checkout has the project's shared datasets beside it
COMPARE_DATA = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "sharegpt_lengths.csv"
COMPARE_SYNTHETIC = ["--dataset-name", "synthetic", "--random-input-len", "120", "--random-output-len", "200",
                     "--random-range-ratio", "0.9"]


class CommandError(Exception):
    """A bad command line: `PROG: error: MESSAGE`, exit 2."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(f"{prog}: error: {message}")


def _serve(argv: list[str]) -> int:
    import server

    return server.main(argv, prog=f"{PROG} serve")


def _bench(argv: list[str]) -> int:
    from fastserve.bench import loadgen, soak

    benchmarks = {"serve": loadgen.main, "soak": soak.main}
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {PROG} bench {{serve,soak}} [flags]   (serve: the load generator; soak: a long run at 1.5x "
              f"capacity with disconnects and malformed bodies, then checks KV, /metrics and memory; "
              f"{PROG} bench NAME --help)")
        return 0 if argv else 2
    if argv[0] not in benchmarks:
        raise CommandError(f"{PROG} bench", f"unknown benchmark {argv[0]!r} (choose from {', '.join(benchmarks)})")
    return benchmarks[argv[0]](argv[1:])


def _run(module: ModuleType, prog: str, argv: list[str]) -> int:
    """The command module's main(argv) in this process, its parser named `prog` and its errors one line."""
    build_parser = module.build_parser
    module.build_parser = _renamed(build_parser, prog)
    try:
        return module.main(argv)
    finally:
        module.build_parser = build_parser


def _renamed(build_parser: Callable[[], argparse.ArgumentParser], prog: str):
    def build() -> argparse.ArgumentParser:
        parser = build_parser()
        parser.prog = prog
        parser.error = lambda message: parser.exit(2, f"{prog}: error: {message}\n")  # one line, no usage dump
        return parser

    return build


def compare_argv(argv: Sequence[str], data: Path = COMPARE_DATA) -> list[str]:
    """fastserve/compare.py's command line for `fastserve compare ARGV`: `make compare`'s settings, then the
    caller's flags (which win), then the caller's `--` and server flags if any."""
    argv = list(argv)
    ours, server = (argv[:argv.index("--")], argv[argv.index("--"):]) if "--" in argv else (argv, [])
    workload = (["--dataset-name", "lengths", "--dataset-path", str(data)] if data.is_file()
                else COMPARE_SYNTHETIC)
    return [*COMPARE_ARGS, *workload, *ours, *server]


def _compare(argv: list[str]) -> int:
    from fastserve import compare

    ours = argv[:argv.index("--")] if "--" in argv else argv
    if "-h" in ours or "--help" in ours:
        print(f"{PROG} compare [flags] [-- SERVER FLAGS]: FCFS and skip-join MLFQ, each served live on the tiny "
              f"model under the same load (ShareGPT's lengths from {COMPARE_DATA} when it exists, else "
              f"synthetic lengths) at FCFS's capacity, measured first, in a setting where order matters (a batch "
              f"of at most {compare.ORDER_MATTERS['max_num_seqs']} sequences; with the engine's default of 256 "
              f"every request joins the batch and no order can matter); prints their per-token latency side by "
              f"side, FCFS's mean over skip-join's with a 95% interval over seeds, and the setting.\nIts "
              f"settings: {' '.join(COMPARE_ARGS)}; flags given here win. Its flags:\n")
        return _run(compare, f"{PROG} compare", ["--help"])
    return _run(compare, f"{PROG} compare", compare_argv(argv))


# Each command's module is imported when it runs (the server's and the simulator's imports take seconds).
def _simulate(argv: list[str]) -> int:
    from fastserve import simulate

    return _run(simulate, f"{PROG} simulate", argv)


def _replay(argv: list[str]) -> int:
    from fastserve import replay

    return _run(replay, f"{PROG} replay", argv)


def _profile(argv: list[str]) -> int:
    from fastserve import profile

    return _run(profile, f"{PROG} profile", argv)


def _make_model(argv: list[str]) -> int:
    from fastserve import make_model

    return _run(make_model, f"{PROG} make-model", argv)


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "serve": (_serve, "the OpenAI-compatible server: fastserve serve [MODEL] [--port 8000] ..."),
    "bench": (_bench, "benchmarks against a server: fastserve bench serve (the load generator), fastserve bench soak"),
    "simulate": (_simulate, "a serving run on a virtual clock with profiled costs"),
    "compare": (_compare, "FCFS vs skip-join MLFQ served live on the tiny model (what `make compare` runs)"),
    "replay": (_replay, "a load generator result replayed in the simulator under each policy"),
    "profile": (_profile, "measure a model's job profile (iteration costs) on this machine"),
    "make-model": (_make_model, "write a random-weight OPT checkpoint (the built-in tiny model, ...)"),
}


def _help() -> str:
    lines = [USAGE.split("  (")[0], "", "FastServe: an OpenAI-compatible server for OPT and Llama-family models with "
             "skip-join MLFQ scheduling, and the tools to load, measure and simulate it.", ""]
    lines += [f"  {name:<10} {what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", f"{PROG} COMMAND --help: that command's flags."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv:
            raise CommandError(PROG, f"a command is required (choose from {', '.join(COMMANDS)}; {PROG} --help)")
        if argv[0] in ("-h", "--help"):
            print(_help())
            return 0
        if argv[0] == "--version":
            from importlib import metadata

            try:
                print(f"{PROG} {metadata.version('fastserve')}")
            except metadata.PackageNotFoundError:
                print(f"{PROG} (not installed)")
            return 0
        command = COMMANDS.get(argv[0])
        if command is None:
            raise CommandError(PROG, f"unknown command {argv[0]!r} (choose from {', '.join(COMMANDS)})")
        return command[0](argv[1:])
    except CommandError as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
