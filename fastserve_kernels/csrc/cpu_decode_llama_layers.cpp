// A decode step's Llama-family decoder layers on the CPU, in one call: cpu_decode_layers.cpp's counterpart for
// engine/model/llama.py (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM).
//
// What it is: the loop of LlamaDecoderLayer.forward over a stage's layers, for a batch in which every sequence has
// one new token, written with the same ATen ops in the same order (RMSNorm's float32 pow / mean / rsqrt, the
// rotate-half rotary embedding on q and k with the step's cos and sin, the decode attention of
// cpu_decode_attention.cpp called directly, grouped-query heads included, SiLU-gated MLP, the residual add_s), so
// with plain weights its output is the Python loop's bit for bit (tests/test_cpu_decode_llama_layers.py). A
// weight may instead be a oneDNN-packed tensor (fastserve_kernels/cpu_packed_linear.py): that matmul then runs
// through mkldnn::_linear_pointwise, the same products summed in oneDNN's order (faster on the CPU than the
// plain sgemm, not bit-identical to it). What it is not: tensor parallel (tp = 1 only), prefill, or any device
// but the CPU; the model decides when it applies (LlamaStage.forward) and runs the Python loop otherwise.
//
// Weights: a flat list, LAYER_TENSORS per layer in the order of `Slot`; a bias the config turns off is None.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

#include "cpu_decode_attention.h"

namespace {

enum Slot : int64_t {
  kInputNorm, kQkvWeight, kQkvBias, kOWeight, kOBias, kPostNorm, kGateUpWeight, kGateUpBias, kDownWeight,
  kDownBias, LAYER_TENSORS
};

// F.linear, or oneDNN's matmul where the weight was packed for it.
at::Tensor matmul(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  if (!weight.is_mkldnn()) return at::linear(x, weight, bias);
  static auto packed = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                           .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                             c10::string_view, c10::List<std::optional<at::Scalar>>,
                                             std::optional<c10::string_view>)>();
  return packed.call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

// engine/model/layers.py RMSNorm.forward: x / sqrt(mean(x^2) + eps) in float32, cast back, times the weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor x32 = x.to(at::kFloat);
  x32 = x32 * at::rsqrt(x32.pow(2).mean({-1}, true) + eps);
  return weight * x32.to(x.scalar_type());
}

// engine/model/rotary.py Rotation.apply: x * cos + rotate_half(x) * sin, x [S, heads, D], cos and sin [S, 1, D].
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor rotated = at::cat({x.slice(-1, half).neg(), x.slice(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

at::Tensor decode_llama_layers(at::Tensor hidden,  // [S, E]: the stage's input, one row per sequence
                               const c10::List<std::optional<at::Tensor>>& weights,  // LAYER_TENSORS per layer
                               int64_t num_heads, int64_t num_kv_heads, double eps,
                               const at::Tensor& cos, const at::Tensor& sin,  // [S, 1, D]: the step's rotation
                               at::Tensor kv_cache,                            // [NB, L, 2, Hkv, bs, D]
                               const at::Tensor& block_tables, const at::Tensor& context_lens,
                               const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, double scale) {
  TORCH_CHECK(weights.size() % LAYER_TENSORS == 0, "decode_llama_layers: ", LAYER_TENSORS, " weights per layer");
  TORCH_CHECK(hidden.dim() == 2, "decode_llama_layers: hidden [S, E]");
  const int64_t layers = static_cast<int64_t>(weights.size()) / LAYER_TENSORS;
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == layers, "decode_llama_layers: a cache of ", layers,
              " layers");
  const int64_t s = hidden.size(0), d = cos.size(-1);
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) == s && sin.sizes() == cos.sizes(),
              "decode_llama_layers: cos and sin [S, 1, D]");
  const int64_t q_rows = num_heads * d, kv_rows = num_kv_heads * d;
  at::Tensor h = hidden;
  for (int64_t layer = 0; layer < layers; ++layer) {
    auto w = [&](Slot slot) -> std::optional<at::Tensor> { return weights.get(layer * LAYER_TENSORS + slot); };
    // Attention: q, k, v from one matmul, q and k rotated, this step's K/V written, then attended to.
    const at::Tensor x = rms_norm(h, *w(kInputNorm), eps);
    const std::vector<at::Tensor> qkv =
        at::split_with_sizes(matmul(x, *w(kQkvWeight), w(kQkvBias)), {q_rows, kv_rows, kv_rows}, -1);
    const at::Tensor q = rotate(qkv[0].view({s, num_heads, d}), cos, sin);
    const at::Tensor k = rotate(qkv[1].view({s, num_kv_heads, d}), cos, sin);
    const at::Tensor attn = fastserve_cpu::decode_attention(q, k, qkv[2].view({s, num_kv_heads, d}), kv_cache, layer,
                                                            block_tables, context_lens, slot_blocks, slot_offsets,
                                                            scale, true);
    h = matmul(attn.reshape({s, q_rows}), *w(kOWeight), w(kOBias)).add_(h);
    // MLP: down(silu(gate) * up), gate and up from one matmul.
    const at::Tensor gate_up = matmul(rms_norm(h, *w(kPostNorm), eps), *w(kGateUpWeight), w(kGateUpBias));
    const std::vector<at::Tensor> parts = gate_up.split(gate_up.size(-1) / 2, -1);
    h = matmul(at::silu(parts[0]).mul_(parts[1]), *w(kDownWeight), w(kDownBias)).add_(h);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastserve_cpu, m) {
  m.def(
      "decode_llama_layers(Tensor hidden, Tensor?[] weights, int num_heads, int num_kv_heads, float eps, Tensor cos, "
      "Tensor sin, Tensor(a!) kv_cache, Tensor block_tables, Tensor context_lens, Tensor slot_blocks, "
      "Tensor slot_offsets, float scale) -> Tensor");
  m.impl("decode_llama_layers", c10::DispatchKey::CPU, TORCH_FN(decode_llama_layers));
  m.impl("decode_llama_layers", c10::DispatchKey::MkldnnCPU, TORCH_FN(decode_llama_layers));  // packed weights
}
