// KIVI-style quantization on CUDA, matching kvboost_core.quant run on a CUDA tensor. One difference from the
// CPU kernel is deliberate: torch's CUDA division of a tensor by a Python scalar multiplies by the float
// reciprocal (BinaryDivTrueKernel.cu), so the scale is (max - mn16) * (1/q) here and (max - mn16) / q on
// CPU; tensor-by-tensor division (the codes) is an IEEE division on both.
// K: one thread per (layer, head, token group, channel pair); V: one thread per (layer, head, token) row.
// Channel pairs keep int4 packing (two channels per byte) inside one thread.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>

#include "../kvboost.h"
#include "common.cuh"

namespace kvboost {
namespace cuda {
namespace {

constexpr float kFp16Max = 65504.0f;
enum ErrorBits : int { kNonFiniteK = 1, kRangeK = 2, kNonFiniteV = 4, kRangeV = 8 };

// quant.py's _round_fp16: RNE cast; if it landed on the wrong side, one fp16 step toward `up`.
__device__ __forceinline__ __half round_fp16_directed(float x, bool up) {
  __half h = __float2half_rn(x);
  const float hf = __half2float(h);
  if (up ? !(hf < x) : !(hf > x)) return h;
  unsigned short b = __half_as_ushort(h);
  if ((b & 0x7fff) == 0) {
    b = up ? 0x0001 : 0x8001;
  } else {
    const bool neg = b & 0x8000;
    b = (up != neg) ? b + 1 : b - 1;
  }
  return __ushort_as_half(b);
}

struct Group {
  __half s16, m16;
  float s, m;
};

__device__ __forceinline__ Group group_params(float lo, float hi, float inv_q) {
  Group g;
  g.m16 = round_fp16_directed(lo, false);
  g.m = __half2float(g.m16);
  g.s16 = round_fp16_directed(__fmul_rn(__fsub_rn(hi, g.m), inv_q), true);
  g.s = __half2float(g.s16);
  return g;
}

__device__ __forceinline__ uint8_t code_of(float x, const Group& g, float q) {
  if (!(g.s > 0.0f)) return 0;
  const float c = rintf(__fdiv_rn(__fsub_rn(x, g.m), g.s));  // rint: ties to even, like torch.round
  return static_cast<uint8_t>(fminf(fmaxf(c, 0.0f), q));
}

__device__ __forceinline__ int check_value(float x, int nonfinite_bit, int range_bit) {
  if (!isfinite(x)) return nonfinite_bit;
  return fabsf(x) > kFp16Max ? range_bit : 0;
}

template <typename T>
__global__ void quant_k_kernel(const T* __restrict__ k, uint8_t* codes, __half* sc, __half* mn, int* err, int LH,
                               int n, int D, int G, int ngn, int dc, int bits) {
  const int pairs = (D + 1) / 2;
  const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<long long>(LH) * ngn * pairs) return;
  const int j = idx % pairs;
  const long long item = idx / pairs;  // lh * ngn + g
  const int g = item % ngn;
  const long long lh = item / ngn;
  const int t0 = g * G, t1 = min(n, t0 + G);
  const int c0 = 2 * j, c1 = 2 * j + 1;
  const bool has1 = c1 < D;
  const T* base = k + lh * n * D;
  const float q = static_cast<float>((1 << bits) - 1), inv_q = 1.0f / q;
  float lo0 = INFINITY, hi0 = -INFINITY, lo1 = INFINITY, hi1 = -INFINITY;
  int bad = 0;
  for (int t = t0; t < t1; ++t) {
    const float x0 = DCvt<T>::load(base[static_cast<long long>(t) * D + c0]);
    bad |= check_value(x0, kNonFiniteK, kRangeK);
    lo0 = fminf(lo0, x0), hi0 = fmaxf(hi0, x0);
    if (has1) {
      const float x1 = DCvt<T>::load(base[static_cast<long long>(t) * D + c1]);
      bad |= check_value(x1, kNonFiniteK, kRangeK);
      lo1 = fminf(lo1, x1), hi1 = fmaxf(hi1, x1);
    }
  }
  if (bad) {
    atomicOr(err, bad);
    return;
  }
  const Group p0 = group_params(lo0, hi0, inv_q);
  const Group p1 = has1 ? group_params(lo1, hi1, inv_q) : p0;
  sc[item * D + c0] = p0.s16, mn[item * D + c0] = p0.m16;
  if (has1) sc[item * D + c1] = p1.s16, mn[item * D + c1] = p1.m16;
  for (int t = t0; t < t1; ++t) {
    const long long row = lh * n + t;
    const uint8_t a = code_of(DCvt<T>::load(base[static_cast<long long>(t) * D + c0]), p0, q);
    const uint8_t b = has1 ? code_of(DCvt<T>::load(base[static_cast<long long>(t) * D + c1]), p1, q) : 0;
    if (bits == 8) {
      codes[row * dc + c0] = a;
      if (has1) codes[row * dc + c1] = b;
    } else {
      codes[row * dc + j] = a | (b << 4);
    }
  }
}

template <typename T>
__global__ void quant_v_kernel(const T* __restrict__ v, uint8_t* codes, __half* sc, __half* mn, int* err,
                               long long rows, int D, int G, int ngd, int dc, int bits) {
  const long long r = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const T* x = v + r * D;
  const float q = static_cast<float>((1 << bits) - 1), inv_q = 1.0f / q;
  int bad = 0;
  for (int c = 0; c < D; ++c) bad |= check_value(DCvt<T>::load(x[c]), kNonFiniteV, kRangeV);
  if (bad) {
    atomicOr(err, bad);
    return;
  }
  for (int g = 0; g < ngd; ++g) {
    float lo = INFINITY, hi = -INFINITY;
    for (int c = g * G; c < min(D, (g + 1) * G); ++c) {
      const float xv = DCvt<T>::load(x[c]);
      lo = fminf(lo, xv), hi = fmaxf(hi, xv);
    }
    const Group p = group_params(lo, hi, inv_q);
    sc[r * ngd + g] = p.s16, mn[r * ngd + g] = p.m16;
  }
  // Codes read their group's (scale, min) back from the row this thread just wrote.
  auto code_at = [&](int c) -> uint8_t {
    if (c >= D) return 0;
    Group p;
    p.s = __half2float(sc[r * ngd + c / G]), p.m = __half2float(mn[r * ngd + c / G]);
    return code_of(DCvt<T>::load(x[c]), p, q);
  };
  if (bits == 8) {
    for (int c = 0; c < D; ++c) codes[r * dc + c] = code_at(c);
  } else {
    for (int j = 0; j < dc; ++j) codes[r * dc + j] = code_at(2 * j) | (code_at(2 * j + 1) << 4);
  }
}

template <typename F>
void dispatch_float(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(__nv_bfloat16{});
    case at::kHalf: return f(__half{});
    default: TORCH_CHECK(false, "kvboost: unsupported dtype ", st);
  }
}

}  // namespace
}  // namespace cuda

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_kv_cuda(
    const at::Tensor& k_in, const at::Tensor& v_in, int64_t bits, int64_t group_size) {
  check_quantize_args(k_in, v_in, bits, group_size);
  TORCH_CHECK_VALUE(k_in.is_cuda(), "kvboost: quantize_kv_cuda got ", k_in.device(), " tensors");
  const c10::cuda::CUDAGuard guard(k_in.device());
  const at::Tensor k = k_in.contiguous(), v = v_in.contiguous();
  const int64_t L = k.size(0), H = k.size(1), n = k.size(2), D = k.size(3), G = group_size;
  const int64_t dc = bits == 8 ? D : (D + 1) / 2, ngn = (n + G - 1) / G, ngd = (D + G - 1) / G;
  const auto u8 = k.options().dtype(at::kByte), f16 = k.options().dtype(at::kHalf);
  at::Tensor kc = at::empty({L, H, n, dc}, u8), vc = at::empty({L, H, n, dc}, u8);
  at::Tensor ks = at::empty({L, H, ngn, D}, f16), km = at::empty({L, H, ngn, D}, f16);
  at::Tensor vs = at::empty({L, H, n, ngd}, f16), vm = at::empty({L, H, n, ngd}, f16);
  at::Tensor err = at::zeros({1}, k.options().dtype(at::kInt));
  auto stream = c10::cuda::getCurrentCUDAStream();
  constexpr int kThreads = 256;
  const long long k_threads = L * H * ngn * ((D + 1) / 2), v_rows = L * H * n;
  if (k_threads > 0) {
    cuda::dispatch_float(k.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      cuda::quant_k_kernel<T><<<(k_threads + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
          reinterpret_cast<const T*>(k.data_ptr()), kc.data_ptr<uint8_t>(),
          reinterpret_cast<__half*>(ks.data_ptr<at::Half>()), reinterpret_cast<__half*>(km.data_ptr<at::Half>()),
          err.data_ptr<int>(), static_cast<int>(L * H), static_cast<int>(n), static_cast<int>(D),
          static_cast<int>(G), static_cast<int>(ngn), static_cast<int>(dc), static_cast<int>(bits));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  if (v_rows > 0) {
    cuda::dispatch_float(v.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      cuda::quant_v_kernel<T><<<(v_rows + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
          reinterpret_cast<const T*>(v.data_ptr()), vc.data_ptr<uint8_t>(),
          reinterpret_cast<__half*>(vs.data_ptr<at::Half>()), reinterpret_cast<__half*>(vm.data_ptr<at::Half>()),
          err.data_ptr<int>(), v_rows, static_cast<int>(D), static_cast<int>(G), static_cast<int>(ngd),
          static_cast<int>(dc), static_cast<int>(bits));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  // quant.py validates the inputs before quantizing; one flag word read back keeps the same contract.
  const int e = err.item<int>();
  if (e & cuda::kNonFiniteK) TORCH_CHECK_VALUE(false, "cannot quantize non-finite K/V values");
  if (e & cuda::kRangeK) TORCH_CHECK_VALUE(false, "K/V values exceed the fp16 range (65504.0) of the stored scales");
  if (e & cuda::kNonFiniteV) TORCH_CHECK_VALUE(false, "cannot quantize non-finite K/V values");
  if (e & cuda::kRangeV) TORCH_CHECK_VALUE(false, "K/V values exceed the fp16 range (65504.0) of the stored scales");
  return {kc, ks, km, vc, vs, vm};
}

}  // namespace kvboost
