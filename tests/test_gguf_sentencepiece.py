"""GGUF files with a SentencePiece vocabulary (tokenizer.ggml.model "llama": Llama 2, Mistral 7B, TinyLlama):
the tokenizer engine/gguf_tokenizer.py builds from the tokens, scores and token types encodes and decodes as
transformers' tokenizer of the same file does (byte fallback for characters the vocabulary lacks, "▁" for
spaces, control tokens whole, BOS as tokenizer.ggml.add_bos_token says); a model served from such a file gives
transformers' logprobs, and over HTTP a stop string whose bytes arrive over several <0xNN> tokens stops
generation and is cut from the text (tests/test_stop_byte_fallback.py's chain model, written as a GGUF file)."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import pytest
from transformers import AutoTokenizer, LlamaForCausalLM
from transformers.tokenization_utils_base import generate_merges

from engine.gguf_tokenizer import sentencepiece_merges
from engine.model.registry import load_model_config
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from modelmaker.gguf_checkpoint import SentencePieceVocab, sentencepiece_vocab, write_gguf_checkpoint
from modelmaker.llama_checkpoint import llama_config, random_llama_state_dict
from tests.server_fixtures import QUICK_ARGS, served_client
from tests.test_model_reference import check_mixed_batches_against_transformers
from tests.test_stop_byte_fallback import PIECES, VOCAB, chain_state_dict, complete

Q = gguf.GGMLQuantizationType
TEXTS = ["Hello world", " hello world", "  two leading spaces", "a  b   c    d", "trailing space ", "", " ", "\n",
         "the capital of France is Paris\n\nnewlines\ttabs", "digits 12345 and 3.14", "don't I'LL",
         "café é", "日本", "🙂 emoji", "Ünïcödé 日本語 🙂",  # characters the vocabulary lacks: byte tokens
         "[INST] what is it? [/INST]", "hello\n[INST]\n hello", "<s>hello</s>", "<unk> x"]  # special tokens


def spm_gguf(tmp_path: Path, vocab: SentencePieceVocab | None = None, name: str = "spm.gguf", **qtypes) -> Path:
    """A random-weight Llama GGUF file (modelmaker's small shape) with a SentencePiece vocabulary."""
    vocab = vocab or sentencepiece_vocab()
    cfg = llama_config("LlamaForCausalLM", vocab_size=len(vocab.tokens))
    return write_gguf_checkpoint(tmp_path / name, cfg, random_llama_state_dict(cfg, seed=5), vocab, **qtypes)


def reference(path: Path):
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory) -> Path:
    return spm_gguf(tmp_path_factory.mktemp("spm"))


def test_the_vocabulary_is_sentencepiece_shaped():
    vocab = sentencepiece_vocab()
    assert 300 < len(vocab.tokens) < 500 and vocab.tokens[:3] == ("<unk>", "<s>", "</s>")
    assert vocab.tokens[3:259] == tuple(f"<0x{b:02X}>" for b in range(256)) and set(vocab.types[3:259]) == {6}
    assert {"▁hello", "▁Paris", "ing", "▁▁"} <= set(vocab.tokens) and "é" not in vocab.tokens
    assert vocab.types[-2:] == (3, 3) and vocab.tokens[-2:] == ("[INST]", "[/INST]")


def test_the_merges_are_transformers_generate_merges():
    vocab = sentencepiece_vocab()
    tokens, scores = list(vocab.tokens), list(vocab.scores)
    ours = sentencepiece_merges(tokens, scores)
    assert len(ours) > 100
    assert ours == generate_merges({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores)))


def test_encode_and_decode_equal_transformers(spm_file):
    ours, theirs = Tokenizer.from_pretrained(spm_file), reference(spm_file)
    rng = random.Random(0)
    alphabet = [*"helowrdthcapifsnu IL'ge1", "  ", "é", "\n", "hello", "Paris", "ing", "[INST]", "日"]
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(300)]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
    byte_tokens = [ours.id_to_token(i) for i in ours.encode("日本", add_special_tokens=False)]
    assert byte_tokens == ["▁", "<0xE6>", "<0x97>", "<0xA5>", "<0xE6>", "<0x9C>", "<0xAC>"]
    index = sentencepiece_vocab().tokens.index
    assert ours.encode("[INST] hello", add_special_tokens=False) == [index("[INST]"), index("▁hello")]
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id, ours.add_bos) == (1, 2, 0, True)
    assert {0, 1, 2, index("[INST]"), index("[/INST]")} == ours.all_special_ids


