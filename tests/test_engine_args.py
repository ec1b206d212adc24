"""The engine's flags, made once from EngineConfig's field metadata (engine/args.py): `serve`, `simulate` and
`compare` take every engine setting under the same flag with the same default, help and choices; the flags parse
back to the config; compare passes the ones given on to its servers; simulate's reach its engine."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import server
from engine.args import FIELDS, add_engine_args, config_from_args, engine_args_given, engine_argv, engine_flag
from engine.config import EngineConfig
from fastserve import compare, simulate

REPO = Path(__file__).resolve().parents[1]

PROFILES = REPO / "profiles" / "sim"
# Engine settings a command names otherwise: simulate's --model also takes a shape name and its --profile is
# required; compare sets the scheduling policy per run (--policies).
OWN_FLAGS = {"serve": set(), "simulate": {"model", "profile"}, "compare": {"scheduling_policy"}}
OWN_DEFAULTS = {"compare": compare.ORDER_MATTERS}  # compare's servers run in a setting where order matters
PARSERS = {"serve": server.build_parser, "simulate": simulate.build_parser, "compare": compare.build_parser}
ATTRIBUTES = ("option_strings", "default", "help", "choices", "nargs", "const", "required", "metavar")


def engine_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """{field: its action} for the engine flags of `parser` (other names of the same setting left out)."""
    return {a.dest: a for a in parser._actions if a.dest in FIELDS and a.option_strings[:1] == [engine_flag(a.dest)]}


def differences(parser: argparse.ArgumentParser, skip: set[str] = frozenset(),
                defaults: dict | None = None) -> list[str]:
    """How the engine flags of `parser` differ from add_engine_args' own (fields in `skip` left out; `defaults`:
    the defaults `parser` is meant to set otherwise)."""
    reference = _reference()
    reference.set_defaults(**(defaults or {}))
    want, got = engine_actions(reference), engine_actions(parser)
    out = []
    for name in FIELDS.keys() - skip:
        if name not in got:
            out.append(f"{name}: no {engine_flag(name)}")
            continue
        a, b = want[name], got[name]
        out += [f"{name}: {attr} {getattr(b, attr)!r}, not {getattr(a, attr)!r}" for attr in ATTRIBUTES
                if getattr(a, attr) != getattr(b, attr)]
        if type(a) is not type(b) or getattr(a.type, "__name__", None) != getattr(b.type, "__name__", None):
            out.append(f"{name}: parsed as {type(b).__name__} {b.type}, not {type(a).__name__} {a.type}")
    return sorted(out)


def _reference() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


@pytest.mark.parametrize("command", PARSERS)
def test_every_engine_setting_has_the_same_flag_default_and_help_in(command):
    assert differences(PARSERS[command](), OWN_FLAGS[command], OWN_DEFAULTS.get(command)) == []


def test_the_commands_own_names_for_engine_settings():
    sim = engine_actions(simulate.build_parser())
    assert sim["model"].required and sim["profile"].required and "opt-13b" in sim["model"].help
    cmp = compare.build_parser()
    assert "scheduling_policy" not in engine_actions(cmp) and cmp.parse_args(["--sweep", "1"]).policies


def test_the_check_sees_a_flag_missing_or_described_otherwise():
    parser = argparse.ArgumentParser()
    add_engine_args(parser, exclude=("quantum_ratio",))
    assert differences(parser) == ["quantum_ratio: no --quantum-ratio"]
    engine_actions(parser)["kv_overcommit"].help = "no limit"
    engine_actions(parser)["seed"].default = 1
    assert [d.split(":")[0] for d in differences(parser)] == ["kv_overcommit", "quantum_ratio", "seed"]
    with pytest.raises(ValueError, match="quantum_ration"):
        add_engine_args(argparse.ArgumentParser(), exclude=("quantum_ration",))


def test_every_setting_has_help_and_its_choices_are_valid_values():
    for name, f in FIELDS.items():
        assert len(f.metadata.get("help", "")) > 10, name
        for choice in f.metadata.get("choices", ()):
            assert getattr(EngineConfig(**{name: choice}), name) == choice


def test_the_flags_parse_to_the_config_and_back():
    parser = _reference()
    args = parser.parse_args([])
    assert config_from_args(args) == EngineConfig() and engine_args_given(args) == {}
    values = {"model": "/models/opt", "max_num_seqs": 8, "quantum_ratio": 3.5, "kv_policy": "reactive",
              "enable_prefix_caching": False, "enforce_eager": True, "enable_chunked_prefill": True,
              "starvation_age": None, "kv_overcommit": 2.0, "seed": 0}  # seed 0: a default typed is given too
    argv = engine_argv(values)
    assert argv[argv.index("--starvation-age") + 1] == "none" and "--no-enable-prefix-caching" in argv
    args = parser.parse_args(argv)
    assert engine_args_given(args) == values
    assert config_from_args(args) == EngineConfig(**values)
    assert config_from_args(args, seed=5).seed == 5
    with pytest.raises(ValueError, match="--enable-chunked-prefill sets True or False"):
        engine_argv({"enable_chunked_prefill": None})


def test_compare_passes_the_engine_flags_given_to_every_server_after_those_after_the_dashes():
    args = compare.build_parser().parse_args(["--sweep", "1", "--max-num-seqs", "8", "--no-enable-prefix-caching",
                                              "--kv-overcommit", "none", "--seed", "3"])
    flags = compare.server_flags(args, ["--max-num-seqs", "4", "--api-key", "k"])
    # compare's servers serve the built-in tiny model unless a model is named (server.py alone serves SmolLM2), in
    # its bounded setting (ORDER_MATTERS) but for the settings typed
    setting = ["--num-gpu-blocks-override", "1024", "--num-host-blocks-override", "8192"]
    assert flags == ["--model", "tiny-opt", *setting, "--max-num-seqs", "4", "--api-key", "k", "--max-num-seqs", "8",
                     "--no-enable-prefix-caching", "--kv-overcommit", "none", "--seed", "3"]
    engine_config, server_config = server._configs(server.build_parser().parse_args(flags))
    assert engine_config == EngineConfig(model="tiny-opt", max_num_seqs=8, enable_prefix_caching=False, seed=3,
                                         num_gpu_blocks_override=1024, num_host_blocks_override=8192)
    assert server_config.api_key == "k" and server_config.served_model_names == ("tiny-opt",)
    no_flags = compare.build_parser().parse_args(["--sweep", "1"])
    setting = ["--max-num-seqs", "16", *setting]
    assert compare.server_flags(no_flags, []) == ["--model", "tiny-opt", *setting]
    assert compare.server_flags(no_flags, ["/models/opt-1.3b"]) == [*setting, "/models/opt-1.3b"]  # positional MODEL
    named = compare.build_parser().parse_args(["--sweep", "1", "--model", "/models/opt-1.3b"])
    assert compare.server_flags(named, []) == [*setting, "--model", "/models/opt-1.3b"]


def test_compare_refuses_a_scheduling_policy_flag_before_starting_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        compare.main(["--sweep", "1", "--result-dir", str(tmp_path / "out"), "--scheduling-policy", "fcfs"])
    assert e.value.code == 2 and "--scheduling-policy" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("oracle", ["srpt", "srpt-unbounded"])
def test_the_server_refuses_the_simulators_oracle(capsys, oracle):
    assert server.main(["--scheduling-policy", oracle, "--port", "0"]) == 2
    assert f"{oracle} is the simulator's oracle" in capsys.readouterr().err


def simulated(model: Path, profile: Path, *flags: str):
    args = simulate.build_parser().parse_args(["--model", str(model), "--profile", str(profile), *flags])
    return simulate.make_engine(args, model)


def test_simulate_gives_its_engine_the_settings_it_lacked(flat_sim_model):
    model, _ = flat_sim_model
    profile = PROFILES / "opt-13b-a100-40gb-x1.json"  # a host tier of 256 GiB
    engine = simulated(model, profile, "--quantum-ratio", "3", "--reserved-blocks", "5",
                       "--no-prefix-caching-host-tier", "--swap-space", "1", "--num-device-blocks", "300")
    cfg = engine.config
    assert (cfg.quantum_ratio, cfg.reserved_blocks, cfg.prefix_caching_host_tier) == (3.0, 5, False)
    assert engine.kv.device.num_blocks == 300 and engine.kv.reserved_blocks == 5
    block = engine.executor.kv_block_bytes
    assert engine.kv.num_host_blocks == (1 << 30) // block  # --swap-space given: 1 GiB, not the profile's
    assert simulated(model, profile).kv.num_host_blocks == 256 * (1 << 30) // block


def test_simulate_takes_the_pipeline_stages_from_the_profile_unless_given(flat_sim_model):
    model, _ = flat_sim_model
    profile = PROFILES / "opt-175b-a100-40gb-x16.json"  # two stages
    assert simulated(model, profile, "--num-device-blocks", "300").executor.max_in_flight == 2
    one = simulated(model, profile, "--num-device-blocks", "300", "--pipeline-parallel-size", "1")
    assert one.executor.max_in_flight == 1
