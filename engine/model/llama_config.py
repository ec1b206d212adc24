"""LlamaConfig: the fields of a Hugging Face config.json of the Llama family
(LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM) the model needs,
validated once, with each architecture's differences resolved here (which
projections carry a bias, whether a sliding window applies), and RopeConfig,
its rotary position embedding (rope_theta, rope_scaling).

Both spellings of the rotary settings load: `rope_theta` + `rope_scaling`, as
published checkpoints write them, and transformers 5's `rope_parameters`.
What it is not: the model (engine/model/llama.py), or the choice of
architecture (engine/model/registry.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import CheckpointError

LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")
# transformers' MistralConfig: the window when config.json names none
MISTRAL_DEFAULT_SLIDING_WINDOW = 4096


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding: the base and, for scaled types, how the frequencies are stretched
    (transformers' modeling_rope_utils: "linear" divides every frequency by factor; "llama3" divides the low ones
    by factor, keeps the high ones and interpolates between)."""

    theta: float = 10000.0
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3: the pre-training context

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise CheckpointError(f"config.json: rope_type {self.type!r} is not supported; supported: "
                                  f"{', '.join(ROPE_TYPES)}")
        if self.theta <= 0 or self.factor <= 0:
            raise CheckpointError(f"config.json: rope_theta ({self.theta}) and the rope factor ({self.factor}) "
                                  "must be positive")
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise CheckpointError(f"config.json: llama3 rope_scaling needs high_freq_factor "
                                  f"({self.high_freq_factor}) > low_freq_factor ({self.low_freq_factor})")

    @classmethod
    def from_dict(cls, d: dict) -> RopeConfig:
        """From config.json: rope_parameters (transformers 5) or rope_scaling (null: none), and rope_theta."""
        scaling = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise CheckpointError(f"config.json: rope_scaling must be an object or null, got {scaling!r}")
        if float(scaling.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))) != 1.0:
            raise CheckpointError("config.json: partial_rotary_factor other than 1 is not supported")
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        fields: dict = dict(theta=float(scaling.get("rope_theta", d.get("rope_theta", 10000.0))), type=kind)
        if kind in ("linear", "llama3"):
            if "factor" not in scaling:
                raise CheckpointError(f"config.json: rope_scaling of type {kind!r} has no 'factor'")
            fields["factor"] = float(scaling["factor"])
        if kind == "llama3":
            try:
                fields.update(low_freq_factor=float(scaling["low_freq_factor"]),
                              high_freq_factor=float(scaling["high_freq_factor"]))
            except KeyError as e:
                raise CheckpointError(f"config.json: llama3 rope_scaling has no {e.args[0]!r}") from None
            fields["original_max_position_embeddings"] = int(
                scaling.get("original_max_position_embeddings", d["max_position_embeddings"]))
        return cls(**fields)