def test_streamed_text_is_the_decoded_text(spm_file):
    """Token by token, the detokenizer writes what decoding the whole sequence writes: bytes of one character
    held until complete, the leading space of the first piece stripped only there."""
    tokenizer = Tokenizer.from_pretrained(spm_file)
    for text in ("Hello world 日本 🙂 café", " hello  world\n[INST] é"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer, [1])
        pieces = [detok.step([i]) for i in ids]
        assert "".join(pieces) + detok.flush() == tokenizer.decode(ids) == reference(spm_file).decode(
            ids, skip_special_tokens=True)
        assert "\ufffd" not in "".join(pieces)


def test_add_bos_false_is_honoured(tmp_path):
    vocab = sentencepiece_vocab()
    path = spm_gguf(tmp_path, SentencePieceVocab(vocab.tokens, vocab.scores, vocab.types, add_bos=False))
    ours = Tokenizer.from_pretrained(path)
    assert not ours.add_bos and ours.encode("hello world") == reference(path).encode("hello world")[:2] == [339, 340]


def test_add_space_prefix_false_writes_no_space_before_the_text(tmp_path):
    """tokenizer.ggml.add_space_prefix false (llama.cpp reads it; transformers' GGUF tokenizer does not, so this
    is checked against llama.cpp's rule, not against transformers): no "▁" before the text, none stripped."""
    vocab = sentencepiece_vocab()
    path = spm_gguf(tmp_path, SentencePieceVocab(vocab.tokens, vocab.scores, vocab.types, add_space_prefix=False))
    ours, index = Tokenizer.from_pretrained(path), vocab.tokens.index
    ids = ours.encode("hello world", add_special_tokens=False)
    assert ids[-1] == index("▁world") and index("▁hello") not in ids and ids[0] == index("h")
    assert ours.decode(ids) == "hello world" and ours.decode(ours.encode(" hello")) == " hello"


def test_a_sentencepiece_gguf_serves_with_transformers_logprobs(spm_file):
    cfg = load_model_config(spm_file)
    assert (cfg.architecture, cfg.vocab_size) == ("LlamaForCausalLM", 391)
    check_mixed_batches_against_transformers(spm_file, cfg.vocab_size, LlamaForCausalLM)


@pytest.fixture(scope="module")
def chain_client(tmp_path_factory):
    """tests/test_stop_byte_fallback.py's chain model as a GGUF file with its vocabulary as SentencePiece pieces,
    served (engine/gguf_checkpoint.py loading it, engine/gguf_tokenizer.py tokenizing)."""
    vocab = SentencePieceVocab.from_pieces(PIECES)
    assert {t: i for i, t in enumerate(vocab.tokens)} == VOCAB
    out = tmp_path_factory.mktemp("byte-fallback-gguf")
    cfg = llama_config(vocab_size=len(VOCAB), bos_token_id=1, eos_token_id=2)
    path = write_gguf_checkpoint(out / "chain.gguf", cfg, chain_state_dict(cfg), vocab, default_qtype=Q.F32)
    with served_client(path, (*QUICK_ARGS, "--num-gpu-blocks-override", "64"), out) as client:
        yield client


def test_the_gguf_chain_model_completes(chain_client):
    assert complete(chain_client, None) == ("x→yx→yx\ufffd", "length", 12)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop, text, tokens", [(["→"], "x", 4), (["→yx"], "x", 6), (["x→y", "→"], "x", 4)])
def test_a_stop_string_split_over_byte_tokens_stops_and_is_cut(chain_client, stop, text, tokens, stream):
    assert complete(chain_client, stop, stream) == (text, "stop", None if stream else tokens)
