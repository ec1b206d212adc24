// Decode attention on the CPU, in one pass over the paged KV cache: the CPU path's fused kernel.
//
// What it is: for each decode sequence s and head h (in parallel over sequences, or over (sequence, group of
// heads) when sequences are fewer than threads, on torch's intra-op threads), optionally write this step's
// K/V row into the cache, then attend q[s, h] to the sequence's context block by block through its block
// table, with an online softmax (running max and sum, the output rescaled as the max grows), so each cached
// K and V row is read once, where it lies, and nothing of the size of the context is written. Built at first
// use by fastserve_kernels/cpu_decode_extension.py (torch's cpp_extension, g++, -march=native); when it cannot be
// built, fastserve_kernels/cpu_decode_attention.py's sparse-op path serves. Tested against the gathering reference
// (tests/test_cpu_decode_kernel.py). Two item functions: with AVX-512, float or bfloat16 and a head dim of 16 to
// 128 (every OPT shape's) keep q, the scores of a block and the V accumulators in registers (attend_item_avx512);
// anything else runs portable loops in the same order of reads (attend_item_portable). Scores, softmax and sums
// are in at::opmath_type of the dtype (float for float and bfloat16, double for double): a bfloat16 cache's rows are
// widened to float as they are read, and each output value is rounded to bfloat16 once, at the end.
//
// Layout (fastserve_kernels/paged_attention.py): cache [NB, L, 2, Hkv, bs, D], contiguous; one head's bs positions of
// a block are bs consecutive rows of D, so a block's K for one head is one run of bs * D values.
// Legend: S decode sequences, H query heads, Hkv KV heads, G = H / Hkv query heads per KV head (grouped-query
// attention: query head h reads KV head h / G; G = 1 without it), D head dim, MB blocks per table (padded),
// bs block size.

