// A decode step's decoder layers on the CPU, in one call: the CPU path's counterpart of a captured CUDA graph.
//
// What it is: the loop of engine/model/opt.py's OPTDecoderLayer.forward over a stage's layers, for a batch in
// which every sequence has one new token, written with the same ATen ops in the same order (linear,
// layer_norm, relu_, add_) and the decode attention of cpu_decode_attention.cpp called directly, so its output
// is the Python loop's, bit for bit (tests/test_cpu_decode_layers.py). Why: a decode step of a small model is
// mostly Python and dispatch between ops, and on a big one each small op between two matmuls starts with cold
// caches (the matmul streamed its weights through them); one C++ call per step removes the Python between them.
// What it is not: tensor parallel (no all-reduce: tp = 1 only), prefill, or any device but the CPU; the model
// decides when it applies (OPTStage.forward) and runs the Python loop otherwise.
//
// Weights: a flat list, LAYER_TENSORS per layer in the order of `Slot`; a bias or layer-norm affine that the
// config turns off is None.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

#include "cpu_decode_attention.h"

namespace {

enum Slot : int64_t {
  kAttnNormWeight, kAttnNormBias, kQkvWeight, kQkvBias, kOutWeight, kOutBias,
  kFfnNormWeight, kFfnNormBias, kFc1Weight, kFc1Bias, kFc2Weight, kFc2Bias,
  LAYER_TENSORS
};

at::Tensor decode_layers(at::Tensor hidden,  // [S, E]: the stage's input, one row per sequence
                         const c10::List<std::optional<at::Tensor>>& weights,  // LAYER_TENSORS per layer
                         int64_t num_heads, double eps, bool pre_ln, at::Tensor kv_cache,  // [NB, L, 2, H, bs, D]
                         const at::Tensor& block_tables, const at::Tensor& context_lens,
                         const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, double scale) {
  TORCH_CHECK(weights.size() % LAYER_TENSORS == 0, "decode_layers: ", LAYER_TENSORS, " weights per layer");
  TORCH_CHECK(hidden.dim() == 2, "decode_layers: hidden [S, E]");
  const int64_t layers = static_cast<int64_t>(weights.size()) / LAYER_TENSORS;
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == layers, "decode_layers: a cache of ", layers, " layers");
  const int64_t s = hidden.size(0), e = hidden.size(1);
  TORCH_CHECK(e % num_heads == 0, "decode_layers: hidden size not a multiple of the heads");
  const int64_t d = e / num_heads;
  at::Tensor h = hidden;
  for (int64_t layer = 0; layer < layers; ++layer) {
    auto w = [&](Slot slot) -> std::optional<at::Tensor> { return weights.get(layer * LAYER_TENSORS + slot); };
    auto norm = [&](const at::Tensor& x, Slot weight, Slot bias) {
      return at::layer_norm(x, {e}, w(weight), w(bias), eps);
    };
    at::Tensor residual = h;
    if (pre_ln) h = norm(h, kAttnNormWeight, kAttnNormBias);
    const std::vector<at::Tensor> qkv = at::linear(h, *w(kQkvWeight), w(kQkvBias)).view({s, 3, num_heads, d}).unbind(1);
    const at::Tensor attn = fastserve_cpu::decode_attention(qkv[0], qkv[1], qkv[2], kv_cache, layer, block_tables,
                                                            context_lens, slot_blocks, slot_offsets, scale, true);
    h = at::linear(attn.view({s, e}), *w(kOutWeight), w(kOutBias)).add_(residual);
    if (!pre_ln) h = norm(h, kAttnNormWeight, kAttnNormBias);
    residual = h;
    if (pre_ln) h = norm(h, kFfnNormWeight, kFfnNormBias);
    at::Tensor ffn = at::linear(h, *w(kFc1Weight), w(kFc1Bias));
    h = at::linear(at::relu_(ffn), *w(kFc2Weight), w(kFc2Bias)).add_(residual);
    if (!pre_ln) h = norm(h, kFfnNormWeight, kFfnNormBias);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastserve_cpu, m) {
  m.def(
      "decode_layers(Tensor hidden, Tensor?[] weights, int num_heads, float eps, bool pre_ln, Tensor(a!) kv_cache, "
      "Tensor block_tables, Tensor context_lens, Tensor slot_blocks, Tensor slot_offsets, float scale) -> Tensor");
  m.impl("decode_layers", c10::DispatchKey::CPU, TORCH_FN(decode_layers));
}
