"""Random-weight Llama-family GGUF files, written as llama.cpp's convert_hf_to_gguf.py writes them.

What it is: a Hugging Face state dict and config.json dict (modelmaker/llama_checkpoint.py) turned into one
.gguf file: the architecture's metadata (llama.* or qwen2.*), the tensors under llama.cpp's names
(engine/gguf_checkpoint.py's tables, inverted), q and k rows permuted for the "llama" architecture as
llama.cpp does, each tensor stored in the ggml type asked for (quantized with the gguf package's own
quantizers; 1-D tensors stay F32, as llama.cpp keeps norms and biases), and a byte-level BPE tokenizer's
vocabulary, merges, special tokens and chat template taken from a Hugging Face tokenizer.json, or a
SentencePiece-style one (SentencePieceVocab: tokenizer.ggml.model "llama", as Llama 2 and Mistral files are
written: pieces with scores and token types, the 256 <0xNN> byte tokens, no merges). A type the gguf
package cannot quantize (it has no K-quant quantizer) is filled with seeded random blocks of that type's size:
for Q2_K..Q6_K with their float16 super-block scales set to seeded values that give the tensor the standard
deviation of the values it stands for (a random model with K-quant weights to load; not a quantization of
those values), for another type random bytes, enough to test that a reader refuses it. What it is not: a
converter for real checkpoints (llama.cpp's is).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from engine.gguf_checkpoint import ARCHITECTURES, GLOBAL_NAMES, LAYER_NAMES

_TO_GGUF_ARCH = {hf: arch for arch, hf in ARCHITECTURES.items()}
_TO_GGUF_GLOBAL = {hf: name for name, hf in GLOBAL_NAMES.items()}
_TO_GGUF_LAYER = {hf: key for key, hf in LAYER_NAMES.items()}
QUANTIZABLE = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
               gguf.GGMLQuantizationType.BF16)
# Byte offsets of a K-quant block's float16 super-block scales (d, and dmin where it has one): ggml's
# block_q2_K .. block_q6_K
K_SCALES = {gguf.GGMLQuantizationType.Q2_K: (80, 82), gguf.GGMLQuantizationType.Q3_K: (108,),
            gguf.GGMLQuantizationType.Q4_K: (0, 2), gguf.GGMLQuantizationType.Q5_K: (0, 2),
            gguf.GGMLQuantizationType.Q6_K: (208,)}


def gguf_name(name: str) -> str:
    """llama.cpp's name of Hugging Face tensor `name` (model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight)."""
    if name in _TO_GGUF_GLOBAL:
        return _TO_GGUF_GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)  # model, layers, N, module.kind
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_TO_GGUF_LAYER[module]}.{kind}"


def permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's permute of q/k rows (convert_hf_to_gguf.py LlamaModel.permute): each head's rotary halves
    interleaved."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_bytes(values: np.ndarray, qtype: gguf.GGMLQuantizationType, seed: int) -> np.ndarray:
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return values.astype(np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16)
    if qtype in QUANTIZABLE:
        return gguf.quants.quantize(values, qtype)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block * type_size), dtype=np.uint8)
    if qtype in K_SCALES:
        return random_k_blocks(raw, qtype, rng.uniform(-1, 1, (raw.size // type_size, len(K_SCALES[qtype]))),
                               float(values.std()))
    return raw


def random_k_blocks(raw: np.ndarray, qtype: gguf.GGMLQuantizationType, scales: np.ndarray, std: float
                    ) -> np.ndarray:
    """K-quant bytes `raw` with each block's float16 d (and dmin) set to `scales` [blocks, 1 or 2] times the
    factor that makes the dequantized values' standard deviation `std` (the values are linear in d and dmin)."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, type_size)

    def put(values: np.ndarray) -> None:
        for k, offset in enumerate(K_SCALES[qtype]):
            blocks[:, offset:offset + 2] = values[:, k].astype(np.float16).view(np.uint8).reshape(-1, 2)

    put(scales)
    put(scales * std / float(gguf.quants.dequantize(raw, qtype).std()))
    return raw


# Words whose "▁"-prefixed pieces (and every prefix of them) the default SentencePiece vocabulary holds
SPM_WORDS = ("hello", "world", "the", "capital", "of", "france", "is", "paris", "what", "up", "spaces", "new",
             "lines", "tabs", "don", "I", "LL", "Hello", "France", "Paris", "a", "an", "and", "in", "to", "it")
SPM_SUFFIXES = ("ing", "ed", "es", "er", "ll", "'t", "'s")  # pieces without "▁", inside words
SPM_CONTROL = ("[INST]", "[/INST]")  # control tokens (token type 3) past the pieces, as Mistral's files have


@dataclass(frozen=True)
class SentencePieceVocab:
    """A SentencePiece-style GGUF vocabulary: tokens (ids in order), their scores and llama.cpp token types;
    <unk>, <s>, </s> are ids 0, 1, 2."""
    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]
    add_bos: bool = True
    add_space_prefix: bool | None = None  # tokenizer.ggml.add_space_prefix; None: not written (llama.cpp: true)

    @classmethod
    def from_pieces(cls, pieces: Sequence[str], control: Sequence[str] = (), add_bos: bool = True
                    ) -> SentencePieceVocab:
        """<unk>, <s>, </s>, the 256 byte tokens, `pieces` (scored as a SentencePiece BPE model scores them: a
        piece of two or more characters -i, its merge rank, a single character below all of those), then
        `control`."""
        specials = (("<unk>", 0.0, gguf.TokenType.UNKNOWN), ("<s>", 0.0, gguf.TokenType.CONTROL),
                    ("</s>", 0.0, gguf.TokenType.CONTROL))
        rows = [*specials, *((f"<0x{b:02X}>", 0.0, gguf.TokenType.BYTE) for b in range(256))]
        rows += [(p, float(-i if len(p) > 1 else -10_000 - i), gguf.TokenType.NORMAL) for i, p in enumerate(pieces)]
        rows += [(t, 0.0, gguf.TokenType.CONTROL) for t in control]
        tokens, scores, types = zip(*rows)
        return cls(tokens, scores, tuple(int(t) for t in types), add_bos)


def sentencepiece_vocab(words: Sequence[str] = SPM_WORDS, suffixes: Sequence[str] = SPM_SUFFIXES,
                        control: Sequence[str] = SPM_CONTROL) -> SentencePieceVocab:
    """A small SentencePiece-style vocabulary: "▁", "▁▁", "▁▁▁▁", every prefix of each "▁word" and suffix
    (shortest first), their single characters and the digits; characters it lacks (newlines, "é", CJK, emoji)
    fall back to byte tokens."""
    multi = ["▁▁", "▁▁▁▁"]
    for word in [*("▁" + w for w in words), *suffixes]:
        multi += [word[:n] for n in range(2, len(word) + 1)]
    multi = sorted(dict.fromkeys(multi), key=len)
    chars = dict.fromkeys(["▁", *"".join(multi).replace("▁", ""), *"0123456789"])
    return SentencePieceVocab.from_pieces([*multi, *chars], control)


def _add_sentencepiece_tokenizer(writer: gguf.GGUFWriter, vocab: SentencePieceVocab) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_scores(list(vocab.scores))
    writer.add_token_types(list(vocab.types))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(False)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer_dir: Path | SentencePieceVocab, add_bos: bool) -> None:
    if isinstance(tokenizer_dir, SentencePieceVocab):
        return _add_sentencepiece_tokenizer(writer, tokenizer_dir)
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"]: t["id"] for t in spec["added_tokens"] if t.get("special")}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    config = json.loads((tokenizer_dir / "special_tokens_map.json").read_text(encoding="utf-8"))
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("unk_token", writer.add_unk_token_id), ("pad_token", writer.add_pad_token_id)):
        if isinstance(config.get(key), str) and config[key] in vocab:
            add(vocab[config[key]])
    writer.add_add_bos_token(add_bos)


def write_gguf_checkpoint(path: str | Path, cfg: dict, sd: dict[str, torch.Tensor],
                          tokenizer_dir: str | Path | SentencePieceVocab,
                          qtypes: dict[str, gguf.GGMLQuantizationType] | None = None,
                          default_qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0,
                          chat_template: str | None = None, seed: int = 0, eot_token_id: int | None = None) -> Path:
    """The model of config.json dict `cfg` and state dict `sd` as one GGUF file at `path`. qtypes: the ggml type
    of each 2-D tensor whose Hugging Face name ends with a key (e.g. "mlp.down_proj.weight"), default_qtype for
    the others; the tokenizer is tokenizer_dir's tokenizer.json (a byte-level BPE) or a SentencePieceVocab;
    eot_token_id: written as
    tokenizer.ggml.eot_token_id (llama.cpp's end-of-turn token, as Llama 3 files name <|eot_id|>)."""
    path = Path(path)
    arch = _TO_GGUF_ARCH[cfg["architectures"][0]]
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    kv_heads, head_dim = cfg.get("num_key_value_heads", heads), cfg.get("head_dim") or hidden // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(path.stem)
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    tokenizer = tokenizer_dir if isinstance(tokenizer_dir, SentencePieceVocab) else Path(tokenizer_dir)
    _add_tokenizer(writer, tokenizer, add_bos=True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)
    for name, tensor in sd.items():
        values = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            values = permute(values, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            values = permute(values, kv_heads)
        qtype = gguf.GGMLQuantizationType.F32
        if values.ndim == 2:
            qtype = next((q for suffix, q in (qtypes or {}).items() if name.endswith(suffix)), default_qtype)
        data = _tensor_bytes(values, qtype, seed)
        writer.add_tensor(gguf_name(name), data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
