"""OPTConfig: the fields of a Hugging Face OPT config.json the model needs,
validated once, and read_config_json, which every architecture's config reads
config.json with. What it is not: loading weights (engine/loader.py), or the
choice of architecture (engine/model/registry.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import CheckpointError

# OPT's learned positional embedding table has 2 extra rows (fairseq's padding offset).
POSITION_OFFSET = 2


def read_config_json(model_dir: str | Path) -> dict:
    """The JSON object in model_dir/config.json, or a CheckpointError that says what is missing or malformed."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json; is it a Hugging Face model directory?")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return d


@dataclass(frozen=True)
class OPTConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    ffn_dim: int
    max_position_embeddings: int
    word_embed_proj_dim: int
    do_layer_norm_before: bool = True
    remove_final_layer_norm: bool = False
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True
    activation_function: str = "relu"
    pad_token_id: int = 1
    bos_token_id: int = 2
    eos_token_id: int = 2
    tie_word_embeddings: bool = True
    torch_dtype: str | None = None
    name: str = "opt"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise CheckpointError(
                f"config.json: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.activation_function != "relu":
            raise CheckpointError(
                f"config.json: activation_function {self.activation_function!r} is not supported (OPT uses relu)"
            )

    architecture = "OPTForCausalLM"
    mlp_kind = "plain"  # fc2(relu(fc1(x))) (engine/kv_cache.py sizes its activations by the kind)

    @property
    def intermediate_size(self) -> int:
        """The MLP's width (the Llama family's name for ffn_dim)."""
        return self.ffn_dim

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        """OPT's attention has a KV head per query head."""
        return self.num_attention_heads

    def check_max_model_len(self, max_model_len: int) -> None:
        """Every context up to max_position_embeddings is served (the engine checks that bound)."""

    @property
    def has_final_layer_norm(self) -> bool:
        return self.do_layer_norm_before and not self.remove_final_layer_norm

    @property
    def has_projections(self) -> bool:
        return self.word_embed_proj_dim != self.hidden_size

    @classmethod
    def from_dict(cls, d: dict, name: str = "opt") -> OPTConfig:
        model_type = d.get("model_type")
        archs = d.get("architectures") or []
        if model_type != "opt" and not any(a.startswith("OPT") for a in archs):
            raise CheckpointError(
                f"config.json describes model_type={model_type!r} architectures={archs}; only OPT models are supported"
            )
        try:
            hidden = int(d["hidden_size"])
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=int(d["num_attention_heads"]),
                ffn_dim=int(d["ffn_dim"]),
                max_position_embeddings=int(d["max_position_embeddings"]),
                word_embed_proj_dim=int(d.get("word_embed_proj_dim") or hidden),
                do_layer_norm_before=bool(d.get("do_layer_norm_before", True)),
                remove_final_layer_norm=bool(d.get("_remove_final_layer_norm", False)),
                enable_bias=bool(d.get("enable_bias", True)),
                layer_norm_elementwise_affine=bool(d.get("layer_norm_elementwise_affine", True)),
                activation_function=str(d.get("activation_function", "relu")),
                pad_token_id=int(d.get("pad_token_id", 1)),
                bos_token_id=int(d.get("bos_token_id", 2)),
                eos_token_id=int(d.get("eos_token_id", 2)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
                torch_dtype=d.get("torch_dtype") or d.get("dtype"),
                name=name,
            )
        except KeyError as e:
            raise CheckpointError(f"config.json has no {e.args[0]!r} field") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config.json has a malformed field: {e}") from None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> OPTConfig:
        return cls.from_dict(read_config_json(model_dir), name=Path(model_dir).name)

    def num_params(self) -> int:
        """Parameter count (embeddings counted once, as tied)."""
        h, f, v, p = self.hidden_size, self.ffn_dim, self.vocab_size, self.word_embed_proj_dim
        per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
        emb = v * p + (self.max_position_embeddings + POSITION_OFFSET) * h
        proj = 2 * h * p if self.has_projections else 0
        return self.num_hidden_layers * per_layer + emb + proj + (2 * h if self.has_final_layer_norm else 0)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of a Hugging Face OPT checkpoint of this config (lm_head left out: tied), by name."""
        e, f, p, v = self.hidden_size, self.ffn_dim, self.word_embed_proj_dim, self.vocab_size
        shapes: dict[str, tuple[int, ...]] = {
            "embed_tokens.weight": (v, p),
            "embed_positions.weight": (self.max_position_embeddings + POSITION_OFFSET, e),
        }
        if self.has_projections:
            shapes["project_in.weight"] = (e, p)
            shapes["project_out.weight"] = (p, e)
        if self.has_final_layer_norm:
            shapes["final_layer_norm.weight"] = shapes["final_layer_norm.bias"] = (e,)
        for i in range(self.num_hidden_layers):
            layer = f"layers.{i}."
            linears = {"self_attn.q_proj": (e, e), "self_attn.k_proj": (e, e), "self_attn.v_proj": (e, e),
                       "self_attn.out_proj": (e, e), "fc1": (f, e), "fc2": (e, f)}
            for name, shape in linears.items():
                shapes[layer + name + ".weight"] = shape
                if self.enable_bias:
                    shapes[layer + name + ".bias"] = shape[:1]
            if self.layer_norm_elementwise_affine:
                for norm in ("self_attn_layer_norm", "final_layer_norm"):
                    shapes[layer + norm + ".weight"] = shapes[layer + norm + ".bias"] = (e,)
        return {"model.decoder." + k: s for k, s in shapes.items()}
