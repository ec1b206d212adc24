"""Loading Llama-family checkpoints: config.json's architectures picks the model (an unknown one is a one-line
error naming those supported); every weight layout loads the same model; q/k/v and gate/up are fused from the
checkpoint's tensors; tied and untied heads; what cannot be served is refused at load with what to do; and the
tensor- and pipeline-parallel shards (KV heads split, or replicated when fewer than the ranks) compute what the
whole model computes."""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.batch import ModelBatch, SequenceWork
from engine.errors import CheckpointError
from engine.kv_cache import kv_block_shape
from engine.loader import load_model_stage
from engine.model.llama import LlamaStage
from engine.model.llama_config import LlamaConfig
from engine.model.registry import ARCHITECTURES, load_model_config
from engine.model_runner import ModelRunner
from engine.parallel import ParallelLayout, TensorParallelGroup
from engine.sampling_params import SamplingParams as Params
from modelmaker.llama_checkpoint import llama_config, write_llama_checkpoint
from tests.test_loader import assert_all_load_the_same
from tests.test_model_reference import TOL
from tests.test_parallel import _ThreadAllReduce


def load(path, layout: ParallelLayout | None = None, group: TensorParallelGroup | None = None):
    group = group or TensorParallelGroup(layout or ParallelLayout())
    return load_model_stage(path, load_model_config(path), group, "float32", "cpu")


@pytest.mark.parametrize("named", [["GPTNeoXForCausalLM"], None])
def test_an_unknown_architecture_is_one_line_naming_those_supported(tmp_path, named):
    cfg = llama_config()
    if named is None:  # no architectures, and a model_type we do not know either
        del cfg["architectures"]
        cfg["model_type"] = "gpt_neox"
    else:
        cfg["architectures"] = named
    write_llama_checkpoint(tmp_path, cfg, weight_format="none")
    with pytest.raises(CheckpointError) as err:
        LLM(model=str(tmp_path), profile="analytic")
    message = str(err.value)
    assert "\n" not in message and all(arch in message for arch in ARCHITECTURES), message
    assert "GPTNeoXForCausalLM" in message or "gpt_neox" in message


def test_model_type_stands_in_for_architectures_and_other_architectures_in_the_list_are_skipped(tmp_path):
    cfg = dict(llama_config("Qwen2ForCausalLM"))
    del cfg["architectures"]
    write_llama_checkpoint(tmp_path / "a", cfg, weight_format="none")
    assert load_model_config(tmp_path / "a").architecture == "Qwen2ForCausalLM"
    write_llama_checkpoint(tmp_path / "b", llama_config(architectures=["SomethingElse", "MistralForCausalLM"]),
                           weight_format="none")
    assert load_model_config(tmp_path / "b").architecture == "MistralForCausalLM"


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_every_weight_layout_loads_the_same_model(tmp_path, architecture):
    """One safetensors file, shards with model.safetensors.index.json, and pytorch_model.bin."""
    dirs = {fmt: write_llama_checkpoint(tmp_path / fmt, llama_config(architecture), seed=3, weight_format=fmt)
            for fmt in ("safetensors", "sharded", "bin")}
    assert (dirs["sharded"] / "model.safetensors.index.json").is_file()
    assert len(list(dirs["sharded"].glob("model-*.safetensors"))) == 2
    assert_all_load_the_same(dirs, load)


def test_qkv_with_biases_and_gate_up_are_fused_from_the_checkpoints_tensors(tmp_path):
    d = write_llama_checkpoint(tmp_path, llama_config("Qwen2ForCausalLM"), seed=1)
    raw = load_file(str(d / "model.safetensors"))
    layer = load(d).layers[1]
    p = "model.layers.1."
    for kind in ("weight", "bias"):  # Qwen2: q, k and v carry biases
        fused = getattr(layer.self_attn.qkv_proj, kind)
        want = torch.cat([raw[f"{p}self_attn.{n}_proj.{kind}"] for n in "qkv"])
        assert fused.shape[0] == (8 + 2 * 2) * 8 and torch.equal(fused, want)
    assert layer.self_attn.o_proj.bias is None
    gate_up = torch.cat([raw[p + "mlp.gate_proj.weight"], raw[p + "mlp.up_proj.weight"]])
    assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)


