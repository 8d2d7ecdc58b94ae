// Fused dequantize + RoPE re-rotation + write into the per-layer KV buffers, CUDA.
// Grid: (token tiles, KV heads, layers); block: (D channels, tokens per block). Each thread produces one
// channel of one token for K and V. A rotated channel also needs its rotate_half partner (i +/- R/2): the
// thread recomputes that value from the payload (a second, cached load) instead of going through shared
// memory, which keeps the kernel free of synchronization. Numerics follow kernels/reference.py: dequant in
// fp32 (mul then add), round to the destination dtype, rotate in fp32, round again.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "../kvboost.h"
#include "common.cuh"

namespace kvboost {
namespace cuda {
namespace {

struct LayerPtrs {
  void* k[kMaxLayersPerLaunch];
  void* v[kMaxLayersPerLaunch];
};

struct Params {
  const void* k;  // dense (L, H, n, D) strided, or contiguous codes (L, H, n, Dc)
  const void* v;
  long long ks0, ks1, ks2, vs0, vs1, vs2;
  const __half* k_scale;  // (L, H, ngn, D)
  const __half* k_min;
  const __half* v_scale;  // (L, H, n, ngd)
  const __half* v_min;
  int G, ngn, ngd, dc;
  long long dkh, dkt, dvh, dvt;  // destination strides of the H and T axes (all layers alike)
  int H, n, D, R, src_start, length, dst_start;
  const float* cos;  // (length, R) or null
  const float* sin;
};

// BITS == 16: dense of type SrcT; 8 / 4: uint8 codes.
template <int BITS, typename SrcT>
__device__ __forceinline__ float load_k(const Params& p, int l, int h, int s, int c) {
  if constexpr (BITS == 16) {
    const SrcT* src = static_cast<const SrcT*>(p.k);
    return DCvt<SrcT>::load(src[l * p.ks0 + h * p.ks1 + s * p.ks2 + c]);
  } else {
    const long long row = (static_cast<long long>(l) * p.H + h) * p.n + s;
    const uint8_t* codes = static_cast<const uint8_t*>(p.k) + row * p.dc;
    const int code = BITS == 8 ? codes[c] : (codes[c >> 1] >> ((c & 1) * 4)) & 0x0f;
    const long long g = (static_cast<long long>(l) * p.H + h) * p.ngn + s / p.G;
    const float sc = __half2float(p.k_scale[g * p.D + c]);
    const float mn = __half2float(p.k_min[g * p.D + c]);
    return __fadd_rn(__fmul_rn(static_cast<float>(code), sc), mn);
  }
}

template <int BITS, typename SrcT>
__device__ __forceinline__ float load_v(const Params& p, int l, int h, int s, int c) {
  if constexpr (BITS == 16) {
    const SrcT* src = static_cast<const SrcT*>(p.v);
    return DCvt<SrcT>::load(src[l * p.vs0 + h * p.vs1 + s * p.vs2 + c]);
  } else {
    const long long row = (static_cast<long long>(l) * p.H + h) * p.n + s;
    const uint8_t* codes = static_cast<const uint8_t*>(p.v) + row * p.dc;
    const int code = BITS == 8 ? codes[c] : (codes[c >> 1] >> ((c & 1) * 4)) & 0x0f;
    const float sc = __half2float(p.v_scale[row * p.ngd + c / p.G]);
    const float mn = __half2float(p.v_min[row * p.ngd + c / p.G]);
    return __fadd_rn(__fmul_rn(static_cast<float>(code), sc), mn);
  }
}

template <int BITS, typename SrcT, typename DstT>
__global__ void place_kernel(const Params p, const LayerPtrs ptrs, const int layer0) {
  const int c = threadIdx.x;
  const int t = blockIdx.x * blockDim.y + threadIdx.y;
  const int h = blockIdx.y;
  const int li = blockIdx.z;  // index into this launch's pointers
  const int l = layer0 + li;
  if (c >= p.D || t >= p.length) return;
  const int s = p.src_start + t;
  const long long d = p.dst_start + t;

  float x = round_to<DstT>(load_k<BITS, SrcT>(p, l, h, s, c));
  if (p.cos != nullptr && c < p.R) {
    const int half = p.R / 2;
    const int partner = c < half ? c + half : c - half;
    const float y = round_to<DstT>(load_k<BITS, SrcT>(p, l, h, s, partner));
    const float a = __fmul_rn(x, p.cos[t * p.R + c]);
    const float b = __fmul_rn(y, p.sin[t * p.R + c]);
    x = c < half ? __fsub_rn(a, b) : __fadd_rn(a, b);  // rotate_half: (-y) for the first half
  }
  DstT* dk = static_cast<DstT*>(ptrs.k[li]);
  dk[h * p.dkh + d * p.dkt + c] = DCvt<DstT>::store(x);

  const float vv = load_v<BITS, SrcT>(p, l, h, s, c);
  DstT* dv = static_cast<DstT*>(ptrs.v[li]);
  dv[h * p.dvh + d * p.dvt + c] = DCvt<DstT>::store(vv);
}

template <int BITS, typename SrcT, typename DstT>
void launch(const Params& p, at::TensorList dst_k, at::TensorList dst_v, int L) {
  const int tpb = p.D >= 256 ? 1 : 256 / p.D;  // tokens per block: ~256 threads
  const dim3 block(p.D, tpb);
  auto stream = c10::cuda::getCurrentCUDAStream();
  for (int l0 = 0; l0 < L; l0 += kMaxLayersPerLaunch) {
    const int nl = std::min(kMaxLayersPerLaunch, L - l0);
    LayerPtrs ptrs{};
    for (int i = 0; i < nl; ++i) {
      ptrs.k[i] = dst_k[l0 + i].data_ptr();
      ptrs.v[i] = dst_v[l0 + i].data_ptr();
    }
    const dim3 grid((p.length + tpb - 1) / tpb, p.H, nl);
    place_kernel<BITS, SrcT, DstT><<<grid, block, 0, stream>>>(p, ptrs, l0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename DstT>
void dispatch_src(int bits, at::ScalarType src, const Params& p, at::TensorList dk, at::TensorList dv, int L) {
  if (bits == 8) return launch<8, uint8_t, DstT>(p, dk, dv, L);
  if (bits == 4) return launch<4, uint8_t, DstT>(p, dk, dv, L);
  switch (src) {
    case at::kFloat: return launch<16, float, DstT>(p, dk, dv, L);
    case at::kBFloat16: return launch<16, __nv_bfloat16, DstT>(p, dk, dv, L);
    case at::kHalf: return launch<16, __half, DstT>(p, dk, dv, L);
    default: TORCH_CHECK(false, "kvboost: unsupported source dtype ", src);
  }
}

}  // namespace
}  // namespace cuda

void dequant_rerotate_into_cuda(at::TensorList dst_k, at::TensorList dst_v, const at::Tensor& k,
                                const at::Tensor& v, const std::optional<at::Tensor>& k_scale,
                                const std::optional<at::Tensor>& k_min, const std::optional<at::Tensor>& v_scale,
                                const std::optional<at::Tensor>& v_min, int64_t bits, int64_t group_size,
                                int64_t head_dim, int64_t src_start, int64_t length, int64_t dst_start,
                                const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin) {
  const PlaceGeometry geo = check_place_args(dst_k, dst_v, k, v, k_scale, k_min, v_scale, v_min, bits, group_size,
                                             head_dim, src_start, length, dst_start, cos, sin);
  TORCH_CHECK_VALUE(k.is_cuda(), "kvboost: dequant_rerotate_into_cuda got ", k.device(), " tensors");
  if (length == 0 || geo.L == 0 || geo.H == 0) return;
  const c10::cuda::CUDAGuard guard(k.device());
  for (int64_t l = 1; l < geo.L; ++l) {
    TORCH_CHECK_VALUE(dst_k[l].strides() == dst_k[0].strides() && dst_v[l].strides() == dst_v[0].strides(),
                      "kvboost: CUDA path needs all layers' buffers to share strides");
  }
  cuda::Params p{};
  at::Tensor kc = k, vc = v, ksc, kmn, vsc, vmn, cs, sn;
  if (bits == 16) {
    if (v.scalar_type() != k.scalar_type()) vc = v.to(k.scalar_type());
  } else {
    kc = k.contiguous(), vc = v.contiguous();
    ksc = k_scale->contiguous(), kmn = k_min->contiguous(), vsc = v_scale->contiguous(), vmn = v_min->contiguous();
    p.k_scale = reinterpret_cast<const __half*>(ksc.data_ptr<at::Half>());
    p.k_min = reinterpret_cast<const __half*>(kmn.data_ptr<at::Half>());
    p.v_scale = reinterpret_cast<const __half*>(vsc.data_ptr<at::Half>());
    p.v_min = reinterpret_cast<const __half*>(vmn.data_ptr<at::Half>());
    p.G = static_cast<int>(group_size);
    p.ngn = static_cast<int>(ksc.size(2));
    p.ngd = static_cast<int>(vsc.size(3));
    p.dc = static_cast<int>(kc.size(3));
  }
  p.k = kc.data_ptr(), p.v = vc.data_ptr();
  p.ks0 = kc.stride(0), p.ks1 = kc.stride(1), p.ks2 = kc.stride(2);
  p.vs0 = vc.stride(0), p.vs1 = vc.stride(1), p.vs2 = vc.stride(2);
  p.dkh = dst_k[0].stride(1), p.dkt = dst_k[0].stride(2), p.dvh = dst_v[0].stride(1), p.dvt = dst_v[0].stride(2);
  p.H = static_cast<int>(geo.H), p.n = static_cast<int>(geo.n), p.D = static_cast<int>(geo.D);
  p.R = static_cast<int>(geo.R);
  p.src_start = static_cast<int>(src_start), p.length = static_cast<int>(length);
  p.dst_start = static_cast<int>(dst_start);
  if (geo.rotate) {
    cs = cos->contiguous(), sn = sin->contiguous();
    p.cos = cs.data_ptr<float>(), p.sin = sn.data_ptr<float>();
  }
  const int L = static_cast<int>(geo.L);
  switch (dst_k[0].scalar_type()) {
    case at::kFloat: return cuda::dispatch_src<float>(bits, kc.scalar_type(), p, dst_k, dst_v, L);
    case at::kBFloat16: return cuda::dispatch_src<__nv_bfloat16>(bits, kc.scalar_type(), p, dst_k, dst_v, L);
    case at::kHalf: return cuda::dispatch_src<__half>(bits, kc.scalar_type(), p, dst_k, dst_v, L);
    default: TORCH_CHECK(false, "kvboost: unsupported destination dtype ", dst_k[0].scalar_type());
  }
}

}  // namespace kvboost
