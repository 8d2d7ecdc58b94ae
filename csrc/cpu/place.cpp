// Fused "load -> dequantize -> re-rotate RoPE keys -> write into the per-layer KV buffers" on CPU.
//
// Reproduces kvboost_core.assembly.place()'s inner loop bit for bit (see kernels/reference.py):
//   x     = to_dense(dtype)      : fp32 dequant (code * scale + min, no fma) or the dense value, rounded to
//                                  the destination dtype
//   k_out = rerotate(x, cos, sin): fp32 x*cos -/+ partner*sin (two products then one add), rounded again
// One pass per (layer, head, token block), no temporaries beyond a head_dim-sized stack row. The build uses
// -ffp-contract=off so the compiler never fuses those products and adds into fmas (that would change bits).
#include <ATen/Parallel.h>

#include <type_traits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "../kvboost.h"
#include "convert.h"
#include "simd_avx2.h"

namespace kvboost {
namespace {

enum class Src { kDenseF32, kDenseBF16, kDenseF16, kInt8, kInt4 };

template <Src S>
struct SrcType {
  using type = uint8_t;
};
template <>
struct SrcType<Src::kDenseF32> {
  using type = float;
};
template <>
struct SrcType<Src::kDenseBF16> {
  using type = c10::BFloat16;
};
template <>
struct SrcType<Src::kDenseF16> {
  using type = c10::Half;
};

constexpr int64_t kTokenBlock = 64;  // tokens per parallel task: enough work per task, good load balance

struct Args {
  // source: dense (L, H, n, D) any strides with unit last stride, or contiguous codes (L, H, n, Dc)
  const void* k;
  const void* v;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  // quantized only: contiguous fp16 (L, H, ceil(n/G), D) for K and (L, H, n, ceil(D/G)) for V
  const c10::Half* k_scale;
  const c10::Half* k_min;
  const c10::Half* v_scale;
  const c10::Half* v_min;
  int64_t G, ngn, ngd;
  // destination: per-layer base pointers, strides of the H and T axes (elements)
  void* const* dk;
  void* const* dv;
  const int64_t* dks;  // (L, 2): head stride, token stride
  const int64_t* dvs;
  int64_t L, H, n, D, R, src_start, length, dst_start;
  const float* cos;  // (length, R) contiguous, or null
  const float* sin;
};

// Dense rows: x[c] = float(src[c]).
template <typename T>
static inline void load_dense(const T* p, float* x, int64_t D) {
  for (int64_t c = 0; c < D; ++c) x[c] = Cvt<T>::load(p[c]);
}

// int4 codes (ceil(D/2) bytes, even channel in the low nibble) -> D uint8 codes.
static inline void unpack_int4(const uint8_t* codes, uint8_t* u, int64_t D) {
  const int64_t nbytes = (D + 1) / 2;
  for (int64_t j = 0; j < nbytes; ++j) {
    u[2 * j] = codes[j] & 0x0f;
    u[2 * j + 1] = codes[j] >> 4;
  }
}

// K row of token s: per-channel scale/min rows (already converted to fp32) of s's token group.
template <int BITS>
static inline void load_k_quant(const uint8_t* codes, const float* sc, const float* mn, float* x, int64_t D) {
  if constexpr (BITS == 8) {
    for (int64_t c = 0; c < D; ++c) x[c] = static_cast<float>(codes[c]) * sc[c] + mn[c];
  } else {
    // Unpack the nibbles first (one byte -> two codes) so the dequant loop below is a plain vector loop.
    alignas(64) uint8_t u[kMaxHeadDim + 1];
    unpack_int4(codes, u, D);
    for (int64_t c = 0; c < D; ++c) x[c] = static_cast<float>(u[c]) * sc[c] + mn[c];
  }
}

// V row of token s: one (scale, min) per group of G channels.
template <int BITS>
static inline void load_v_quant(const uint8_t* codes, const c10::Half* sc, const c10::Half* mn, float* x, int64_t D,
                                int64_t G, int64_t ngd) {
  alignas(64) uint8_t u[kMaxHeadDim + 1];
  if constexpr (BITS == 4) unpack_int4(codes, u, D);
  for (int64_t g = 0; g < ngd; ++g) {
    const float s = static_cast<float>(sc[g]), m = static_cast<float>(mn[g]);
    const int64_t c0 = g * G, c1 = std::min(D, c0 + G);
    if constexpr (BITS == 8) {
      for (int64_t c = c0; c < c1; ++c) x[c] = static_cast<float>(codes[c]) * s + m;
    } else {
      for (int64_t c = c0; c < c1; ++c) x[c] = static_cast<float>(u[c]) * s + m;
    }
  }
}

// Store a row of n floats as Dst. bf16 gets an AVX2 path: the RNE bit recipe of Cvt<BFloat16> on 8 lanes
// (the compiler's own vectorization of the scalar recipe packs poorly and made bf16 rows compute-bound).
template <typename Dst>
static inline void store_row(const float* x, Dst* out, int64_t n) {
  int64_t c = 0;
#ifdef __AVX2__
  if constexpr (std::is_same_v<Dst, c10::BFloat16>) {
    const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1), qnan = _mm256_set1_epi32(0x7fc0);
    for (; c + 8 <= n; c += 8) {
      const __m256 v = _mm256_loadu_ps(x + c);
      const __m256i u = _mm256_castps_si256(v);
      __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
      r = _mm256_srli_epi32(r, 16);
      r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c), _mm256_castsi256_si128(packed));
    }
  }