def test_tied_and_untied_heads(tmp_path, caplog):
    untied = write_llama_checkpoint(tmp_path / "untied", llama_config(), seed=2)
    stage = load(untied)
    assert torch.equal(stage.lm_head.weight, load_file(str(untied / "model.safetensors"))["lm_head.weight"])
    assert not torch.equal(stage.lm_head.weight, stage.embed_tokens.weight)
    # Tied: no lm_head of its own; a checkpoint that carries a copy anyway (and the rotary buffer older
    # transformers saved) loads without a word about unused tensors.
    tied = write_llama_checkpoint(tmp_path / "tied", llama_config(tie_word_embeddings=True), seed=2)
    sd = load_file(str(tied / "model.safetensors"))
    assert "lm_head.weight" not in sd
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(sd, str(tied / "model.safetensors"))
    with caplog.at_level(logging.WARNING):
        stage = load(tied)
    assert stage.lm_head is None and "not used" not in caplog.text
    h = torch.randn(3, 64)
    torch.testing.assert_close(stage.compute_logits(h, torch.arange(3)),
                               torch.nn.functional.linear(stage.norm(h), stage.embed_tokens.weight))


def test_a_missing_tensor_is_named(tmp_path):
    d = write_llama_checkpoint(tmp_path, llama_config(), seed=1)
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.2.self_attn.v_proj.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing .*layers\.2\.self_attn\.qkv_proj\.weight"):
        load(d)


def test_a_kv_projection_of_the_wrong_head_count_is_a_shape_error(tmp_path):
    d = write_llama_checkpoint(tmp_path, llama_config(num_key_value_heads=4), seed=1)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, num_key_value_heads=2)))
    with pytest.raises(CheckpointError, match=r"k_proj\.weight has shape \[32, 64\].*\[16, 64\]"):
        load(d)


@pytest.mark.parametrize("architecture, fields", [
    ("MistralForCausalLM", dict(sliding_window=64)),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=64, max_window_layers=1)),
])
def test_a_sliding_window_shorter_than_the_context_is_refused_with_what_to_do(llama_checkpoint, architecture,
                                                                              fields):
    model_dir = llama_checkpoint(architecture, **fields)
    with pytest.raises(CheckpointError, match=r"sliding window of 64 tokens, shorter than max_model_len 256.*"
                                              r"--max-model-len 64 or less"):
        LLM(model=str(model_dir), profile="analytic", num_gpu_blocks_override=64)
    with LLM(model=str(model_dir), profile="analytic", num_gpu_blocks_override=64, max_model_len=64) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3


def test_sliding_windows_that_do_not_apply_are_no_obstacle():
    """Qwen2 with use_sliding_window false (its published configs), or with every layer below
    max_window_layers; Mistral with sliding_window null (v0.2 on) or as long as the context."""
    for arch, fields in [("Qwen2ForCausalLM", dict(use_sliding_window=False, sliding_window=64)),
                         ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=64, max_window_layers=3)),
                         ("MistralForCausalLM", dict(sliding_window=None)),
                         ("MistralForCausalLM", dict(sliding_window=256))]:
        LlamaConfig.from_dict(llama_config(arch, **fields), arch).check_max_model_len(256)


@pytest.mark.parametrize("fields, message", [
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "rope_type 'yarn' is not supported; supported: "
                                                             "default, linear, llama3"),
    (dict(rope_scaling=dict(rope_type="llama3", factor=8.0)), "llama3 rope_scaling has no 'low_freq_factor'"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads 3"),
])
def test_settings_the_model_cannot_compute_are_one_line_errors(tmp_path, fields, message):
    write_llama_checkpoint(tmp_path, llama_config(**fields), weight_format="none")
    with pytest.raises(CheckpointError, match=message):
        load_model_config(tmp_path)


def test_dummy_weights_serve_a_config_only_llama_directory(llama_checkpoint, tmp_path):
    write_llama_checkpoint(tmp_path, llama_config(tie_word_embeddings=True), weight_format="none")
    (tmp_path / "tokenizer.json").write_bytes((llama_checkpoint() / "tokenizer.json").read_bytes())
    with LLM(model=str(tmp_path), load_format="dummy", profile="analytic", num_gpu_blocks_override=64) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4


