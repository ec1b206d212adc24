"""The Llama-family model (engine/model/llama.py) against Hugging Face transformers' own LlamaForCausalLM,
Qwen2ForCausalLM and MistralForCausalLM on the same random weights (float32): logprobs agree within 1e-4 at
prefill (prompt logprobs) and at every decode step, in batches that mix prefill and decode jobs across KV block
boundaries; with 2 KV heads under 8 query heads and with a KV head per query head; rope_scaling off and on
(Llama 3's "llama3" stretch, with Llama 3's rope_theta); the rotary frequencies equal transformers' for every
rope type the model reads."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.model.llama_config import LlamaConfig
from engine.model.rotary import inverse_frequencies
from modelmaker.llama_checkpoint import llama_config
from tests.test_model_reference import check_mixed_batches_against_transformers

ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"]
# A pre-training context of 32 tokens: the test's positions reach past it, and with head dim 8 the frequencies
# fall in all three of llama3's bands (kept, interpolated, divided by factor).
LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=32)
ROPE = {"rope-off": {}, "rope-llama3": dict(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)}
# Each architecture's own traits come along: Qwen2 ties lm_head to the embeddings (and always has q/k/v biases);
# Mistral's config gives head_dim (16: q is 128 wide under a hidden size of 64).
TRAITS = {"LlamaForCausalLM": {}, "Qwen2ForCausalLM": dict(tie_word_embeddings=True),
          "MistralForCausalLM": dict(head_dim=16)}


@pytest.mark.parametrize("rope", list(ROPE))
@pytest.mark.parametrize("kv_heads", [2, 8], ids=["kv-heads-2-of-8", "kv-heads-8-of-8"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_logprobs_match_transformers_in_mixed_batches(architecture, kv_heads, rope, llama_checkpoint):
    model_dir = llama_checkpoint(architecture, num_key_value_heads=kv_heads, **TRAITS[architecture], **ROPE[rope])
    check_mixed_batches_against_transformers(model_dir, 512, getattr(transformers, architecture))


@pytest.mark.parametrize("scaling", [None, dict(rope_type="linear", factor=4.0), LLAMA3_SCALING,
                                     dict(LLAMA3_SCALING, original_max_position_embeddings=8192)],
                         ids=["default", "linear", "llama3", "llama3-long-context"])
@pytest.mark.parametrize("head_dim", [8, 128])
def test_rotary_frequencies_equal_transformers(scaling, head_dim):
    d = llama_config(hidden_size=8 * head_dim, rope_theta=500000.0, rope_scaling=scaling)
    ours = inverse_frequencies(LlamaConfig.from_dict(d, "LlamaForCausalLM").rope, head_dim)
    theirs = LlamaRotaryEmbedding(transformers.LlamaConfig.from_dict(d))
    assert theirs.attention_scaling == 1.0  # these types scale no cos/sin
    torch.testing.assert_close(ours, theirs.inv_freq, rtol=0, atol=0)