#include "cpu_decode_attention.h"

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Ask for one row (`bytes`, from p) towards L2, a cache line at a time.
inline void fetch_row(const char* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

// The KV head of an item's local query head g, counted from the KV head of the item's first query head h0, where
// q0 = h0 % G: (h0 + g) / G - h0 / G. Without grouped-query attention (G = 1) it is g.
inline int64_t kv_rel(int64_t q0, int64_t g, int64_t group) { return (q0 + g) / group; }

// x . y over n values, and y += a * x, for the portable item function, in T's opmath type: AVX-512 for float when
// the head dim is a multiple of 16, plain loops otherwise. (A dot product's lanes are summed once, at the end:
// summing them per row in scalar code, and prefetching whole blocks at once, each made the first version slower
// than the sparse torch ops it replaces.)
template <typename T>
inline at::opmath_type<T> dot(const T* __restrict x, const T* __restrict y, int64_t n) {
  using A = at::opmath_type<T>;
  A sum = 0;
  for (int64_t e = 0; e < n; ++e) sum += static_cast<A>(x[e]) * static_cast<A>(y[e]);
  return sum;
}

template <typename T>
inline void axpy(at::opmath_type<T> a, const T* __restrict x, at::opmath_type<T>* __restrict y, int64_t n) {
  using A = at::opmath_type<T>;
  for (int64_t e = 0; e < n; ++e) y[e] += a * static_cast<A>(x[e]);
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

// Block j of a work item's context: its rows, where its K and V runs start, and where the next block's start
// (prefetched while this one is read; null on the last block).
template <typename T>
struct BlockRuns {
  int64_t n;
  const T* k;
  const T* v;
  const char* next_k;
  const char* next_v;
  BlockRuns(const T* cache, const int64_t* table, int64_t j, int64_t num_blocks, int64_t context, int64_t bs,
            int64_t block_stride, int64_t item_offset, int64_t v_offset)
      : n(std::min(bs, context - j * bs)),
        k(cache + table[j] * block_stride + item_offset),
        v(k + v_offset),
        next_k(j + 1 < num_blocks ? reinterpret_cast<const char*>(cache + table[j + 1] * block_stride + item_offset)
                                  : nullptr),
        next_v(next_k ? next_k + v_offset * static_cast<int64_t>(sizeof(T)) : nullptr) {}
};

#ifdef __AVX512F__
// e^x for 16 floats: 2^n * e^r with n = round(x / ln 2) and e^r by Cephes' expf polynomial (about 1 ulp); inputs
// below -87.3 (e^x under float's smallest normal) give ~1e-38, not 0: callers mask lanes that must be 0.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n ln 2, ln 2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// 16 values of a row as floats, and 16 floats stored as the row's dtype: bfloat16 is float's upper half, so widening
// is a shift, and narrowing rounds to nearest even, NaN to 0x7FC0 (c10::BFloat16's rounding, bit for bit).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// One work item (sequence s, query heads [h0, h0 + heads)) for C = float or bfloat16 with D = 16 * NV (every sum in
// float): the item's output rows from
// its context, block by block. Per block: every head's scores from the K run (q . k, q scaled once; a row's
// product summed in one register), then per head the online-softmax update on whole registers of scores
// (16 at a time, vectorised exp) and the V rows summed into NV accumulator registers, so nothing but the
// cache is read or written per position. scores holds heads * padded_bs floats, acc heads * D, q_scaled D.
// item_offset is the KV head of query head h0; local head g reads the KV head kv_rel(q0, g, G) heads after it.
template <int NV, typename C>
void attend_item_avx512(const C* q, int64_t q_stride_h, const C* cache, const int64_t* table, int64_t context,
                        int64_t heads, int64_t q0, int64_t group, int64_t bs, int64_t padded_bs, int64_t head_stride,
                        int64_t v_offset, int64_t block_stride, int64_t item_offset, float scale, C* out,
                        float* scores, float* acc, float* running_max, float* running_sum, float* q_scaled) {
  constexpr int64_t D = 16 * NV;
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < heads; ++g) {
    for (int i = 0; i < NV; ++i)
      _mm512_storeu_ps(q_scaled + g * D + 16 * i, _mm512_mul_ps(load16(q + g * q_stride_h + 16 * i), sv));
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + g * D + 16 * i, _mm512_setzero_ps());
    running_max[g] = -std::numeric_limits<float>::infinity();
    running_sum[g] = 0.0f;
  }
  const int64_t num_blocks = (context + bs - 1) / bs;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(C));
  for (int64_t j = 0; j < num_blocks; ++j) {
    const BlockRuns<C> b(cache, table, j, num_blocks, context, bs, block_stride, item_offset, v_offset);
    const int64_t n = b.n;
    for (int64_t g = 0; g < heads; ++g) {  // K: the run in order
      __m512 qv[NV];
      for (int i = 0; i < NV; ++i) qv[i] = _mm512_loadu_ps(q_scaled + g * D + 16 * i);
      const int64_t kv = kv_rel(q0, g, group) * head_stride;
      const C* __restrict kb = b.k + kv;
      float* __restrict sc = scores + g * padded_bs;
      for (int64_t t = 0; t < n; ++t) {
        if (b.next_k) fetch_row(b.next_k + (kv + t * D) * sizeof(C), row_bytes);
        __m512 p = _mm512_mul_ps(qv[0], load16(kb + t * D));
        for (int i = 1; i < NV; ++i) p = _mm512_fmadd_ps(qv[i], load16(kb + t * D + 16 * i), p);
        sc[t] = _mm512_reduce_add_ps(p);
      }
    }
    for (int64_t g = 0; g < heads; ++g) {  // softmax update and V: the run in order
      float* __restrict sc = scores + g * padded_bs;
      __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t c = 0; c < n; c += 16)
        vmax = _mm512_mask_max_ps(vmax, first_lanes(n - c), vmax, _mm512_loadu_ps(sc + c));
      const float new_max = std::max(running_max[g], _mm512_reduce_max_ps(vmax));
      const float correction = std::exp(running_max[g] - new_max);  // 0 on the first block (exp(-inf))
      const __m512 mv = _mm512_set1_ps(new_max);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = 0; c < n; c += 16) {
        const __mmask16 m = first_lanes(n - c);
        const __m512 w = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + c), mv)));
        _mm512_mask_storeu_ps(sc + c, m, w);
        sum = _mm512_add_ps(sum, w);
      }
      running_sum[g] = running_sum[g] * correction + _mm512_reduce_add_ps(sum);
      running_max[g] = new_max;
      __m512 a[NV];
      const __m512 cv = _mm512_set1_ps(correction);
      for (int i = 0; i < NV; ++i) a[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * i), cv);
      const int64_t kv = kv_rel(q0, g, group) * head_stride;
      const C* __restrict vb = b.v + kv;
      for (int64_t t = 0; t < n; ++t) {
        if (b.next_v) fetch_row(b.next_v + (kv + t * D) * sizeof(C), row_bytes);
        const __m512 w = _mm512_set1_ps(sc[t]);
        for (int i = 0; i < NV; ++i) a[i] = _mm512_fmadd_ps(w, load16(vb + t * D + 16 * i), a[i]);
      }
      for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + g * D + 16 * i, a[i]);
    }
  }
  for (int64_t g = 0; g < heads; ++g) {
    const __m512 inv = _mm512_set1_ps(context > 0 ? 1.0f / running_sum[g] : 0.0f);
    for (int i = 0; i < NV; ++i)
      store16(out + g * D + 16 * i, _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * i), inv));
  }
}

