// KIVI-style quantization on CPU, bit-exact with kvboost_core.quant.quantize_k / quantize_v:
//   mn16 = fp16(min) rounded toward -inf, s16 = fp16((max - mn16) / q) rounded toward +inf (float32 true
//   division, as torch does on CPU), code = clamp(rint((x - mn16) / s16), 0, q) (round half to even), 0 where
//   s16 == 0. K groups G tokens per channel; V groups G channels per token; int4 packs channel pairs.
#include <ATen/Parallel.h>

#include <atomic>
#include <cfenv>
#include <cmath>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "../kvboost.h"
#include "convert.h"

namespace kvboost {
namespace {

constexpr float kFp16Max = 65504.0f;
enum ErrorBits : int { kNonFiniteK = 1, kRangeK = 2, kNonFiniteV = 4, kRangeV = 8 };

// quant.py's _round_fp16: cast (RNE); if that landed on the wrong side of x, step one fp16 toward `up`.
static inline c10::Half round_fp16_directed(float x, bool up) {
  c10::Half h(x);
  const float hf = static_cast<float>(h);
  const bool wrong = up ? hf < x : hf > x;
  if (!wrong) return h;
  uint16_t b = h.x;
  const bool zero = (b & 0x7fff) == 0;
  if (zero) {
    b = up ? 0x0001 : 0x8001;  // smallest subnormal of the wanted sign (torch.nextafter does the same)
  } else {
    const bool neg = b & 0x8000;
    b = (up != neg) ? b + 1 : b - 1;  // away from zero when moving outward, toward it otherwise
  }
  return c10::Half(b, c10::Half::from_bits());
}

struct GroupParams {
  c10::Half s16, m16;
  float s, m;
};

static inline GroupParams group_params(float lo, float hi, float q) {
  GroupParams p;
  p.m16 = round_fp16_directed(lo, /*up=*/false);
  p.m = static_cast<float>(p.m16);
  const float s32 = (hi - p.m) / q;
  p.s16 = round_fp16_directed(s32, /*up=*/true);
  p.s = static_cast<float>(p.s16);
  return p;
}

static inline uint8_t code_of(float x, const GroupParams& p, float q) {
  if (!(p.s > 0.0f)) return 0;
  float c = std::nearbyint((x - p.m) / p.s);  // default rounding mode: ties to even, like torch.round
  c = std::min(std::max(c, 0.0f), q);
  return static_cast<uint8_t>(c);
}

static inline int check_value(float x, int nonfinite_bit, int range_bit) {
  if (!std::isfinite(x)) return nonfinite_bit;
  return std::fabs(x) > kFp16Max ? range_bit : 0;
}

template <typename T>
static void quant_k(const at::Tensor& k, int bits, int64_t G, at::Tensor& codes, at::Tensor& sc, at::Tensor& mn,
                    std::atomic<int>& err) {
  const int64_t L = k.size(0), H = k.size(1), n = k.size(2), D = k.size(3);
  const int64_t ngn = sc.size(2), dc = codes.size(3);
  const float q = static_cast<float>((1 << bits) - 1);
  const T* src = k.data_ptr<T>();  // contiguous (L, H, n, D)
  uint8_t* out = codes.data_ptr<uint8_t>();
  c10::Half* so = sc.data_ptr<c10::Half>();
  c10::Half* mo = mn.data_ptr<c10::Half>();
  at::parallel_for(0, L * H * ngn, 1, [&](int64_t begin, int64_t end) {
    float lo[kMaxHeadDim], hi[kMaxHeadDim];
    GroupParams gp[kMaxHeadDim];
    uint8_t row[kMaxHeadDim + 1];
    int bad = 0;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t lh = item / ngn, g = item % ngn;
      const int64_t t0 = g * G, t1 = std::min(n, t0 + G);
      const T* base = src + lh * n * D;
      for (int64_t c = 0; c < D; ++c) lo[c] = INFINITY, hi[c] = -INFINITY;
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t c = 0; c < D; ++c) {
          const float x = Cvt<T>::load(base[t * D + c]);
          bad |= check_value(x, kNonFiniteK, kRangeK);
          lo[c] = std::min(lo[c], x);
          hi[c] = std::max(hi[c], x);
        }
      }
      if (bad) continue;  // the op raises; keep scanning so the error class matches quant.py's
      for (int64_t c = 0; c < D; ++c) {
        gp[c] = group_params(lo[c], hi[c], q);
        so[item * D + c] = gp[c].s16;  // (L, H, ngn, D): item == lh * ngn + g
        mo[item * D + c] = gp[c].m16;
      }
      for (int64_t t = t0; t < t1; ++t) {
        row[D] = 0;  // int4 pad code for odd D
        for (int64_t c = 0; c < D; ++c) row[c] = code_of(Cvt<T>::load(base[t * D + c]), gp[c], q);
        uint8_t* o = out + (lh * n + t) * dc;
        if (bits == 8) {
          std::memcpy(o, row, D);
        } else {
          for (int64_t j = 0; j < dc; ++j) o[j] = row[2 * j] | (row[2 * j + 1] << 4);
        }
      }
    }
    if (bad) err.fetch_or(bad);
  });
}

