// One decode row's attention on CUDA, the contract of csrc/cpu/decode_attn.cpp (and kernels/reference.py):
// out[h] = softmax(scale * q[h] . K[kv(h), :length]) @ V[kv(h), :length], dense (H_kv, T, D) K/V or a page pool
// (N, H_kv, P, D) read through a table of page ids (key t in page pages[t / P], slot t % P), with no gather.
//
// One block per query head (256 threads): scores for keys t = tid, tid + 256, ... into a float32 scratch row,
// the block's max and sum by a shared-memory tree, then the weighted sum of values with the threads split into
// 256 / D groups of D columns (group g sums keys g, g + G, ... in position order) and the groups summed in order.
// Every reduction has a fixed order and a row is one block, so a row's result does not depend on the other rows
// of a batch, nor on the launch. Accumulation is fp32 whatever the storage type (fp32, fp16 or bf16). Not
// bitwise the CPU kernel or SDPA: the tests (marked gpu) bound it against a float64 reference.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cfloat>

#include "../kvboost.h"
#include "common.cuh"

namespace kvboost {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// Where the KV heads' rows live: head hk's row t at base + hk * head + offset(t); dense (offset t * row) or paged
// (page pages[t / P], slot t % P).
struct Rows {
  const void* base;
  const int64_t* pages;  // page ids in position order; null for dense
  int64_t head, page, row, P;
  __device__ __forceinline__ int64_t offset(int64_t t) const {
    return pages == nullptr ? t * row : pages[t / P] * page + (t % P) * row;
  }
};

// Tree reduction (max or sum) of every thread's x over the block; every thread gets the result.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float x, float* red) {
  red[threadIdx.x] = x;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s)
      red[threadIdx.x] = kMax ? fmaxf(red[threadIdx.x], red[threadIdx.x + s])
                              : __fadd_rn(red[threadIdx.x], red[threadIdx.x + s]);
    __syncthreads();
  }
  const float r = red[0];
  __syncthreads();
  return r;
}

template <typename T>
__global__ void decode_attn_kernel(const T* __restrict__ q, Rows k, Rows v, int64_t n, int D, int group, float scale,
                                   float* __restrict__ scratch, T* __restrict__ out) {
  extern __shared__ float sh[];
  float* qs = sh;       // (D,)
  float* red = sh + D;  // (kThreads,)
  const int h = blockIdx.x, hk = h / group;
  const T* kh = static_cast<const T*>(k.base) + hk * k.head;
  const T* vh = static_cast<const T*>(v.base) + hk * v.head;
  for (int d = threadIdx.x; d < D; d += kThreads) qs[d] = DCvt<T>::load(q[static_cast<int64_t>(h) * D + d]);
  __syncthreads();
  float* s = scratch + static_cast<int64_t>(h) * n;
  float mx = -FLT_MAX;
  for (int64_t t = threadIdx.x; t < n; t += kThreads) {
    const T* kr = kh + k.offset(t);
    float acc = 0.0f;
    for (int d = 0; d < D; ++d) acc = __fadd_rn(acc, __fmul_rn(qs[d], DCvt<T>::load(kr[d])));
    acc = __fmul_rn(acc, scale);
    s[t] = acc;
    mx = fmaxf(mx, acc);
  }
  mx = block_reduce<true>(mx, red);
  float sum = 0.0f;
  for (int64_t t = threadIdx.x; t < n; t += kThreads) {
    const float e = __expf(__fsub_rn(s[t], mx));
    s[t] = e;
    sum = __fadd_rn(sum, e);
  }
  sum = block_reduce<false>(sum, red);  // its barriers also make every thread's s[t] visible to the block
  const float inv = __fdiv_rn(1.0f, sum);
  T* o = out + static_cast<int64_t>(h) * D;
  if (D <= kThreads) {
    const int G = kThreads / D;
    float part = 0.0f;
    if (threadIdx.x < G * D) {
      const int g = threadIdx.x / D, d = threadIdx.x % D;
      for (int64_t t = g; t < n; t += G)
        part = __fadd_rn(part, __fmul_rn(s[t], DCvt<T>::load(vh[v.offset(t) + d])));
    }
    red[threadIdx.x] = part;
    __syncthreads();
    if (threadIdx.x < D) {
      float total = 0.0f;
      for (int g = 0; g < G; ++g) total = __fadd_rn(total, red[g * D + threadIdx.x]);
      o[threadIdx.x] = DCvt<T>::store(__fmul_rn(total, inv));
    }
  } else {
    for (int d = threadIdx.x; d < D; d += kThreads) {
      float total = 0.0f;
      for (int64_t t = 0; t < n; ++t)
        total = __fadd_rn(total, __fmul_rn(s[t], DCvt<T>::load(vh[v.offset(t) + d])));
      o[d] = DCvt<T>::store(__fmul_rn(total, inv));
    }
  }
}

at::Tensor launch(const at::Tensor& q_in, const Rows& k, const Rows& v, const DecodeGeometry& g, int64_t n,
                  double scale) {
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous();
  at::Tensor out = at::empty({g.H, g.D}, q.options());
  at::Tensor scratch = at::empty({g.H, n}, q.options().dtype(at::kFloat));
  const size_t shared = static_cast<size_t>(g.D + kThreads) * sizeof(float);
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    decode_attn_kernel<T><<<static_cast<unsigned>(g.H), kThreads, shared, stream>>>(
        reinterpret_cast<const T*>(q.data_ptr()), k, v, n, static_cast<int>(g.D), static_cast<int>(g.H / g.Hkv),
        static_cast<float>(scale), scratch.data_ptr<float>(), reinterpret_cast<T*>(out.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  switch (q.scalar_type()) {  // the dtypes check_decode_rows admits on CUDA
    case at::kFloat: run(float{}); break;
    case at::kHalf: run(__half{}); break;
    case at::kBFloat16: run(__nv_bfloat16{}); break;
    default: TORCH_CHECK(false, "kvboost: decode attention on CUDA got ", q.scalar_type());
  }
  return out;
}

}  // namespace
}  // namespace cuda

at::Tensor decode_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t length,
                                 double scale) {
  const DecodeGeometry g = check_decode_args(q, k, v, length);
  TORCH_CHECK_VALUE(q.is_cuda(), "kvboost: decode_attention_cuda got ", q.device(), " tensors");
  const cuda::Rows kr{k.data_ptr(), nullptr, k.stride(0), 0, k.stride(1), 1};
  const cuda::Rows vr{v.data_ptr(), nullptr, v.stride(0), 0, v.stride(1), 1};
  return cuda::launch(q, kr, vr, g, length, scale);
}

at::Tensor paged_decode_attention_cuda(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                       const at::Tensor& pages, int64_t length, double scale) {
  const DecodeGeometry g = check_paged_decode_args(q, k_pool, v_pool, pages, length);
  TORCH_CHECK_VALUE(q.is_cuda(), "kvboost: paged_decode_attention_cuda got ", q.device(), " tensors");
  const at::Tensor pc = pages.contiguous();
  const int64_t P = k_pool.size(2);
  const cuda::Rows kr{k_pool.data_ptr(), pc.data_ptr<int64_t>(), k_pool.stride(1), k_pool.stride(0),
                      k_pool.stride(2), P};
  const cuda::Rows vr{v_pool.data_ptr(), pc.data_ptr<int64_t>(), v_pool.stride(1), v_pool.stride(0),
                      v_pool.stride(2), P};
  return cuda::launch(q, kr, vr, g, length, scale);
}

}  // namespace kvboost