// The AVX-512 item function for this dtype (float or bfloat16) and head dim, or nullptr (the portable loops serve).
template <typename C>
using AvxItemFn = void (*)(const C*, int64_t, const C*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t, int64_t, int64_t, float, C*, float*, float*, float*, float*,
                           float*);
template <typename C>
inline AvxItemFn<C> avx512_item_for(int64_t D) {
  switch (D) {
    case 16: return attend_item_avx512<1, C>;
    case 32: return attend_item_avx512<2, C>;
    case 48: return attend_item_avx512<3, C>;
    case 64: return attend_item_avx512<4, C>;
    case 80: return attend_item_avx512<5, C>;
    case 96: return attend_item_avx512<6, C>;
    case 112: return attend_item_avx512<7, C>;
    case 128: return attend_item_avx512<8, C>;
    default: return nullptr;
  }
}
#endif

template <typename T>
constexpr bool kHasAvxItem = std::is_same<T, float>::value || std::is_same<T, c10::BFloat16>::value;

// One work item with plain loops (any dtype, any head dim; sums in A, T's opmath type): the same order of reads as
// the AVX-512 one.
template <typename T, typename A = at::opmath_type<T>>
void attend_item_portable(const T* q, int64_t q_stride_h, const T* cache, const int64_t* table, int64_t context,
                          int64_t heads, int64_t q0, int64_t group, int64_t D, int64_t bs, int64_t head_stride,
                          int64_t v_offset, int64_t block_stride, int64_t item_offset, A scale, T* out, A* scores,
                          A* acc, A* running_max, A* running_sum) {
  std::fill(acc, acc + heads * D, A(0));
  std::fill(running_max, running_max + heads, -std::numeric_limits<A>::infinity());
  std::fill(running_sum, running_sum + heads, A(0));
  const int64_t num_blocks = (context + bs - 1) / bs;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < num_blocks; ++j) {
    const BlockRuns<T> b(cache, table, j, num_blocks, context, bs, block_stride, item_offset, v_offset);
    const int64_t n = b.n;
    for (int64_t g = 0; g < heads; ++g) {  // K: the scores, the run read in order
      const T* __restrict qi = q + g * q_stride_h;
      const int64_t kv = kv_rel(q0, g, group) * head_stride;
      const T* __restrict kb = b.k + kv;
      A* __restrict sc = scores + g * bs;
      for (int64_t t = 0; t < n; ++t) {
        if (b.next_k) fetch_row(b.next_k + (kv + t * D) * sizeof(T), row_bytes);
        sc[t] = dot(qi, kb + t * D, D) * scale;
      }
    }
    for (int64_t g = 0; g < heads; ++g) {  // softmax bookkeeping per head: running max, rescale, weights
      A* __restrict sc = scores + g * bs;
      A block_max = sc[0];
      for (int64_t t = 1; t < n; ++t) block_max = std::max(block_max, sc[t]);
      const A new_max = std::max(running_max[g], block_max);
      const A correction = std::exp(running_max[g] - new_max);  // 0 on the first block (exp(-inf))
      A sum = 0;
      for (int64_t t = 0; t < n; ++t) {
        sc[t] = std::exp(sc[t] - new_max);
        sum += sc[t];
      }
      A* __restrict a = acc + g * D;
      for (int64_t e = 0; e < D; ++e) a[e] *= correction;
      running_max[g] = new_max;
      running_sum[g] = running_sum[g] * correction + sum;
    }
    for (int64_t g = 0; g < heads; ++g) {  // V: the weighted sums, the run read in order
      const int64_t kv = kv_rel(q0, g, group) * head_stride;
      const T* __restrict vb = b.v + kv;
      const A* __restrict sc = scores + g * bs;
      A* __restrict a = acc + g * D;
      for (int64_t t = 0; t < n; ++t) {
        if (b.next_v) fetch_row(b.next_v + (kv + t * D) * sizeof(T), row_bytes);
        axpy(sc[t], vb + t * D, a, D);
      }
    }
  }
  for (int64_t g = 0; g < heads; ++g) {
    const A inv = context > 0 ? A(1) / running_sum[g] : A(0);
    for (int64_t e = 0; e < D; ++e) out[g * D + e] = static_cast<T>(acc[g * D + e] * inv);
  }
}

