"""Stop strings over a SentencePiece-style vocabulary (Llama 2, Mistral): a character the vocabulary lacks is
written as its UTF-8 bytes, one <0xNN> token each (BPE byte_fallback). A stop string whose bytes arrive over
several such tokens still stops generation and is cut from the text, over HTTP with the real openai client.

The checkpoint is a Llama one in the Hugging Face layout whose weights are chosen, not drawn: its attention and
MLP write nothing into the residual stream (o_proj and down_proj are zero), so the logits at a position depend
on its token alone, and the lm_head maps each token of a chain to the next one. After "y" the model writes
"x", then the bytes E2 86 92 ("→") one token each, then "y" again, forever."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, processors

from engine.tokenizer import Tokenizer
from modelmaker.hf_files import write_checkpoint
from modelmaker.llama_checkpoint import llama_config, random_llama_state_dict
from tests.server_fixtures import QUICK_ARGS, served_client

SPECIAL = ["<unk>", "<s>", "</s>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
PIECES = ["▁", "x", "y", "▁y", "a", "b"]
VOCAB = {t: i for i, t in enumerate(SPECIAL + BYTES + PIECES)}
CHAIN = ["▁y", "x", "<0xE2>", "<0x86>", "<0x92>", "y", "x"]  # each token's greedy successor: the next
LOGIT_SCALE = 8.0


def write_tokenizer(out: Path) -> None:
    """Llama 2's tokenizer.json shape: "▁" for spaces (and before the text), BPE with byte fallback, "<s>"
    prepended, bytes fused back into characters on decoding."""
    backend = HFTokenizer(models.BPE(VOCAB, [("▁", "y")], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.add_special_tokens(SPECIAL)
    backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                           "unk_token": "<unk>", "add_bos_token": True}))


def chain_state_dict(cfg: dict) -> dict[str, torch.Tensor]:
    sd = random_llama_state_dict(cfg, seed=3)
    for name, t in sd.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t.zero_()
    hidden = cfg["hidden_size"]
    basis = torch.linalg.qr(torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(0)))[0]
    embed, head = sd["model.embed_tokens.weight"], sd["lm_head.weight"]
    head.zero_()
    for k, (token, successor) in enumerate(zip(CHAIN, CHAIN[1:])):  # "x" follows two tokens: its row is a sum
        embed[VOCAB[token]] = basis[k] * hidden ** 0.5
        head[VOCAB[successor]] += basis[k] * LOGIT_SCALE
    return sd


@pytest.fixture(scope="module")
def chain_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("byte-fallback")
    cfg = llama_config(vocab_size=len(VOCAB), bos_token_id=1, eos_token_id=2)
    write_checkpoint(out, cfg, chain_state_dict, "safetensors", torch.float32, 1)
    write_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def chain_client(chain_model, tmp_path_factory):
    with served_client(chain_model, (*QUICK_ARGS, "--num-gpu-blocks-override", "64"),
                       tmp_path_factory.mktemp("byte-fallback-logs")) as client:
        yield client


def test_the_arrow_is_three_byte_tokens(chain_model):
    tokenizer = Tokenizer.from_pretrained(chain_model)
    assert tokenizer.encode("y→", add_special_tokens=False) == [VOCAB[t] for t in ("▁y", "<0xE2>", "<0x86>",
                                                                                   "<0x92>")]


def complete(client: openai.OpenAI, stop: list[str] | None, stream: bool = False) -> tuple[str, str, int | None]:
    """(text, finish_reason, completion tokens) of a greedy completion of "y"."""
    kw = dict(model=client.models.list().data[0].id, prompt="y", max_tokens=12, temperature=0, stop=stop)
    if not stream:
        out = client.completions.create(**kw)
        return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens
    chunks = list(client.completions.create(**kw, stream=True))
    return ("".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].choices[0].finish_reason, None)


def test_without_a_stop_string_the_chain_runs_to_max_tokens(chain_client):
    """12 tokens end on the first byte of a third "→": flushed at the finish as U+FFFD."""
    assert complete(chain_client, None) == ("x→yx→yx\ufffd", "length", 12)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop, text, tokens", [
    (["→"], "x", 4),  # ends on the third byte token of its first "→"
    (["→yx"], "x", 6),  # spans the bytes and the pieces after them
    (["x→y", "→"], "x", 4),  # the earliest match wins, once its bytes are complete
])
def test_a_stop_string_split_over_byte_tokens_stops_and_is_cut(chain_client, stop, text, tokens, stream):
    got = complete(chain_client, stop, stream)
    assert got == (text, "stop", None if stream else tokens)
