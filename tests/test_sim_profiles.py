"""The Llama-3 simulator profiles (profiles/sim/llama-3-*.json, scripts/tools/make_sim_profiles.py): they load, their
costs are the roofline computed here by hand from the models' config.json and the datasheet numbers (grouped-query
attention: KV read per token uses the KV heads; the gated MLP's three matrices are in the weights read), their KV
capacity in blocks is the hand computation's (8 KV heads hold 4x the tokens 32 would in the same bytes), the tool
writes them byte for byte, and `fastserve simulate` runs on each by shape and profile name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.simulation import simulated_engine
from fastserve import make_model, simulate
from modelmaker.llama_checkpoint import LLAMA_SHAPES, llama_config, write_llama_checkpoint
from scheduler.cost_model import ProfiledCostModel
from scripts.tools import make_sim_profiles

REPO = Path(__file__).resolve().parents[1]
SIM = REPO / "profiles" / "sim"
LENGTHS = REPO / "tests" / "data" / "alpaca_lengths_head20.csv"
GIB = 2**30

# Meta's config.json: (hidden, layers, heads, KV heads, intermediate); head_dim 128, vocabulary 128,256, untied lm_head.
SHAPES = {"llama-3-8b": (4096, 32, 32, 8, 14336), "llama-3-70b": (8192, 80, 64, 8, 28672)}
VOCAB, HEAD_DIM = 128256, 128
# Datasheet numbers: (dense BF16 FLOP/s, HBM bytes/s, memory); 50% of the FLOP/s and 70% of the bandwidth sustained.
H100, H200 = (989e12, 3.35e12, 80 * GIB), (989e12, 4.8e12, 141 * GIB)
PROFILES = {"llama-3-8b-h100-80gb-x1.json": ("llama-3-8b", H100, 1), "llama-3-8b-h200-141gb-x1.json":
            ("llama-3-8b", H200, 1), "llama-3-70b-h100-80gb-x8.json": ("llama-3-70b", H100, 8)}


def params(shape: str) -> int:
    """Parameters by hand: per layer q, k, v (KV heads), o, the gated MLP's gate, up and down, two norms; the
    embedding and the untied lm head; the final norm."""
    e, layers, heads, kv_heads, f = SHAPES[shape]
    q, kv = heads * HEAD_DIM, kv_heads * HEAD_DIM
    return layers * (e * (q + 2 * kv) + q * e + 3 * e * f + 2 * e) + 2 * VOCAB * e + e


def kv_bytes_per_token(shape: str, kv_heads: int | None = None) -> int:
    _, layers, _, heads, _ = SHAPES[shape]
    return 2 * layers * (kv_heads or heads) * HEAD_DIM * 2  # K and V, bfloat16


@pytest.fixture
def models_here(tmp_path, monkeypatch) -> Path:
    """Shape names resolve under tmp_path/models instead of the repository's models/."""
    monkeypatch.setattr(make_model, "MODELS_DIR", tmp_path / "models")
    return tmp_path / "models"


def test_parameter_counts_are_the_published_ones():
    assert params("llama-3-8b") == 8_030_261_248 and params("llama-3-70b") == 70_553_706_496
    assert kv_bytes_per_token("llama-3-8b") == 128 * 1024 and kv_bytes_per_token("llama-3-70b") == 320 * 1024


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_decode_costs_are_the_hand_roofline(name):
    """Batch 1 is memory-bound: per-layer overhead + (weights less the looked-up input embedding + the context's KV)
    / sustained bandwidth, plus on 8 GPUs two ring all-reduces a layer over NVLink (450 GB/s, 70%, 10 us each)."""
    shape, (_, hbm, _), tp = PROFILES[name]
    cost = ProfiledCostModel.from_json(SIM / name)
    assert cost.key["model"] == shape and cost.key["tensor_parallel_size"] == tp and cost.key["dtype"] == "bfloat16"
    e, layers = SHAPES[shape][:2]
    weights = (params(shape) - VOCAB * e) * 2
    bandwidth = hbm * 0.7 * tp
    allreduce = 0.0 if tp == 1 else 2 * layers * (10e-6 + 2 * 7 / 8 * e * 2 / (450e9 * 0.7))
    for c in cost.decode_context_lens:
        want = layers * 2e-5 + (weights + c * kv_bytes_per_token(shape)) / bandwidth + allreduce
        assert cost.t_dec(1, c) == pytest.approx(want, rel=1e-12), c
    # What a longer context adds is its KV at 8 KV heads a layer (a KV head per query head would read 4x)
    per_token = (cost.t_dec(1, 2048) - cost.t_dec(1, 16)) * bandwidth / 2032
    assert per_token == pytest.approx(kv_bytes_per_token(shape), rel=1e-9)
    assert cost.t_init(2048) > cost.t_init(512) > cost.t_dec(1, 16)  # prefill is compute-bound past a few hundred


