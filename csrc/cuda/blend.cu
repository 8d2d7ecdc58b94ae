// CacheBlend selection on CUDA, same contract as csrc/cpu/blend.cpp (and kernels/reference.py):
// dev[i] = sum_h,d float32(fresh - cached)^2 accumulated in float64; order = forced, NaN, larger dev, lower
// index; the first max(k, n_forced) tokens, as int64 positions ascending.
// deviation_kernel: one block per token, block reduction. rank_kernel: one thread per token counts the
// tokens ranked before it (O(n^2) but n is the candidate count, at most a few thousand), then nonzero()
// turns the selection mask into ascending positions.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>

#include "../kvboost.h"
#include "common.cuh"

namespace kvboost {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <typename A, typename B>
__global__ void deviation_kernel(const A* __restrict__ f, const B* __restrict__ c, double* dev, int H, int n, int D) {
  __shared__ double part[kThreads];
  const int i = blockIdx.x;
  double acc = 0.0;
  for (int e = threadIdx.x; e < H * D; e += blockDim.x) {
    const int h = e / D, d = e % D;
    const long long off = (static_cast<long long>(h) * n + i) * D + d;
    const float diff = __fsub_rn(DCvt<A>::load(f[off]), DCvt<B>::load(c[off]));
    acc += static_cast<double>(__fmul_rn(diff, diff));
  }
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) dev[i] = part[0];
}

__device__ __forceinline__ bool before(int i, int j, const double* dev, const bool* forced) {
  const bool fi = forced != nullptr && forced[i], fj = forced != nullptr && forced[j];
  if (fi != fj) return fi;
  const bool ni = isnan(dev[i]), nj = isnan(dev[j]);
  if (ni != nj) return ni;
  if (!ni && dev[i] != dev[j]) return dev[i] > dev[j];
  return i < j;
}

__global__ void rank_kernel(const double* dev, const bool* forced, bool* selected, int n, long long take) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  long long rank = 0;
  for (int j = 0; j < n; ++j) rank += before(j, i, dev, forced);
  selected[i] = rank < take;
}

}  // namespace
}  // namespace cuda

at::Tensor blend_select_cuda(const at::Tensor& fresh_in, const at::Tensor& cached_in, int64_t k,
                             const std::optional<at::Tensor>& forced_mask) {
  const int64_t n = check_blend_args(fresh_in, cached_in, k, forced_mask);
  TORCH_CHECK_VALUE(fresh_in.is_cuda(), "kvboost: blend_select_cuda got ", fresh_in.device(), " tensors");
  const c10::cuda::CUDAGuard guard(fresh_in.device());
  const at::Tensor fresh = fresh_in.contiguous(), cached = cached_in.contiguous();
  if (n == 0) return at::empty({0}, fresh.options().dtype(at::kLong));
  const int H = static_cast<int>(fresh.size(0)), D = static_cast<int>(fresh.size(2));
  at::Tensor dev = at::empty({n}, fresh.options().dtype(at::kDouble));
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto launch_dev = [&](auto ta, auto tb) {
    using A = decltype(ta);
    using B = decltype(tb);
    cuda::deviation_kernel<A, B><<<n, cuda::kThreads, 0, stream>>>(
        reinterpret_cast<const A*>(fresh.data_ptr()), reinterpret_cast<const B*>(cached.data_ptr()),
        dev.data_ptr<double>(), H, static_cast<int>(n), D);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  auto inner = [&](auto ta) {
    switch (cached.scalar_type()) {
      case at::kFloat: return launch_dev(ta, float{});
      case at::kBFloat16: return launch_dev(ta, __nv_bfloat16{});
      case at::kHalf: return launch_dev(ta, __half{});
      default: TORCH_CHECK(false, "kvboost: unsupported dtype ", cached.scalar_type());
    }
  };
  switch (fresh.scalar_type()) {
    case at::kFloat: inner(float{}); break;
    case at::kBFloat16: inner(__nv_bfloat16{}); break;
    case at::kHalf: inner(__half{}); break;
    default: TORCH_CHECK(false, "kvboost: unsupported dtype ", fresh.scalar_type());
  }
  at::Tensor fm;
  int64_t n_forced = 0;
  if (forced_mask) {
    fm = forced_mask->contiguous();
    n_forced = fm.sum().item<int64_t>();
  }
  const int64_t take = std::min(n, std::max(k, n_forced));
  at::Tensor selected = at::zeros({n}, fresh.options().dtype(at::kBool));
  cuda::rank_kernel<<<(n + cuda::kThreads - 1) / cuda::kThreads, cuda::kThreads, 0, stream>>>(
      dev.data_ptr<double>(), forced_mask ? fm.data_ptr<bool>() : nullptr, selected.data_ptr<bool>(),
      static_cast<int>(n), take);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return at::nonzero(selected).view({-1});
}

}  // namespace kvboost
