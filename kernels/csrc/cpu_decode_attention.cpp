// Decode attention on the CPU, in one pass over the paged KV cache: the CPU path's fused kernel.
//
// What it is: for each decode sequence s and head h (in parallel over sequences, or over (sequence, group of
// heads) when sequences are fewer than threads, on torch's intra-op threads), optionally write this step's
// K/V row into the cache, then attend q[s, h] to the sequence's context block by block through its block
// table, with an online softmax (running max and sum, the output rescaled as the max grows), so each cached
// K and V row is read once, where it lies, and nothing of the size of the context is written. Built at first
// use by kernels/cpu_decode_extension.py (torch's cpp_extension, g++, -march=native); when it cannot be
// built, kernels/cpu_decode_attention.py's sparse-op path serves. Tested against the gathering reference
// (tests/test_cpu_decode_kernel.py).
//
// Layout (kernels/paged_attention.py): cache [NB, L, 2, H, bs, D], contiguous; one head's bs positions of a
// block are bs consecutive rows of D, so a block's K for one head is one run of bs * D values.
// Legend: S decode sequences, H heads, D head dim, MB blocks per table (padded), bs block size.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Ask for one row (`bytes`, from p) towards L2, a cache line at a time.
inline void fetch_row(const char* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

// x . y over n values, and y += a * x: AVX-512 for float when the head dim is a multiple of 16 (every OPT
// shape's), plain loops otherwise. (A dot product's lanes are summed once, at the end: summing them per
// row in scalar code, and prefetching whole blocks at once, each made the first version slower than the
// sparse torch ops it replaces.)
template <typename T>
inline T dot(const T* __restrict x, const T* __restrict y, int64_t n) {
  T sum = 0;
  for (int64_t e = 0; e < n; ++e) sum += x[e] * y[e];
  return sum;
}

template <typename T>
inline void axpy(T a, const T* __restrict x, T* __restrict y, int64_t n) {
  for (int64_t e = 0; e < n; ++e) y[e] += a * x[e];
}

#ifdef __AVX512F__
template <>
inline float dot<float>(const float* __restrict x, const float* __restrict y, int64_t n) {
  if (n % 16 != 0) {
    float sum = 0;
    for (int64_t e = 0; e < n; ++e) sum += x[e] * y[e];
    return sum;
  }
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t e = 0;
  for (; e + 32 <= n; e += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + e), _mm512_loadu_ps(y + e), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + e + 16), _mm512_loadu_ps(y + e + 16), acc1);
  }
  if (e < n) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + e), _mm512_loadu_ps(y + e), acc0);
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

template <>
inline void axpy<float>(float a, const float* __restrict x, float* __restrict y, int64_t n) {
  if (n % 16 != 0) {
    for (int64_t e = 0; e < n; ++e) y[e] += a * x[e];
    return;
  }
  const __m512 av = _mm512_set1_ps(a);
  for (int64_t e = 0; e < n; e += 16)
    _mm512_storeu_ps(y + e, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + e), _mm512_loadu_ps(y + e)));
}
#endif

