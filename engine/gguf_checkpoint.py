"""GGUFCheckpoint: a llama.cpp GGUF file read as a Hugging Face checkpoint.

What it is: one .gguf file (`--model path/to/model.gguf`) answering what a model directory answers: a
config.json dict made from the metadata (config_dict: general.architecture "llama" -> LlamaForCausalLM, "qwen2"
-> Qwen2ForCausalLM; Mistral's files say "llama"), the tokenizer's metadata (engine/gguf_tokenizer.py builds
the tokenizer), and the weights under their Hugging Face names with the CheckpointFiles interface (names(),
shape(), read(), nbytes()), each dequantized to float32 when read (engine/gguf_dequant.py), so the engine's
strict loader fills the model from it as from safetensors.

Two things llama.cpp's converter changed are undone here: tensor names (blk.N.attn_q.weight ->
model.layers.N.self_attn.q_proj.weight, ...), and, for the "llama" architecture, the order of q and k rows:
llama.cpp interleaves each head's two rotary halves (its permute), the model here rotates halves
(transformers' layout), so those rows are put back (unpermute). lm_head is tied when the file has no
output.weight. Refused with a one-line error: architectures other than those above, partial rotary
dimensions, Llama 3.1's rope_freqs frequency-factor tensor, and (engine/gguf_dequant.py) unreadable
quantization types.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from gguf import GGUFReader

from engine.errors import CheckpointError
from engine.gguf_dequant import dequantize

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# GGUF tensor names -> Hugging Face's: whole-model tensors, and a layer's (blk.N.<key>.weight|bias)
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_BLOCK = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


@functools.lru_cache(maxsize=2)
def _read(path: str, mtime_ns: int, size: int) -> GGUFReader:
    """The file's reader (parsing the metadata of a model with a 49k-token vocabulary takes ~3 s), shared by the
    config, the tokenizer and the weights of one start-up; a changed file (mtime, size) is read anew."""
    return GGUFReader(path)


def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    return path.suffix == ".gguf" and path.is_file()


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor (a name not in the tables is kept: the loader reports it)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m is None or m.group(2) not in LAYER_NAMES:
        return gguf_name
    return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's permute of q/k rows undone: per head, rows (0, D/2, 1, D/2 + 1, ...) back to (0, 1, ..., D - 1)
    (transformers' reverse_permute_weights). w: [heads x D, ...] -> the same shape."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """Context manager over one GGUF file: metadata, and the weights as CheckpointFiles serves them."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            stat = self.path.stat()
            self.reader = _read(str(self.path.resolve()), stat.st_mtime_ns, stat.st_size)
        except Exception as e:  # the gguf package raises plain errors for a bad magic, version or layout
            raise CheckpointError(f"{self.path.name} is not a readable GGUF file: {e}") from None
        self.architecture = self.field("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise CheckpointError(f"{self.path.name}: GGUF architecture {self.architecture!r} is not supported; "
                                  f"supported: {', '.join(ARCHITECTURES)}")
        self._tensors = {hf_name(t.name): t for t in self.reader.tensors}
        # q and k rows to unpermute (llama architecture only), by Hugging Face name: their head count
        self._permuted: dict[str, int] = {}
        if self.architecture == "llama":
            heads, kv_heads = self._heads()
            self._permuted = {f"model.layers.{i}.self_attn.{proj}.{kind}": n
                              for i in range(int(self.field("llama.block_count")))
                              for proj, n in (("q_proj", heads), ("k_proj", kv_heads)) for kind in ("weight", "bias")}

    def __enter__(self) -> GGUFCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def field(self, key: str, default=None):
        """The value of metadata `key` (a string, number, or list), or `default` when the file has none."""
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def _heads(self) -> tuple[int, int]:
        """(query heads, KV heads)."""
        a = self.architecture + "."
        heads = int(self.field(a + "attention.head_count"))
        kv_heads = self.field(a + "attention.head_count_kv", heads)
        if isinstance(kv_heads, list):  # per layer in some files: one value is all the model takes
            if len(set(kv_heads)) != 1:
                raise CheckpointError(f"{self.path.name}: KV head counts differ between layers ({kv_heads})")
            kv_heads = kv_heads[0]
        return heads, int(kv_heads)

    def config_dict(self) -> dict:
        """A Hugging Face config.json dict for the model in the file."""
        a = self.architecture + "."
        (heads, kv_heads), hidden = self._heads(), int(self.field(a + "embedding_length"))
        head_dim = int(self.field(a + "attention.key_length", hidden // heads))
        rotary = int(self.field(a + "rope.dimension_count", head_dim))
        if rotary != head_dim:
            raise CheckpointError(f"{self.path.name}: rotary embedding over {rotary} of {head_dim} head dims "
                                  "(partial rotary) is not supported")
        if "rope_freqs.weight" in self._tensors:
            raise CheckpointError(f"{self.path.name}: a rope_freqs tensor (Llama 3.1's rope frequency factors) is "
                                  "not supported; load the model's Hugging Face checkpoint instead")
        scaling = self.field(a + "rope.scaling.type", "none")
        tokens = self.field("tokenizer.ggml.tokens") or []
        return dict(
            architectures=[ARCHITECTURES[self.architecture]], model_type=self.architecture,
            vocab_size=int(self.field(a + "vocab_size", len(tokens))), hidden_size=hidden,
            intermediate_size=int(self.field(a + "feed_forward_length")),
            num_hidden_layers=int(self.field(a + "block_count")), num_attention_heads=heads,
            num_key_value_heads=kv_heads, head_dim=head_dim,
            max_position_embeddings=int(self.field(a + "context_length")),
            rms_norm_eps=float(self.field(a + "attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self.field(a + "rope.freq_base", 10000.0)),
            rope_scaling=None if scaling == "none" else dict(rope_type=scaling,
                                                             factor=float(self.field(a + "rope.scaling.factor", 1))),
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.field("tokenizer.ggml.eos_token_id"), torch_dtype="float32",
        )

    # -- the weights, as CheckpointFiles serves them -----------------------------------------------------------
    def names(self) -> Iterator[str]:
        return iter(list(self._tensors))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensors[name].shape))  # GGUF lists dims innermost first

    def nbytes(self) -> int:
        return self.path.stat().st_size

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The tensor in float32 (dequantized, q/k rows in transformers' order), or [start:stop) along `dim`."""
        t = self._tensors[name]
        values = dequantize(t.data, t.tensor_type, self.shape(name), t.name)
        if name in self._permuted:
            values = unpermute(values, self._permuted[name])
        return values if dim is None else values.narrow(dim, start, stop - start)
