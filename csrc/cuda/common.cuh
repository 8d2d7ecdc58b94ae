// Device helpers shared by the kvboost CUDA kernels. Every float op that the reference performs as a
// separate rounding step is spelled with an explicit _rn intrinsic (and the build passes --fmad=false), so
// nvcc cannot contract a multiply and an add into an fma and change the bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace kvboost {
namespace cuda {

template <typename T>
struct DCvt;

template <>
struct DCvt<float> {
  using storage = float;
  __device__ __forceinline__ static float load(float x) { return x; }
  __device__ __forceinline__ static float store(float x) { return x; }
};

template <>
struct DCvt<__nv_bfloat16> {
  using storage = __nv_bfloat16;
  __device__ __forceinline__ static float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ __forceinline__ static __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};

template <>
struct DCvt<__half> {
  using storage = __half;
  __device__ __forceinline__ static float load(__half x) { return __half2float(x); }
  __device__ __forceinline__ static __half store(float x) { return __float2half_rn(x); }
};

template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return DCvt<T>::load(DCvt<T>::store(x));
}

// ATen scalar type -> CUDA storage type (same bits).
template <typename T>
struct CudaType {
  using type = T;
};
template <>
struct CudaType<c10::BFloat16> {
  using type = __nv_bfloat16;
};
template <>
struct CudaType<c10::Half> {
  using type = __half;
};

constexpr int kMaxLayersPerLaunch = 64;  // layer base pointers travel in the kernel arguments (1 KiB)

}  // namespace cuda
}  // namespace kvboost