#endif
  for (; c < n; ++c) out[c] = Cvt<Dst>::store(x[c]);
}

// Keys: round the loaded row to the destination dtype (to_dense), rotate the first R channels (rotate_half
// pairing: channel i with i + R/2) in fp32, round again and store. Without rotation, and for channels past
// R, store(round_to(x)) == store(x), so the first rounding is skipped there.
template <typename Dst>
static inline void emit_row(float* x, Dst* out, int64_t D, int64_t R, const float* cs, const float* sn) {
  if (cs == nullptr) return store_row<Dst>(x, out, D);
  alignas(64) float y[kMaxHeadDim];
  for (int64_t c = 0; c < R; ++c) x[c] = round_to<Dst>(x[c]);
  const int64_t half = R / 2;
  for (int64_t i = 0; i < half; ++i) {
    // rotate_half gives -x[i + half]; x*cos + (-y)*sin == x*cos - y*sin exactly.
    const float a = x[i] * cs[i];
    const float b = x[i + half] * sn[i];
    y[i] = a - b;
  }
  for (int64_t i = half; i < R; ++i) {
    const float a = x[i] * cs[i];
    const float b = x[i - half] * sn[i];
    y[i] = a + b;
  }
  for (int64_t c = R; c < D; ++c) y[c] = x[c];
  store_row<Dst>(y, out, D);
}