template <typename T>
void decode_attention_kernel(const T* q, int64_t q_stride_s, int64_t q_stride_h,  // q [S, H, D], D contiguous
                             const T* k_new, const T* v_new, int64_t kv_stride_s, int64_t kv_stride_h,
                             T* cache, T* out,  // out [S, H, D] contiguous
                             const int64_t* tables, const int64_t* lens, const int64_t* slot_blocks,
                             const int64_t* slot_offsets, int64_t S, int64_t H, int64_t D, int64_t MB, int64_t bs,
                             int64_t L, int64_t layer, T scale, bool write) {
  const int64_t head_stride = bs * D;                  // one head's positions in a block
  const int64_t v_offset = H * head_stride;            // K to V of the same (block, layer)
  const int64_t layer_stride = 2 * v_offset;           // one layer of a block
  const int64_t block_stride = L * layer_stride;       // one block
  const int64_t layer_offset = layer * layer_stride;
  // Work items are (sequence, group of heads). A block's K of every head of a layer is one contiguous run
  // (H * bs * D values), and so is its V: for each block an item reads its heads' K as one run (scores), then
  // their V as one run (weighted sum), while fetching the next block's two runs. Groups split the heads only
  // when there are too few sequences to keep every thread busy.
  const int64_t threads = at::get_num_threads();
  const int64_t groups = std::min<int64_t>(H, std::max<int64_t>(1, (4 * threads + S - 1) / S));
  const int64_t per_group = (H + groups - 1) / groups;
  at::parallel_for(0, S * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> acc(per_group * D), scores(per_group * bs), running_max(per_group), running_sum(per_group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / groups, h0 = (item % groups) * per_group, h1 = std::min(H, h0 + per_group);
      if (h0 >= h1) continue;
      const int64_t heads = h1 - h0;
      if (write) {  // this step's token: its K/V rows go to (slot block, offset), then it is attended to
        T* dst = cache + slot_blocks[s] * block_stride + layer_offset + slot_offsets[s] * D;
        for (int64_t h = h0; h < h1; ++h) {
          const T* ks = k_new + s * kv_stride_s + h * kv_stride_h;
          const T* vs = v_new + s * kv_stride_s + h * kv_stride_h;
          std::copy(ks, ks + D, dst + h * head_stride);
          std::copy(vs, vs + D, dst + h * head_stride + v_offset);
        }
      }
      const int64_t context = lens[s];
      std::fill(acc.begin(), acc.end(), T(0));
      std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<T>::infinity());
      std::fill(running_sum.begin(), running_sum.end(), T(0));
      const int64_t num_blocks = (context + bs - 1) / bs;
      for (int64_t j = 0; j < num_blocks; ++j) {
        const int64_t n = std::min(bs, context - j * bs);
        const T* k_run = cache + tables[s * MB + j] * block_stride + layer_offset + h0 * head_stride;
        const T* v_run = k_run + v_offset;
        const char* next_k = j + 1 < num_blocks
            ? reinterpret_cast<const char*>(cache + tables[s * MB + j + 1] * block_stride + layer_offset +
                                            h0 * head_stride)
            : nullptr;
        // K: the scores of every head of the group, the run read in order; each row read asks for the same row
        // of the next block (prefetch, as fast as the reads go).
        const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
        const int64_t v_bytes = v_offset * static_cast<int64_t>(sizeof(T));
        for (int64_t g = 0; g < heads; ++g) {
          const T* __restrict qi = q + s * q_stride_s + (h0 + g) * q_stride_h;
          const T* __restrict kb = k_run + g * head_stride;
          T* __restrict sc = scores.data() + g * bs;
          for (int64_t t = 0; t < n; ++t) {
            if (next_k) fetch_row(next_k + (g * head_stride + t * D) * sizeof(T), row_bytes);
            sc[t] = dot(qi, kb + t * D, D) * scale;
          }
        }
        // Softmax bookkeeping per head: the running max, the rescale of what was summed, the weights.
        for (int64_t g = 0; g < heads; ++g) {
          T* __restrict sc = scores.data() + g * bs;
          T block_max = sc[0];
          for (int64_t t = 1; t < n; ++t) block_max = std::max(block_max, sc[t]);
          const T new_max = std::max(running_max[g], block_max);
          const T correction = std::exp(running_max[g] - new_max);  // 0 on the first block (exp(-inf))
          T sum = 0;
          for (int64_t t = 0; t < n; ++t) {
            sc[t] = std::exp(sc[t] - new_max);
            sum += sc[t];
          }
          T* __restrict a = acc.data() + g * D;
#pragma omp simd
          for (int64_t e = 0; e < D; ++e) a[e] *= correction;
          running_max[g] = new_max;
          running_sum[g] = running_sum[g] * correction + sum;
        }
        // V: the weighted sums, the run read in order.
        for (int64_t g = 0; g < heads; ++g) {
          const T* __restrict vb = v_run + g * head_stride;
          const T* __restrict sc = scores.data() + g * bs;
          T* __restrict a = acc.data() + g * D;
          for (int64_t t = 0; t < n; ++t) {
            if (next_k) fetch_row(next_k + v_bytes + (g * head_stride + t * D) * sizeof(T), row_bytes);
            axpy(sc[t], vb + t * D, a, D);
          }
        }
      }
      for (int64_t g = 0; g < heads; ++g) {
        T* o = out + (s * H + h0 + g) * D;
        const T inv = context > 0 ? T(1) / running_sum[g] : T(0);
        for (int64_t e = 0; e < D; ++e) o[e] = acc[g * D + e] * inv;
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q,            // [S, H, D]
                            const at::Tensor& k,            // [S, H, D]: this step's K, written when `write`
                            const at::Tensor& v,            // [S, H, D]
                            at::Tensor kv_cache,            // [NB, L, 2, H, bs, D], contiguous
                            int64_t layer,
                            const at::Tensor& block_tables,  // [S, MB] long
                            const at::Tensor& context_lens,  // [S] long, the new token included
                            const at::Tensor& slot_blocks,   // [S] long: where this step's K/V go
                            const at::Tensor& slot_offsets,  // [S] long
                            double scale, bool write) {
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.is_contiguous() && kv_cache.dim() == 6,
              "decode_attention: a contiguous CPU cache [NB, L, 2, H, bs, D]");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 &&
                  k.stride(0) == v.stride(0) && k.stride(1) == v.stride(1),
              "decode_attention: q, k, v [S, H, D] with D contiguous, k and v of the same strides");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && k.scalar_type() == kv_cache.scalar_type() &&
                  v.scalar_type() == kv_cache.scalar_type(),
              "decode_attention: q, k, v and the cache of one dtype");
  const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
  const at::Tensor blocks = slot_blocks.contiguous(), offsets = slot_offsets.contiguous();
  for (const at::Tensor* t : {&tables, &lens, &blocks, &offsets})
    TORCH_CHECK(t->scalar_type() == at::kLong, "decode_attention: index tensors are int64");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(kv_cache.size(3) == H && kv_cache.size(5) == D && lens.numel() == S && tables.size(0) == S,
              "decode_attention: shapes disagree");
  at::Tensor out = at::empty({S, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "decode_attention", [&] {
    decode_attention_kernel<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), k.data_ptr<scalar_t>(),
                                      v.data_ptr<scalar_t>(), k.stride(0), k.stride(1),
                                      kv_cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                      tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                      blocks.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), S, H, D,
                                      tables.size(1), kv_cache.size(4), kv_cache.size(1), layer,
                                      static_cast<scalar_t>(scale), write);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(fastserve_cpu, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, int layer, Tensor block_tables, "
      "Tensor context_lens, Tensor slot_blocks, Tensor slot_offsets, float scale, bool write) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
}
