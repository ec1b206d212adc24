// Decode attention over the paged KV cache on the CPU (cpu_decode_attention.cpp), for the other C++ of the
// extension (cpu_decode_layers.cpp calls it without going through the dispatcher).
#pragma once

#include <ATen/ATen.h>

namespace fastserve_cpu {

at::Tensor decode_attention(const at::Tensor& q,            // [S, H, D]
                            const at::Tensor& k,            // [S, Hkv, D]: this step's K, written when `write`
                            const at::Tensor& v,            // [S, Hkv, D]
                            at::Tensor kv_cache,            // [NB, L, 2, Hkv, bs, D], contiguous; H % Hkv == 0
                            int64_t layer,
                            const at::Tensor& block_tables,  // [S, MB] long
                            const at::Tensor& context_lens,  // [S] long, the new token included
                            const at::Tensor& slot_blocks,   // [S] long: where this step's K/V go
                            const at::Tensor& slot_offsets,  // [S] long
                            double scale, bool write);

}  // namespace fastserve_cpu