template <Src S, typename Dst>
static void run(const Args& a) {
  using T = typename SrcType<S>::type;
  constexpr bool kQuant = S == Src::kInt8 || S == Src::kInt4;
  const int64_t nb = (a.length + kTokenBlock - 1) / kTokenBlock;
  const int64_t dc = S == Src::kInt4 ? (a.D + 1) / 2 : a.D;
  // The AVX2 row path needs whole 8-lane blocks: head_dim, the rotary half and V's channel groups.
  constexpr bool kVecDst = !std::is_same_v<Dst, c10::Half>;
  const bool vec = kVecDst && a.D % 8 == 0 && (a.cos == nullptr || a.R % 16 == 0) && (!kQuant || a.G % 8 == 0);
  (void)vec;
  at::parallel_for(0, a.L * a.H * nb, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float x[kMaxHeadDim];
    alignas(64) float ksc[kMaxHeadDim];
    alignas(64) float kmn[kMaxHeadDim];
    for (int64_t item = begin; item < end; ++item) {
      // token-block major: one thread walks every (layer, head) of a block while its cos/sin rows stay in L1/L2
      const int64_t blk = item / (a.L * a.H), l = (item / a.H) % a.L, h = item % a.H;
      const int64_t t0 = blk * kTokenBlock, t1 = std::min(a.length, t0 + kTokenBlock);
      Dst* dk = static_cast<Dst*>(a.dk[l]) + h * a.dks[2 * l];
      Dst* dv = static_cast<Dst*>(a.dv[l]) + h * a.dvs[2 * l];
      const int64_t dkt = a.dks[2 * l + 1], dvt = a.dvs[2 * l + 1];
      int64_t cur_group = -1;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t s = a.src_start + t, d = a.dst_start + t;
        const float* cs = a.cos ? a.cos + t * a.R : nullptr;
        const float* sn = a.sin ? a.sin + t * a.R : nullptr;
        if constexpr (kQuant) {
          constexpr int kBits = S == Src::kInt8 ? 8 : 4;
          const int64_t row = (l * a.H + h) * a.n + s;  // codes are contiguous (L, H, n, Dc)
          const int64_t g = s / a.G;
          if (g != cur_group) {  // K scale/min change every G tokens: convert that row once
            const int64_t off = ((l * a.H + h) * a.ngn + g) * a.D;
            for (int64_t c = 0; c < a.D; ++c) {
              ksc[c] = static_cast<float>(a.k_scale[off + c]);
              kmn[c] = static_cast<float>(a.k_min[off + c]);
            }
            cur_group = g;
          }
          const uint8_t* kcode = static_cast<const uint8_t*>(a.k) + row * dc;
          const uint8_t* vcode = static_cast<const uint8_t*>(a.v) + row * dc;
#ifdef __AVX2__
          if constexpr (kVecDst) {
            if (vec) {
              avx2::place_k_quant<kBits, Dst>(kcode, ksc, kmn, dk + d * dkt, a.D, a.R, cs, sn);
              avx2::place_v_quant<kBits, Dst>(vcode, a.v_scale + row * a.ngd, a.v_min + row * a.ngd, dv + d * dvt,
                                              a.D, a.G, a.ngd);
              continue;
            }
          }
#endif
          load_k_quant<kBits>(kcode, ksc, kmn, x, a.D);
          emit_row<Dst>(x, dk + d * dkt, a.D, a.R, cs, sn);
          load_v_quant<kBits>(vcode, a.v_scale + row * a.ngd, a.v_min + row * a.ngd, x, a.D, a.G, a.ngd);
          emit_row<Dst>(x, dv + d * dvt, a.D, a.R, nullptr, nullptr);
        } else {
          const T* kp = static_cast<const T*>(a.k) + l * a.ks0 + h * a.ks1 + s * a.ks2;
          const T* vp = static_cast<const T*>(a.v) + l * a.vs0 + h * a.vs1 + s * a.vs2;
#ifdef __AVX2__
          if constexpr (kVecDst) {
            if (vec) {
              avx2::place_dense<T, Dst>(kp, dk + d * dkt, a.D, a.R, cs, sn);
              avx2::place_dense<T, Dst>(vp, dv + d * dvt, a.D, a.R, nullptr, nullptr);
              continue;
            }
          }
#endif
          load_dense<T>(kp, x, a.D);
          emit_row<Dst>(x, dk + d * dkt, a.D, a.R, cs, sn);
          load_dense<T>(vp, x, a.D);
          emit_row<Dst>(x, dv + d * dvt, a.D, a.R, nullptr, nullptr);
        }
      }
    }
  });
}

template <typename Dst>
static void run_dst(Src s, const Args& a) {
  switch (s) {
    case Src::kDenseF32: return run<Src::kDenseF32, Dst>(a);
    case Src::kDenseBF16: return run<Src::kDenseBF16, Dst>(a);
    case Src::kDenseF16: return run<Src::kDenseF16, Dst>(a);
    case Src::kInt8: return run<Src::kInt8, Dst>(a);
    case Src::kInt4: return run<Src::kInt4, Dst>(a);
  }
}

}  // namespace