template <typename T>
void decode_attention_kernel(const T* q, int64_t q_stride_s, int64_t q_stride_h,  // q [S, H, D], D contiguous
                             const T* k_new, int64_t k_stride_s, int64_t k_stride_h,  // k, v [S, Hkv, D]
                             const T* v_new, int64_t v_stride_s, int64_t v_stride_h,
                             T* cache, T* out,  // out [S, H, D] contiguous
                             const int64_t* tables, const int64_t* lens, const int64_t* slot_blocks,
                             const int64_t* slot_offsets, int64_t S, int64_t H, int64_t Hkv, int64_t D, int64_t MB,
                             int64_t bs, int64_t L, int64_t layer, double scale, bool write) {
  using A = at::opmath_type<T>;  // what scores and sums are in
  const int64_t group = H / Hkv;                       // query heads per KV head
  const int64_t head_stride = bs * D;                  // one head's positions in a block
  const int64_t v_offset = Hkv * head_stride;          // K to V of the same (block, layer)
  const int64_t layer_stride = 2 * v_offset;           // one layer of a block
  const int64_t block_stride = L * layer_stride;       // one block
  const int64_t layer_offset = layer * layer_stride;
  // Work items are (sequence, group of query heads). A block's K of every head of a layer is one contiguous run
  // (Hkv * bs * D values), and so is its V: for each block an item reads its heads' K as one run (scores), then
  // their V as one run (weighted sum), while fetching the next block's two runs. Groups split the heads only
  // when there are too few sequences to keep every thread busy.
  const int64_t threads = at::get_num_threads();
  const int64_t groups = std::min<int64_t>(H, std::max<int64_t>(1, (4 * threads + S - 1) / S));
  const int64_t per_group = (H + groups - 1) / groups;
  const int64_t padded_bs = (bs + 15) / 16 * 16;  // whole registers of scores (the AVX-512 path)
#ifdef __AVX512F__
  AvxItemFn<T> avx_item = nullptr;
  if constexpr (kHasAvxItem<T>) avx_item = avx512_item_for<T>(D);
#endif
  // This step's token: its K/V rows (KV heads [k0, k1)) go to (slot block, offset), then it is attended to.
  auto write_rows = [&](int64_t s, int64_t k0, int64_t k1) {
    T* dst = cache + slot_blocks[s] * block_stride + layer_offset + slot_offsets[s] * D;
    for (int64_t h = k0; h < k1; ++h) {
      const T* ks = k_new + s * k_stride_s + h * k_stride_h;
      const T* vs = v_new + s * v_stride_s + h * v_stride_h;
      std::copy(ks, ks + D, dst + h * head_stride);
      std::copy(vs, vs + D, dst + h * head_stride + v_offset);
    }
  };
  // Query heads of several items share a KV head under grouped-query attention: every row is written before
  // any item reads. Without it each item writes its own heads' rows first.
  if (write && group > 1) {
    at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) write_rows(s, 0, Hkv);
    });
  }
  at::parallel_for(0, S * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> acc(per_group * D), scores(per_group * padded_bs), running_max(per_group),
        running_sum(per_group), q_scaled(per_group * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / groups, h0 = (item % groups) * per_group, h1 = std::min(H, h0 + per_group);
      if (h0 >= h1) continue;
      if (write && group == 1) write_rows(s, h0, h1);
      const T* qs = q + s * q_stride_s + h0 * q_stride_h;
      const int64_t* table = tables + s * MB;
      const int64_t q0 = h0 % group;
      const int64_t item_offset = layer_offset + (h0 / group) * head_stride;
      T* o = out + (s * H + h0) * D;
#ifdef __AVX512F__
      if constexpr (kHasAvxItem<T>) {
        if (avx_item != nullptr) {
          avx_item(qs, q_stride_h, cache, table, lens[s], h1 - h0, q0, group, bs, padded_bs, head_stride, v_offset,
                   block_stride, item_offset, static_cast<float>(scale), o, scores.data(), acc.data(),
                   running_max.data(), running_sum.data(), q_scaled.data());
          continue;
        }
      }
#endif
      attend_item_portable<T>(qs, q_stride_h, cache, table, lens[s], h1 - h0, q0, group, D, bs, head_stride,
                              v_offset, block_stride, item_offset, static_cast<A>(scale), o, scores.data(),
                              acc.data(), running_max.data(), running_sum.data());
    }
  });
}

}  // namespace