@pytest.mark.parametrize("name, blocks", [("llama-3-8b-h100-80gb-x1.json", 29_205),
                                          ("llama-3-8b-h200-141gb-x1.json", 57_314),
                                          ("llama-3-70b-h100-80gb-x8.json", 91_050)])
def test_kv_capacity_in_blocks_is_the_hand_computation(models_here, name, blocks):
    """90% of the GPUs' memory less the BF16 weights, in 16-token blocks of the KV heads' bytes: what the simulated
    engine sizes its device tier to."""
    shape, (_, _, memory), tp = PROFILES[name]
    kv_bytes = 0.9 * memory * tp - 2 * params(shape)
    assert int(kv_bytes // (16 * kv_bytes_per_token(shape))) == blocks
    engine = simulated_engine(make_model.config_only_model(shape), SIM / name)
    assert engine.kv.device.num_blocks == blocks
    assert json.loads((SIM / name).read_text())["capacity"]["device_kv_bytes"] == pytest.approx(kv_bytes, rel=1e-12)


def test_eight_kv_heads_hold_four_times_the_tokens_of_thirty_two(models_here, tmp_path):
    """The same profile (the same KV bytes), Llama-3-8B's config with 32 KV heads instead of 8: a quarter of the
    blocks."""
    gqa = make_model.config_only_model("llama-3-8b")
    mha = write_llama_checkpoint(tmp_path / "mha", llama_config(**(LLAMA_SHAPES["llama-3-8b"] | {
        "num_key_value_heads": 32})), weight_format="none")
    for f in gqa.iterdir():
        if f.name != "config.json":
            shutil.copyfile(f, mha / f.name)
    profile = SIM / "llama-3-8b-h100-80gb-x1.json"
    n_gqa = simulated_engine(gqa, profile).kv.device.num_blocks
    n_mha = simulated_engine(mha, profile).kv.device.num_blocks
    assert n_mha == 29_205 // 4 and n_gqa // 4 == n_mha


def test_the_tool_writes_the_committed_llama_profiles_byte_for_byte(tmp_path, capsys):
    assert make_sim_profiles.main(["--out", str(tmp_path)]) == 0
    assert "KV 57.0 GiB" in capsys.readouterr().out
    for name in PROFILES:
        assert (tmp_path / name).read_bytes() == (SIM / name).read_bytes(), name
        source = json.loads((tmp_path / name).read_text())["source"]
        assert source[0].startswith("Llama-3 setups:") and any("989 TFLOP/s" in line for line in source)


def test_simulate_runs_on_each_profile_by_shape_and_profile_name(models_here, tmp_path):
    """One command each: --model a Llama-3 shape, --profile a profiles/sim/ name (without .json) or a path; the same
    trace is faster on the H200's bandwidth than on the H100's."""
    summaries = {}
    for name, (shape, _, _) in PROFILES.items():
        out = tmp_path / f"{name}.summary"
        profile = name.removesuffix(".json") if "h100-80gb-x1" in name else str(SIM / name)
        assert simulate.main(["--model", shape, "--profile", profile, "--dataset-name", "lengths", "--dataset-path",
                              str(LENGTHS), "--num-prompts", "20", "--request-rate", "5", "--json", str(out)]) == 0
        summaries[name] = s = json.loads(out.read_text())
        floor = ProfiledCostModel.from_json(SIM / name).t_dec(1, 16)
        assert s["requests"] == 20 and floor * 0.99 <= s["mean_per_token_s"] < 0.1, (name, s)
    h100, h200 = (summaries[f"llama-3-8b-{gpu}-x1.json"]["mean_per_token_s"] for gpu in ("h100-80gb", "h200-141gb"))
    assert h200 < h100
    assert (models_here / "llama-3-70b-config" / "config.json").is_file()
    cfg = json.loads((models_here / "llama-3-8b-config" / "config.json").read_text())
    assert (cfg["num_key_value_heads"], cfg["rope_theta"], cfg["vocab_size"]) == (8, 500000.0, VOCAB)


def test_help_says_how_to_pick_a_profile_and_a_bad_name_is_one_line(models_here, capsys):
    help_text = " ".join(simulate.build_parser().format_help().split())
    assert "llama-3-8b-h100-80gb-x1.json" in help_text and "llama-3-70b-h100-80gb-x8.json" in help_text
    assert "or the name of one in profiles/sim/" in help_text and "llama-3-70b" in help_text
    assert simulate.main(["--model", "llama-3-8b", "--profile", "llama-3-8b-h100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastserve simulate: error: --profile llama-3-8b-h100: no such file") and err.count("\n") == 1