void dequant_rerotate_into_cpu(at::TensorList dst_k, at::TensorList dst_v, const at::Tensor& k,
                               const at::Tensor& v, const std::optional<at::Tensor>& k_scale,
                               const std::optional<at::Tensor>& k_min, const std::optional<at::Tensor>& v_scale,
                               const std::optional<at::Tensor>& v_min, int64_t bits, int64_t group_size,
                               int64_t head_dim, int64_t src_start, int64_t length, int64_t dst_start,
                               const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin) {
  const PlaceGeometry geo = check_place_args(dst_k, dst_v, k, v, k_scale, k_min, v_scale, v_min, bits, group_size,
                                             head_dim, src_start, length, dst_start, cos, sin);
  TORCH_CHECK_VALUE(k.device().is_cpu(), "kvboost: dequant_rerotate_into_cpu got ", k.device(), " tensors");
  if (length == 0 || geo.L == 0 || geo.H == 0) return;
  Args a{};
  // Contiguity of the small tensors is a no-op for payloads built by quant.py; kept alive by these locals.
  at::Tensor kc = k, vc = v, ksc, kmn, vsc, vmn, cs, sn;
  Src src;
  if (bits == 16) {
    const auto st = k.scalar_type();
    if (v.scalar_type() != st) vc = v.to(st);  // mixed dense dtypes: rare, one cast keeps a single kernel
    src = st == at::kFloat ? Src::kDenseF32 : st == at::kBFloat16 ? Src::kDenseBF16 : Src::kDenseF16;
  } else {
    kc = k.contiguous();
    vc = v.contiguous();
    ksc = k_scale->contiguous();
    kmn = k_min->contiguous();
    vsc = v_scale->contiguous();
    vmn = v_min->contiguous();
    src = bits == 8 ? Src::kInt8 : Src::kInt4;
    a.k_scale = ksc.data_ptr<c10::Half>();
    a.k_min = kmn.data_ptr<c10::Half>();
    a.v_scale = vsc.data_ptr<c10::Half>();
    a.v_min = vmn.data_ptr<c10::Half>();
    a.G = group_size;
    a.ngn = ksc.size(2);
    a.ngd = vsc.size(3);
  }
  a.k = kc.data_ptr();
  a.v = vc.data_ptr();
  a.ks0 = kc.stride(0), a.ks1 = kc.stride(1), a.ks2 = kc.stride(2);
  a.vs0 = vc.stride(0), a.vs1 = vc.stride(1), a.vs2 = vc.stride(2);
  std::vector<void*> dk(geo.L), dv(geo.L);
  std::vector<int64_t> dks(2 * geo.L), dvs(2 * geo.L);
  for (int64_t l = 0; l < geo.L; ++l) {
    dk[l] = dst_k[l].data_ptr();
    dv[l] = dst_v[l].data_ptr();
    dks[2 * l] = dst_k[l].stride(1), dks[2 * l + 1] = dst_k[l].stride(2);
    dvs[2 * l] = dst_v[l].stride(1), dvs[2 * l + 1] = dst_v[l].stride(2);
  }
  a.dk = dk.data(), a.dv = dv.data(), a.dks = dks.data(), a.dvs = dvs.data();
  a.L = geo.L, a.H = geo.H, a.n = geo.n, a.D = geo.D, a.R = geo.R;
  a.src_start = src_start, a.length = length, a.dst_start = dst_start;
  if (geo.rotate) {
    cs = cos->contiguous();
    sn = sin->contiguous();
    a.cos = cs.data_ptr<float>();
    a.sin = sn.data_ptr<float>();
  }
  switch (dst_k[0].scalar_type()) {
    case at::kFloat: return run_dst<float>(src, a);
    case at::kBFloat16: return run_dst<c10::BFloat16>(src, a);
    case at::kHalf: return run_dst<c10::Half>(src, a);
    default: TORCH_CHECK(false, "kvboost: unsupported destination dtype ", dst_k[0].scalar_type());
  }
}

}  // namespace kvboost
