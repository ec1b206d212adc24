"""Checkpoint loading: every layout loads to the same model; every bad
checkpoint fails with a message that says what is wrong."""

from __future__ import annotations

import fractions
import json
import logging
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine.errors import CheckpointError
from engine.loader import load_model_stage
from engine.model.config import OPTConfig
from engine.parallel import ParallelLayout, TensorParallelGroup
from modelmaker.opt_checkpoint import opt_config, write_opt_checkpoint
from tests.conftest import SMALL_POST_LN, SMALL_PRE_LN


def load(path, layout: ParallelLayout | None = None):
    group = TensorParallelGroup(layout or ParallelLayout())
    return load_model_stage(path, OPTConfig.from_model_dir(path), group, "float32", "cpu")


def state(stage) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in stage.state_dict().items()}


def assert_all_load_the_same(dirs: dict[str, Path], load) -> None:
    """Every checkpoint directory (by a name for messages) loads to the same parameters, bit for bit."""
    loaded = {name: state(load(d)) for name, d in dirs.items()}
    (first, ref), *others = loaded.items()
    for name, sd in others:
        assert sd.keys() == ref.keys(), f"{name} vs {first}"
        for k in sd:
            assert torch.equal(sd[k], ref[k]), f"{name}: {k} differs from {first}'s"


@pytest.mark.parametrize("shape", [SMALL_PRE_LN, SMALL_POST_LN], ids=["pre-ln", "post-ln"])
def test_every_layout_loads_the_same_weights(shape, tmp_path):
    cfg = opt_config(**shape)
    layouts = [("safetensors", "model.decoder."), ("sharded", "model.decoder."), ("bin", "model.decoder."),
               ("safetensors", "decoder.")]
    assert_all_load_the_same({f"{fmt}-{prefix}": write_opt_checkpoint(tmp_path / f"{fmt}-{prefix}", cfg, seed=3,
                                                                       weight_format=fmt, prefix=prefix)
                              for fmt, prefix in layouts}, load)


def test_qkv_is_fused_from_q_k_v(tmp_path):
    d = write_opt_checkpoint(tmp_path / "m", opt_config(**SMALL_PRE_LN), seed=1)
    raw = load_file(str(d / "model.safetensors"))
    stage = load(d)
    qkv = stage.layers[1].self_attn.qkv_proj.weight
    e = SMALL_PRE_LN["hidden_size"]
    for part, name in enumerate(["q_proj", "k_proj", "v_proj"]):
        assert torch.equal(qkv[part * e : (part + 1) * e], raw[f"model.decoder.layers.1.self_attn.{name}.weight"])


