"""GGUF K-quant tensors (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: the types of a Q4_K_M or Q5_K_M file) and BF16
(engine/gguf_dequant.py): they dequantize to the gguf package's values and, for the K-quants, to those of
transformers' own torch dequantizer; a model whose weights are stored in them serves with the logprobs of
transformers loading the same file. The gguf package has no K-quant quantizer, so the files hold seeded random
K-quant blocks with scales sized like the random model's weights (modelmaker/gguf_checkpoint.py); Q8_K and the
IQ types stay a one-line error naming the type (tests/test_gguf.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM, Qwen2ForCausalLM
from transformers.integrations.gguf.dequant import dequantize as transformers_dequantize

from engine.gguf_dequant import dequantize
from engine.model.registry import load_model_config
from modelmaker.gguf_checkpoint import K_SCALES, _tensor_bytes
from tests.test_gguf import gguf_model
from tests.test_model_reference import check_mixed_batches_against_transformers

Q = gguf.GGMLQuantizationType
# A Q4_K_M-like mix (Q4_K for most weights, Q6_K for down_proj, v_proj and the output) with every other
# readable K-quant and BF16 on some weight; hidden and intermediate sizes are multiples of the 256-value blocks.
K_MIX = {"q_proj.weight": Q.Q4_K, "k_proj.weight": Q.Q5_K, "v_proj.weight": Q.Q6_K, "o_proj.weight": Q.Q3_K,
         "gate_proj.weight": Q.Q4_K, "up_proj.weight": Q.Q2_K, "down_proj.weight": Q.Q6_K,
         "embed_tokens.weight": Q.BF16, "lm_head.weight": Q.Q6_K}


@pytest.mark.parametrize("qtype", [*K_SCALES, Q.BF16])
def test_k_quants_and_bf16_dequantize_to_the_gguf_packages_values(qtype):
    values = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32) * 0.02
    raw = _tensor_bytes(values, qtype, seed=1)
    got = dequantize(raw, qtype, (6, 512), "t")
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    assert got.dtype == torch.float32 and torch.equal(got, want) and bool(got.isfinite().all())
    assert 0.015 < float(got.std()) < 0.025  # the scales modelmaker sets: weights of the random model's size
    if qtype in K_SCALES:  # an independent implementation: transformers' torch port
        assert torch.equal(got, transformers_dequantize(torch.from_numpy(raw), int(qtype)).reshape(6, 512))
    else:  # BF16 is float32 with the low 16 bits cut
        assert torch.equal(got, torch.from_numpy(values).bfloat16().float())


@pytest.mark.parametrize("architecture, model_class", [("LlamaForCausalLM", LlamaForCausalLM),
                                                       ("Qwen2ForCausalLM", Qwen2ForCausalLM)])
def test_a_k_quant_gguf_serves_with_transformers_logprobs(tmp_path, tiny_model_dir, architecture, model_class):
    path = gguf_model(tmp_path, tiny_model_dir, architecture, qtypes=K_MIX, hidden_size=256, intermediate_size=512)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert (types["blk.0.attn_q.weight"], types["blk.2.ffn_down.weight"], types["output.weight"]) == (
        Q.Q4_K, Q.Q6_K, Q.Q6_K)
    cfg = load_model_config(path)
    check_mixed_batches_against_transformers(path, cfg.vocab_size, model_class)
