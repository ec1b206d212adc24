// A decode step's Llama-family decoder layers on the CPU, in one call: cpu_decode_layers.cpp's counterpart for
// engine/model/llama.py (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM); and the two element-wise
// kernels of those layers, RMSNorm and the rotary embedding, which the Python loop calls too on the CPU
// (engine/model/layers.py RMSNorm, engine/model/rotary.py Rotation).
//
// What it is: the loop of LlamaDecoderLayer.forward over a stage's layers, for a batch in which every sequence has
// one new token, with the same ops in the same order (RMSNorm and rotary below, the matmuls, the decode attention
// of cpu_decode_attention.cpp called directly, grouped-query heads included, SiLU-gated MLP, the residual add_s),
// so its output is the Python loop's bit for bit (tests/test_cpu_decode_llama_layers.py). A weight may be a
// oneDNN-packed tensor (fastserve_kernels/cpu_packed_linear.py): that matmul then runs through
// mkldnn::_linear_pointwise, as the Python loop's does. Why: a small model's decode step was mostly dispatch
// between small ops (seven ATen kernels for each RMSNorm, seven for each rotary); with one C++ call per step and
// one kernel for each RMSNorm and rotary, the matmuls are what is left. What it is not: tensor parallel (tp = 1 only), prefill, or any device but
// the CPU; the model decides when it applies (LlamaStage.forward) and runs the Python loop otherwise.
//
// The element-wise kernels compute Hugging Face's formulas (RMSNorm in float32, then cast back and scaled by the
// weight; x * cos + rotate_half(x) * sin) with the sum of squares in double and the products possibly fused
// (-march=native): within float32 rounding of transformers, not its bits (tests/test_llama_reference.py). In
// bfloat16 each product, sum and difference is rounded to bfloat16 (c10::BFloat16's arithmetic), as torch's
// bfloat16 ops round each op's result; the whole loop runs in the model's dtype, its attention summing in float
// (cpu_decode_attention.cpp) and its matmuls on weights packed in that dtype.
//
// Weights: a flat list, LAYER_TENSORS per layer in the order of `Slot`; a bias the config turns off is None.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
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

}  // namespace

namespace fastserve_cpu {

// RMSNorm of each row: weight * (x / sqrt(mean(x^2) + eps)), computed in float32 (Hugging Face's LlamaRMSNorm).
// x [R, E] with E contiguous, weight [E] -> [R, E] contiguous.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "rms_norm: x [R, E] on the CPU, E contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight [E] of x's dtype");
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = x.size(0), e = x.size(1), stride = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* xr = xp + r * stride;
        double sums[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // independent partial sums (vectorised), then added
        int64_t i = 0;
        for (; i + 8 <= e; i += 8)
          for (int j = 0; j < 8; ++j) {
            const double v = static_cast<float>(xr[i + j]);
            sums[j] += v * v;
          }
        for (; i < e; ++i) {
          const double v = static_cast<float>(xr[i]);
          sums[0] += v * v;
        }
        const double sum = ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]));
        const float inv = 1.0f / std::sqrt(static_cast<float>(sum / static_cast<double>(e)) + static_cast<float>(eps));
        scalar_t* o = op + r * e;
        for (int64_t k = 0; k < e; ++k) o[k] = wp[k] * static_cast<scalar_t>(static_cast<float>(xr[k]) * inv);
      }
    });
  });
  return out;
}

// The rotary embedding, rotate-half convention: x * cos + rotate_half(x) * sin, where rotate_half(x) is
// [-x[D/2:], x[:D/2]]. x [S, heads, D] with D contiguous, cos and sin [S, 1, D] -> [S, heads, D] contiguous.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary: x [S, heads, D] on the CPU, D even and contiguous");
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) == x.size(0) && cos.size(1) == 1 && cos.size(2) == x.size(2) &&
                  sin.sizes() == cos.sizes() && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "rotary: cos and sin [S, 1, D] of x's dtype");
  const at::Tensor c = cos.contiguous(), sn = sin.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t s = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rotary", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = c.data_ptr<scalar_t>();
    const scalar_t* sp = sn.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, s * heads, 64, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t row = item / heads, head = item % heads;
        const scalar_t* __restrict xi = xp + row * xs0 + head * xs1;
        const scalar_t* __restrict ci = cp + row * d;
        const scalar_t* __restrict si = sp + row * d;
        scalar_t* __restrict o = op + item * d;
        for (int64_t k = 0; k < half; ++k) o[k] = xi[k] * ci[k] - xi[k + half] * si[k];
        for (int64_t k = half; k < d; ++k) o[k] = xi[k] * ci[k] + xi[k - half] * si[k];
      }
    });
  });
  return out;
}

}  // namespace fastserve_cpu

namespace {

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
    const at::Tensor x = fastserve_cpu::rms_norm(h, *w(kInputNorm), eps);
    const std::vector<at::Tensor> qkv =
        at::split_with_sizes(matmul(x, *w(kQkvWeight), w(kQkvBias)), {q_rows, kv_rows, kv_rows}, -1);
    const at::Tensor q = fastserve_cpu::rotary(qkv[0].view({s, num_heads, d}), cos, sin);
    const at::Tensor k = fastserve_cpu::rotary(qkv[1].view({s, num_kv_heads, d}), cos, sin);
    const at::Tensor attn = fastserve_cpu::decode_attention(q, k, qkv[2].view({s, num_kv_heads, d}), kv_cache, layer,
                                                            block_tables, context_lens, slot_blocks, slot_offsets,
                                                            scale, true);
    h = matmul(attn.reshape({s, q_rows}), *w(kOWeight), w(kOBias)).add_(h);
    // MLP: down(silu(gate) * up), gate and up from one matmul.
    const at::Tensor gate_up =
        matmul(fastserve_cpu::rms_norm(h, *w(kPostNorm), eps), *w(kGateUpWeight), w(kGateUpBias));
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
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(fastserve_cpu::rms_norm));
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.impl("rotary", c10::DispatchKey::CPU, TORCH_FN(fastserve_cpu::rotary));
}