namespace fastserve_cpu {

// Parameters: see cpu_decode_attention.h.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor kv_cache,
                            int64_t layer, const at::Tensor& block_tables, const at::Tensor& context_lens,
                            const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, double scale, bool write) {
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.is_contiguous() && kv_cache.dim() == 6,
              "decode_attention: a contiguous CPU cache [NB, L, 2, H, bs, D]");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 &&
                  v.stride(2) == 1,
              "decode_attention: q, k, v [S, H, D] with D contiguous");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && k.scalar_type() == kv_cache.scalar_type() &&
                  v.scalar_type() == kv_cache.scalar_type(),
              "decode_attention: q, k, v and the cache of one dtype");
  const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
  const at::Tensor blocks = slot_blocks.contiguous(), offsets = slot_offsets.contiguous();
  for (const at::Tensor* t : {&tables, &lens, &blocks, &offsets})
    TORCH_CHECK(t->scalar_type() == at::kLong, "decode_attention: index tensors are int64");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0 && kv_cache.size(5) == D && lens.numel() == S && tables.size(0) == S,
              "decode_attention: shapes disagree");
  TORCH_CHECK(!write || (k.size(0) == S && k.size(1) == Hkv && v.size(0) == S && v.size(1) == Hkv),
              "decode_attention: k and v [S, Hkv, D], Hkv the cache's heads");
  at::Tensor out = at::empty({S, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "decode_attention", [&] {
    decode_attention_kernel<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), k.data_ptr<scalar_t>(),
                                      k.stride(0), k.stride(1), v.data_ptr<scalar_t>(), v.stride(0), v.stride(1),
                                      kv_cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                      tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                      blocks.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), S, H, Hkv, D,
                                      tables.size(1), kv_cache.size(4), kv_cache.size(1), layer,
                                      scale, write);
  });
  return out;
}

}  // namespace fastserve_cpu

TORCH_LIBRARY(fastserve_cpu, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, int layer, Tensor block_tables, "
      "Tensor context_lens, Tensor slot_blocks, Tensor slot_offsets, float scale, bool write) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(fastserve_cpu::decode_attention));
}
