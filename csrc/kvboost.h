// Shared declarations of the kvboost native ops. Schemas live in bindings.cpp; the numerics every kernel
// must reproduce are defined by kvboost_core/quant.py (layout, directed fp16 rounding) and
// kvboost_core/rope.py (rotate_half convention, fp32 math) -- see kvboost_core/kernels/reference.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace kvboost {

// Largest head_dim the kernels accept: per-token rows live in fixed stack buffers on CPU.
constexpr int64_t kMaxHeadDim = 1024;

// bits == 16: k/v are dense (L, H, n, D) fp32/bf16/fp16 and the scale/min tensors must be None.
// bits == 8/4: k/v are uint8 codes (L, H, n, Dc) and scale/min are the fp16 QuantPayload tensors.
void dequant_rerotate_into_cpu(at::TensorList dst_k, at::TensorList dst_v, const at::Tensor& k,
                               const at::Tensor& v, const std::optional<at::Tensor>& k_scale,
                               const std::optional<at::Tensor>& k_min, const std::optional<at::Tensor>& v_scale,
                               const std::optional<at::Tensor>& v_min, int64_t bits, int64_t group_size,
                               int64_t head_dim, int64_t src_start, int64_t length, int64_t dst_start,
                               const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_kv_cpu(
    const at::Tensor& k, const at::Tensor& v, int64_t bits, int64_t group_size);

at::Tensor blend_select_cpu(const at::Tensor& fresh, const at::Tensor& cached, int64_t k,
                            const std::optional<at::Tensor>& forced_mask);

// q (H, D), k/v (H_kv, T, D) fp32 with unit last stride -> (H, D): one decode row's attention over keys
// [0, length) (CPU and, in a CUDA build, CUDA; other devices run the torch reference).
at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t length,
                                double scale);

// The same over a page pool: q (H, D), k_pool/v_pool (N, H_kv, P, D) fp32 with unit last stride, pages (n,) int64
// page ids in position order -> (H, D), key t read from page pages[t / P], slot t % P. Bitwise the dense call on
// the gathered rows.
at::Tensor paged_decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                      const at::Tensor& pages, int64_t length, double scale);

#ifdef KVBOOST_WITH_CUDA
void dequant_rerotate_into_cuda(at::TensorList dst_k, at::TensorList dst_v, const at::Tensor& k,
                                const at::Tensor& v, const std::optional<at::Tensor>& k_scale,
                                const std::optional<at::Tensor>& k_min, const std::optional<at::Tensor>& v_scale,
                                const std::optional<at::Tensor>& v_min, int64_t bits, int64_t group_size,
                                int64_t head_dim, int64_t src_start, int64_t length, int64_t dst_start,
                                const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_kv_cuda(
    const at::Tensor& k, const at::Tensor& v, int64_t bits, int64_t group_size);

at::Tensor blend_select_cuda(const at::Tensor& fresh, const at::Tensor& cached, int64_t k,
                             const std::optional<at::Tensor>& forced_mask);

// The two decode attentions on CUDA: q/k/v fp32, fp16 or bf16 (one dtype), fp32 accumulation.
at::Tensor decode_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t length,
                                 double scale);
at::Tensor paged_decode_attention_cuda(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                       const at::Tensor& pages, int64_t length, double scale);
#endif

// Argument checks shared by the CPU and CUDA entry points (defined in cpu/checks.cpp, host code only).
struct PlaceGeometry {
  int64_t L, H, n, D, R, T;  // layers, KV heads, payload tokens, head_dim, rotary dims, dst capacity
  bool rotate;
};
PlaceGeometry check_place_args(at::TensorList dst_k, at::TensorList dst_v, const at::Tensor& k,
                               const at::Tensor& v, const std::optional<at::Tensor>& k_scale,
                               const std::optional<at::Tensor>& k_min, const std::optional<at::Tensor>& v_scale,
                               const std::optional<at::Tensor>& v_min, int64_t bits, int64_t group_size,
                               int64_t head_dim, int64_t src_start, int64_t length, int64_t dst_start,
                               const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin);
struct DecodeGeometry {
  int64_t H, Hkv, D;  // query heads, KV heads, head_dim
};
DecodeGeometry check_decode_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t length);
DecodeGeometry check_paged_decode_args(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                       const at::Tensor& pages, int64_t length);
void check_quantize_args(const at::Tensor& k, const at::Tensor& v, int64_t bits, int64_t group_size);
int64_t check_blend_args(const at::Tensor& fresh, const at::Tensor& cached, int64_t k,
                         const std::optional<at::Tensor>& forced_mask);

}  // namespace kvboost