# -- tensor and pipeline parallel shards, in process --------------------------------------------------------------
@pytest.mark.parametrize("tp, first_heads", [(2, [0, 1]), (4, [0, 0, 1, 1])], ids=["split", "replicated"])
def test_each_rank_holds_the_kv_heads_its_query_heads_read(tmp_path, tp, first_heads):
    """8 query heads over 2 KV heads: on 2 ranks one KV head each; on 4, each KV head on the 2 ranks whose query
    heads read it (vLLM's replication). A rank's fused q/k/v rows are its query heads' and its KV head's, and
    its KV cache block holds that one head."""
    d = write_llama_checkpoint(tmp_path, llama_config(), seed=4)
    raw = load_file(str(d / "model.safetensors"))
    cfg = load_model_config(d)
    rows = lambda name, first, n: raw[f"model.layers.0.self_attn.{name}.weight"][first * 8:(first + n) * 8]  # noqa
    for rank in range(tp):
        layout = ParallelLayout(tp_size=tp, tp_rank=rank)
        qkv = load(d, layout).layers[0].self_attn.qkv_proj.weight
        q_heads = 8 // tp
        want = torch.cat([rows("q_proj", rank * q_heads, q_heads), rows("k_proj", first_heads[rank], 1),
                          rows("v_proj", first_heads[rank], 1)])
        assert torch.equal(qkv, want), f"rank {rank}"
        assert kv_block_shape(cfg, layout, 16) == (3, 2, 1, 16, 8)


def _step_logits(stages_of_rank, runners_of_rank, batches):
    """Each batch through every pipeline stage of one tensor-parallel rank; the last stage's logits of every row."""
    out = []
    for batch in batches:
        hidden = None
        for runner in runners_of_rank:
            hidden = runner.forward(runner.prepare(batch), hidden)
        inputs = runners_of_rank[-1].prepare(batch)
        with torch.inference_mode():
            out.append(stages_of_rank[-1].compute_logits(hidden, torch.arange(inputs.num_tokens)))
    return out


@pytest.mark.parametrize("architecture, tp, pp", [("LlamaForCausalLM", 2, 1), ("LlamaForCausalLM", 4, 1),
                                                  ("Qwen2ForCausalLM", 2, 3), ("MistralForCausalLM", 1, 2)])
def test_sharded_stages_compute_what_the_whole_model_computes(llama_checkpoint, architecture, tp, pp):
    """A prefill of 9 tokens then a decode step, through tp ranks (threads, summing in an in-process all-reduce)
    and pp stages (hidden states handed on): every rank's logits equal the unsharded model's within float32
    rounding (TOL: the split sums of the ranks, and the unsharded model's matmuls on oneDNN-packed weights against
    the ranks' MKL ones, differ by up to ~2e-5 on logits of ~35). Qwen2 here ties its head to the embeddings, which
    the last stage then holds too."""
    model_dir = llama_checkpoint(architecture, tie_word_embeddings=architecture == "Qwen2ForCausalLM")
    prompt = [7, 100, 3, 45, 9, 300, 11, 12, 60]
    batches = [ModelBatch([SequenceWork("x", prompt, 0, [0, 1, 2], Params(), None, 0)], None),
               ModelBatch([SequenceWork("x", [21], 9, [0, 1, 2], Params(), None, 1)], None)]

    def runners(stages):
        made = [ModelRunner(s, torch.device("cpu"), torch.float32, 4) for s in stages]
        for r in made:
            r.allocate_kv_cache(4)
        return made

    whole = [load(model_dir)]
    want = _step_logits(whole, runners(whole), batches)
    reducers = [_ThreadAllReduce(tp) for _ in range(pp)]
    stages = [[load(model_dir, group=reducers[s].group(ParallelLayout(tp, pp, r, s))) for s in range(pp)]
              for r in range(tp)]
    assert all(isinstance(st, LlamaStage) for st in stages[0])
    if pp > 1:
        assert [len(st.layers) for st in stages[0]] == [3 // pp + (i < 3 % pp) for i in range(pp)]
        assert hasattr(stages[0][-1], "embed_tokens") == (architecture == "Qwen2ForCausalLM")
    got: list = [None] * tp

    def run(rank: int) -> None:
        got[rank] = _step_logits(stages[rank], runners(stages[rank]), batches)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank in range(tp):
        for step, (g, w) in enumerate(zip(got[rank], want)):
            torch.testing.assert_close(g, w, atol=TOL, rtol=1e-5, msg=f"rank {rank} step {step}")