def test_tensor_and_pipeline_shards_cover_the_checkpoint(tmp_path):
    """Each (tp, pp) rank loads its slice; the slices put together are the whole tensor."""
    d = write_opt_checkpoint(tmp_path / "m", opt_config(**SMALL_PRE_LN), seed=2)
    raw = load_file(str(d / "model.safetensors"))
    tp = 2
    stages = [load(d, ParallelLayout(tp_size=tp, pp_size=3, tp_rank=r, pp_rank=s)) for s in range(3) for r in range(tp)]
    # 3 layers over 3 stages: layer 1 lives on stage 1, split over its 2 TP ranks.
    s1 = [st for st in stages if st.layer_range == range(1, 2)]
    fc1 = torch.cat([st.layers[0].fc1.weight for st in s1], dim=0)
    fc2 = torch.cat([st.layers[0].fc2.weight for st in s1], dim=1)
    assert torch.equal(fc1, raw["model.decoder.layers.1.fc1.weight"])
    assert torch.equal(fc2, raw["model.decoder.layers.1.fc2.weight"])
    assert not hasattr(s1[0], "embed_positions")  # embeddings live on the first stage only


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        OPTConfig.from_model_dir(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        OPTConfig.from_model_dir(tmp_path)


def test_malformed_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        OPTConfig.from_model_dir(tmp_path)


def test_config_missing_a_field(tmp_path):
    cfg = opt_config(**SMALL_PRE_LN)
    del cfg["ffn_dim"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="ffn_dim"):
        OPTConfig.from_model_dir(tmp_path)


def test_architecture_not_opt(tmp_path):
    cfg = dict(opt_config(**SMALL_PRE_LN), model_type="llama", architectures=["LlamaForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="only OPT models are supported"):
        OPTConfig.from_model_dir(tmp_path)


def test_no_weight_files(tmp_path):
    write_opt_checkpoint(tmp_path, opt_config(**SMALL_PRE_LN), weight_format="none")
    with pytest.raises(CheckpointError, match="has no weights"):
        load(tmp_path)


def test_missing_tensor(tmp_path):
    d = write_opt_checkpoint(tmp_path, opt_config(**SMALL_PRE_LN))
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.decoder.layers.2.fc1.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing .*layers\.2\.fc1\.weight"):
        load(d)


def test_shape_mismatch(tmp_path):
    d = write_opt_checkpoint(tmp_path, opt_config(**SMALL_PRE_LN))
    sd = load_file(str(d / "model.safetensors"))
    sd["model.decoder.layers.0.fc2.weight"] = torch.zeros(3, 3)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.0\.fc2\.weight has shape \[3, 3\].*\[64, 128\]"):
        load(d)


def test_missing_shard_file(tmp_path):
    d = write_opt_checkpoint(tmp_path, opt_config(**SMALL_PRE_LN), weight_format="sharded")
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard files that are missing"):
        load(d)


def test_unexpected_keys_are_reported(tmp_path, caplog):
    d = write_opt_checkpoint(tmp_path, opt_config(**SMALL_PRE_LN))
    sd = load_file(str(d / "model.safetensors"))
    sd["model.decoder.something_else.weight"] = torch.zeros(2)
    save_file(sd, str(d / "model.safetensors"))
    with caplog.at_level(logging.WARNING):
        load(d)
    assert "something_else" in caplog.text


def test_bin_is_loaded_weights_only(tmp_path):
    """A .bin that needs full pickle (arbitrary objects) is refused, not executed."""
    d = write_opt_checkpoint(tmp_path, opt_config(**SMALL_PRE_LN), weight_format="bin")
    sd = torch.load(d / "pytorch_model.bin", weights_only=True)
    sd["evil"] = fractions.Fraction(1, 3)  # an arbitrary class: only full pickle would import it
    torch.save(sd, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights-only"):
        load(d)


class _Float32Bytes(TorchDispatchMode):
    """Counts the bytes of float32 storages off the meta device that ops create while it is on, and the peak of
    those alive at once (a storage counts until its last reference goes: weakref.finalize on the storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type != "meta":
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self._seen:
                    self._seen.add(key)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, nbytes)
        return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_half_precision_weights_are_never_made_in_float32(tmp_path, dtype, load_format):
    """The stage was once materialised in float32 and then cast, a peak of twice the final size. Now at most
    one checkpoint tensor is ever float32 at a time (the read of a float32 file, or the dummy weights' float32
    draw), never the model; and the weights are the same as the float32 load cast."""
    shape = dict(SMALL_PRE_LN, num_hidden_layers=8)  # the largest tensor is a small part of the model
    path = write_opt_checkpoint(tmp_path / "ckpt", opt_config(**shape), weight_format="safetensors")
    cfg, group = OPTConfig.from_model_dir(path), TensorParallelGroup(ParallelLayout())
    with _Float32Bytes() as tracked:
        stage = load_model_stage(path, cfg, group, dtype, "cpu", load_format=load_format)
    model_fp32 = sum(p.numel() * 4 for p in stage.parameters())
    largest_fp32 = max(t.numel() * 4 for t in load_file(path / "model.safetensors").values())
    assert all(p.dtype == dtype for p in stage.parameters())
    assert tracked.peak <= largest_fp32 < model_fp32 / 4, (tracked.peak, largest_fp32, model_fp32)
    want = load_model_stage(path, cfg, group, torch.float32, "cpu", load_format=load_format).to(dtype)
    for (name, got), (_, ref) in zip(stage.state_dict().items(), want.state_dict().items(), strict=True):
        assert torch.equal(got, ref), name