template <typename T>
static void quant_v(const at::Tensor& v, int bits, int64_t G, at::Tensor& codes, at::Tensor& sc, at::Tensor& mn,
                    std::atomic<int>& err) {
  const int64_t L = v.size(0), H = v.size(1), n = v.size(2), D = v.size(3);
  const int64_t ngd = sc.size(3), dc = codes.size(3);
  const float q = static_cast<float>((1 << bits) - 1);
  const T* src = v.data_ptr<T>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  c10::Half* so = sc.data_ptr<c10::Half>();
  c10::Half* mo = mn.data_ptr<c10::Half>();
  at::parallel_for(0, L * H * n, 64, [&](int64_t begin, int64_t end) {
    float x[kMaxHeadDim];
    uint8_t row[kMaxHeadDim + 1];
    int bad = 0;
    for (int64_t r = begin; r < end; ++r) {  // r indexes (l, h, t) rows
      for (int64_t c = 0; c < D; ++c) {
        x[c] = Cvt<T>::load(src[r * D + c]);
        bad |= check_value(x[c], kNonFiniteV, kRangeV);
      }
      if (bad) continue;
      for (int64_t g = 0; g < ngd; ++g) {
        const int64_t c0 = g * G, c1 = std::min(D, c0 + G);
        float lo = INFINITY, hi = -INFINITY;
        for (int64_t c = c0; c < c1; ++c) lo = std::min(lo, x[c]), hi = std::max(hi, x[c]);
        const GroupParams p = group_params(lo, hi, q);
        so[r * ngd + g] = p.s16;
        mo[r * ngd + g] = p.m16;
        for (int64_t c = c0; c < c1; ++c) row[c] = code_of(x[c], p, q);
      }
      row[D] = 0;
      uint8_t* o = out + r * dc;
      if (bits == 8) {
        std::memcpy(o, row, D);
      } else {
        for (int64_t j = 0; j < dc; ++j) o[j] = row[2 * j] | (row[2 * j + 1] << 4);
      }
    }
    if (bad) err.fetch_or(bad);
  });
}

template <typename F>
static void dispatch_float(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, "kvboost: unsupported dtype ", st);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_kv_cpu(
    const at::Tensor& k_in, const at::Tensor& v_in, int64_t bits, int64_t group_size) {
  check_quantize_args(k_in, v_in, bits, group_size);
  const at::Tensor k = k_in.contiguous(), v = v_in.contiguous();
  const int64_t L = k.size(0), H = k.size(1), n = k.size(2), D = k.size(3);
  TORCH_CHECK_VALUE(D <= kMaxHeadDim, "kvboost: head_dim must be <= ", kMaxHeadDim, ", got ", D);
  const int64_t G = group_size, dc = bits == 8 ? D : (D + 1) / 2;
  const auto u8 = k.options().dtype(at::kByte), f16 = k.options().dtype(at::kHalf);
  at::Tensor kc = at::empty({L, H, n, dc}, u8), vc = at::empty({L, H, n, dc}, u8);
  at::Tensor ks = at::empty({L, H, (n + G - 1) / G, D}, f16), km = at::empty_like(ks);
  at::Tensor vs = at::empty({L, H, n, (D + G - 1) / G}, f16), vm = at::empty_like(vs);
  // std::nearbyint follows the current rounding mode; torch.round is always ties-to-even.
  TORCH_CHECK(std::fegetround() == FE_TONEAREST, "kvboost: quantize_kv needs the default FP rounding mode");
  std::atomic<int> err{0};
  dispatch_float(k.scalar_type(), [&](auto tag) { quant_k<decltype(tag)>(k, bits, G, kc, ks, km, err); });
  if (!(err.load() & (kNonFiniteK | kRangeK)))
    dispatch_float(v.scalar_type(), [&](auto tag) { quant_v<decltype(tag)>(v, bits, G, vc, vs, vm, err); });
  const int e = err.load();
  // Same messages and precedence as quant._quantize_groups_last (K is checked before V).
  if (e & kNonFiniteK) TORCH_CHECK_VALUE(false, "cannot quantize non-finite K/V values");
  if (e & kRangeK) TORCH_CHECK_VALUE(false, "K/V values exceed the fp16 range (65504.0) of the stored scales");
  if (e & kNonFiniteV) TORCH_CHECK_VALUE(false, "cannot quantize non-finite K/V values");
  if (e & kRangeV) TORCH_CHECK_VALUE(false, "K/V values exceed the fp16 range (65504.0) of the stored scales");
  return {kc, ks, km, vc, vs, vm};
}

}  // namespace kvboost
