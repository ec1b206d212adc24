"""--load-format dummy: random weights made from config.json alone, so a config-only directory serves, OPT's and
the Llama family's (grouped-query attention, a gated MLP); the same name-seeded weights at every tensor-parallel
layout."""

from __future__ import annotations

import shutil

import pytest

from engine import LLM, SamplingParams
from engine.errors import CheckpointError
from modelmaker.llama_checkpoint import llama_config, write_llama_checkpoint
from modelmaker.opt_checkpoint import opt_config, write_opt_checkpoint
from tests.server_fixtures import QUICK_ARGS, post_json, start_server

SHAPE = dict(vocab_size=4096, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, ffn_dim=128,
             max_position_embeddings=256, word_embed_proj_dim=32)  # with project_in/out


# The Llama case runs with `make test-slow` (its tensor-parallel x pipeline-parallel layout starts 4 workers); in the
# default run tests/test_profile_models.py serves a Llama config-only directory with dummy weights.
@pytest.fixture(scope="module", params=["OPTForCausalLM", pytest.param("LlamaForCausalLM", marks=pytest.mark.slow)])
def config_only(request, tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("dummy")
    if request.param == "OPTForCausalLM":
        out = write_opt_checkpoint(root / "opt-small-config", opt_config(**SHAPE), weight_format="none")
    else:  # 8 query heads over 2 KV heads (tensor parallel 2: one KV head a rank), untied embeddings
        out = write_llama_checkpoint(root / "llama-small-config", llama_config(vocab_size=4096), weight_format="none")
    for f in tiny_model_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copyfile(f, out / f.name)
    return out


def test_a_config_only_directory_needs_dummy_weights(config_only):
    with pytest.raises(CheckpointError, match="has no weights"):
        LLM(str(config_only), profile="analytic", num_gpu_blocks_override=16)


def test_dummy_weights_serve_a_completion_over_http(config_only, tmp_path):
    srv = start_server(config_only, (*QUICK_ARGS, "--num-gpu-blocks-override", "64", "--load-format", "dummy"),
                       tmp_path)
    try:
        status, _, body = post_json(srv.url + "/v1/completions",
                                    {"prompt": "Hello", "max_tokens": 5,
                                     "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 5
    finally:
        srv.stop()


def test_dummy_weights_do_not_depend_on_the_layout(config_only):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[2, 50, 60, 70], [2, 9]]
    single = LLM(str(config_only), load_format="dummy", profile="analytic", num_gpu_blocks_override=64)
    again = LLM(str(config_only), load_format="dummy", profile="analytic", num_gpu_blocks_override=64)
    want = [o.outputs[0].token_ids for o in single.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in again.generate(prompts, params)] == want  # deterministic
    assert len(set(want[0])) > 1, "dummy weights should not make a constant model"
    with LLM(str(config_only), load_format="dummy", profile="analytic", num_gpu_blocks_override=64,
             tensor_parallel_size=2, pipeline_parallel_size=2) as parallel:
        assert [o.outputs[0].token_ids for o in parallel.generate(prompts, params)] == want