@dataclass(frozen=True)
class LlamaConfig:
    architecture: str  # one of LLAMA_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    qkv_bias: bool = False  # q_proj, k_proj, v_proj (Qwen2: always; Llama: attention_bias)
    o_bias: bool = False  # o_proj (Llama: attention_bias)
    mlp_bias: bool = False  # gate, up and down projections (Llama: mlp_bias)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # tokens a query sees, where the architecture's config turns it on
    bos_token_id: int = 1
    eos_token_id: int | None = 2
    torch_dtype: str | None = None
    name: str = "llama"

    mlp_kind = "gated"  # down(silu(gate(x)) * up(x)) (engine/kv_cache.py sizes its activations by the kind)

    def __post_init__(self) -> None:
        if self.architecture not in LLAMA_ARCHITECTURES:
            raise CheckpointError(f"LlamaConfig is for {', '.join(LLAMA_ARCHITECTURES)}, not {self.architecture}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise CheckpointError(f"config.json: head_dim {self.head_dim} must be even (rotary embedding)")

    @property
    def ffn_dim(self) -> int:
        """The MLP's width (OPT's name, read where the shapes of either architecture are sized)."""
        return self.intermediate_size

    def check_max_model_len(self, max_model_len: int) -> None:
        """A sliding window shorter than the longest context would make attention differ from full attention,
        which is all the engine computes: refused, with the setting that makes the model load."""
        if self.sliding_window is not None and self.sliding_window < max_model_len:
            raise CheckpointError(
                f"{self.name}: {self.architecture} attends over a sliding window of {self.sliding_window} tokens, "
                f"shorter than max_model_len {max_model_len}; sliding-window attention is not supported: set "
                f"--max-model-len {self.sliding_window} or less")

    @classmethod
    def from_dict(cls, d: dict, architecture: str, name: str = "llama") -> LlamaConfig:
        try:
            heads, layers = int(d["num_attention_heads"]), int(d["num_hidden_layers"])
            if d.get("hidden_act", "silu") != "silu":
                raise CheckpointError(f"config.json: hidden_act {d['hidden_act']!r} is not supported "
                                      f"({architecture} uses silu)")
            attention_bias = bool(d.get("attention_bias", False))
            qkv_bias, o_bias, mlp_bias = attention_bias, attention_bias, bool(d.get("mlp_bias", False))
            window = None
            if architecture == "Qwen2ForCausalLM":  # q/k/v always carry a bias, o_proj never
                qkv_bias, o_bias, mlp_bias = True, False, False
                # transformers' Qwen2Config: layers from max_window_layers on slide, when use_sliding_window
                if d.get("use_sliding_window") and int(d.get("max_window_layers", layers)) < layers:
                    window = d.get("sliding_window")
            elif architecture == "MistralForCausalLM":
                qkv_bias, o_bias, mlp_bias = False, False, False
                window = d.get("sliding_window", MISTRAL_DEFAULT_SLIDING_WINDOW)
            hidden = int(d["hidden_size"])
            eos = d.get("eos_token_id")
            bos = d.get("bos_token_id")
            return cls(
                architecture=architecture,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                max_position_embeddings=int(d["max_position_embeddings"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope=RopeConfig.from_dict(d),
                qkv_bias=qkv_bias,
                o_bias=o_bias,
                mlp_bias=mlp_bias,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                sliding_window=int(window) if window is not None else None,
                bos_token_id=int(bos[0] if isinstance(bos, list) else bos) if bos is not None else 1,
                eos_token_id=int(eos[0] if isinstance(eos, list) else eos) if eos is not None else None,
                torch_dtype=d.get("torch_dtype") or d.get("dtype"),
                name=name,
            )
        except CheckpointError:
            raise
        except KeyError as e:
            raise CheckpointError(f"config.json has no {e.args[0]!r} field") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config.json has a malformed field: {e}") from None

    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        e, f, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        per_layer = e * (q + 2 * kv) + q * e + 3 * e * f + 2 * e
        per_layer += (q + 2 * kv) * self.qkv_bias + e * self.o_bias + (2 * f + e) * self.mlp_bias
        return self.num_hidden_layers * per_layer + v * e * (1 if self.tie_word_embeddings else 2) + e

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of a Hugging Face checkpoint of this config, by name (lm_head only when untied)."""
        e, f, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, e), "model.norm.weight": (e,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (v, e)
        linears = {"self_attn.q_proj": ((q, e), self.qkv_bias), "self_attn.k_proj": ((kv, e), self.qkv_bias),
                   "self_attn.v_proj": ((kv, e), self.qkv_bias), "self_attn.o_proj": ((e, q), self.o_bias),
                   "mlp.gate_proj": ((f, e), self.mlp_bias), "mlp.up_proj": ((f, e), self.mlp_bias),
                   "mlp.down_proj": ((e, f), self.mlp_bias)}
        for i in range(self.num_hidden_layers):
            layer = f"model.layers.{i}."
            for name, (shape, bias) in linears.items():
                shapes[layer + name + ".weight"] = shape
                if bias:
                    shapes[layer + name + ".bias"] = shape[:1]
            shapes[layer + "input_layernorm.weight"] = shapes[layer + "post_attention_layernorm.weight"] = (e,)
        return shapes
