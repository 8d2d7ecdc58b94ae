// One decode row's attention on CPU, fp32: out[h] = softmax(scale * q[h] . K[kv(h), :length]) @ V[kv(h), :length].
//
// Decode attention is one query row per head over the whole context, which torch's fused CPU kernel (flash
// SDPA) is not built for (SmolLM2 at 1.8K tokens: 10 ms of a 30 ms step for 83 MB of fp32 K/V). This kernel
// runs each query row in two passes over its KV head (GQA: rows of one KV head share it): scores, then the
// weighted sum of values, with the row's accumulators in registers.
//
// Results depend on the row alone: a row is computed by one thread, in a fixed order, whatever the thread
// count or the other rows, so the batched server's rows are batch-invariant through it. Numerics: fp32
// products and sums (8 lanes, then a fixed pairwise reduction), exp from a degree-6 polynomial of the Cephes
// form (relative error about 2e-7 against the correctly rounded exp). Not bitwise torch's SDPA; the torch
// reference (kvboost_core/kernels/reference.py) is SDPA and the tests bound the difference.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "../kvboost.h"

namespace kvboost {
namespace {

// exp(x) for x <= 0 (scores minus their max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2].
static inline float exp_scalar(float x) {
  if (x < -87.0f) return 0.0f;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return std::ldexp(p, static_cast<int>(n));
}

#ifdef __AVX2__
static inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_add_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline float hsum8(__m256 v) {  // ((0+4)+(2+6)) + ((1+5)+(3+7)): a fixed order
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

// s[0:n] = exp(s - max), returns the sum
static inline float softmax_numer(float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
  int64_t t = 0;
  float sum = 0.0f;
#ifdef __AVX2__
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum8(acc);
#endif
  for (; t < n; ++t) {
    s[t] = exp_scalar(s[t] - m);
    sum += s[t];
  }
  return sum;
}

// dot(q, k) over D values: with AVX2 and D = 8 * NV, eight lanes per register, the registers summed as a
// balanced tree, then the lanes (hsum8): one fixed order (row_scalar sums in order where D is not 16/32/64/128).
#ifdef __AVX2__
template <int NV>
static inline float dot_v(const __m256* q, const float* k) {
  __m256 p[NV];
  for (int i = 0; i < NV; ++i) p[i] = _mm256_mul_ps(q[i], _mm256_loadu_ps(k + 8 * i));
  for (int w = 1; w < NV; w *= 2)
    for (int i = 0; i + w < NV; i += 2 * w) p[i] = _mm256_add_ps(p[i], p[i + w]);
  return hsum8(p[0]);
}

// Where one KV head's rows live: row t in page pages[t / P] at slot t % P, each page `page` floats after the
// last. The dense case is one page (pages = {0}, P = length). Rows are walked page by page, in position order,
// so a paged call sums in the dense call's order and gives its bits.
struct Walk {
  const float* base;     // the head's slot 0 in page 0
  const int64_t* pages;  // page ids in position order
  int64_t page, row, P;  // strides (floats) between pages and between rows; rows per page
};

// out = sum_t w[t] * v[t] over the walk's first n rows of D = 8 * NV values, accumulated in registers in t order
template <int NV>
static inline void weighted_rows(float* out, const float* w, const Walk& v, int64_t n) {
  __m256 acc[NV];
  for (int i = 0; i < NV; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t t = 0, i = 0; t < n; ++i) {
    const float* vp = v.base + v.pages[i] * v.page;
    for (const int64_t end = std::min(t + v.P, n); t < end; ++t, vp += v.row) {
      const __m256 wt = _mm256_set1_ps(w[t]);
      for (int j = 0; j < NV; ++j) acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(wt, _mm256_loadu_ps(vp + 8 * j)));
    }
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(out + 8 * i, acc[i]);
}

// One query row: scores over its n keys into s[0:n], softmax, then the weighted sum of values into out[0:D].
template <int NV>
static void row_v(const float* q, const Walk& k, const Walk& v, int64_t n, float sc, float* s, float* out) {
  __m256 qv[NV];
  for (int i = 0; i < NV; ++i) qv[i] = _mm256_loadu_ps(q + 8 * i);
  for (int64_t t = 0, i = 0; t < n; ++i) {
    const float* kp = k.base + k.pages[i] * k.page;
    for (const int64_t end = std::min(t + k.P, n); t < end; ++t, kp += k.row) s[t] = dot_v<NV>(qv, kp) * sc;
  }
  const float inv = 1.0f / softmax_numer(s, n);
  weighted_rows<NV>(out, s, v, n);
  for (int i = 0; i < 8 * NV; ++i) out[i] *= inv;
}
#endif

static void row_scalar(const float* q, const Walk& k, const Walk& v, int64_t n, int64_t D, float sc, float* s,
                       float* out) {
  for (int64_t t = 0, i = 0; t < n; ++i) {
    const float* kp = k.base + k.pages[i] * k.page;
    for (const int64_t end = std::min(t + k.P, n); t < end; ++t, kp += k.row) {
      float acc = 0.0f;
      for (int64_t d = 0; d < D; ++d) acc += q[d] * kp[d];
      s[t] = acc * sc;
    }
  }
  const float inv = 1.0f / softmax_numer(s, n);
  std::fill(out, out + D, 0.0f);
  for (int64_t t = 0, i = 0; t < n; ++i) {
    const float* vp = v.base + v.pages[i] * v.page;
    for (const int64_t end = std::min(t + v.P, n); t < end; ++t, vp += v.row)
      for (int64_t d = 0; d < D; ++d) out[d] += s[t] * vp[d];
  }
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

// Every query head's row, heads split over threads (9 split 5 + 4 on 2); K/V head h / group, as `walk` places it.
template <typename WalkOf>
static at::Tensor attend_rows(const at::Tensor& q, int64_t H, int64_t Hkv, int64_t D, int64_t n, double scale,
                              const WalkOf& walk) {
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty({H, D}, q.options());
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = H / Hkv;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(static_cast<size_t>(n));
    for (int64_t h = begin; h < end; ++h) {
      const float* qh = qp + h * D;
      const Walk k = walk(h / group, true), v = walk(h / group, false);  // a thread's rows share a KV head
      float* oh = op + h * D;
#ifdef __AVX2__
      if (D == 64) { row_v<8>(qh, k, v, n, sc, s.data(), oh); continue; }
      if (D == 128) { row_v<16>(qh, k, v, n, sc, s.data(), oh); continue; }
      if (D == 32) { row_v<4>(qh, k, v, n, sc, s.data(), oh); continue; }
      if (D == 16) { row_v<2>(qh, k, v, n, sc, s.data(), oh); continue; }
#endif
      row_scalar(qh, k, v, n, D, sc, s.data(), oh);
    }
  });
  return out;
}

}  // namespace

at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t length,
                                double scale) {
  const DecodeGeometry g = check_decode_args(q, k, v, length);
  static const int64_t one_page = 0;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  return attend_rows(q, g.H, g.Hkv, g.D, length, scale, [&](int64_t hk, bool key) {
    return key ? Walk{kp + hk * k.stride(0), &one_page, 0, k.stride(1), length}
               : Walk{vp + hk * v.stride(0), &one_page, 0, v.stride(1), length};
  });
}

at::Tensor paged_decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                      const at::Tensor& pages, int64_t length, double scale) {
  const DecodeGeometry g = check_paged_decode_args(q, k_pool, v_pool, pages, length);
  const at::Tensor pc = pages.contiguous();
  const int64_t* pp = pc.data_ptr<int64_t>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  const int64_t P = k_pool.size(2);
  return attend_rows(q, g.H, g.Hkv, g.D, length, scale, [&](int64_t hk, bool key) {
    return key ? Walk{kp + hk * k_pool.stride(1), pp, k_pool.stride(0), k_pool.stride(2), P}
               : Walk{vp + hk * v_pool.stride(1), pp, v_pool.stride(0), v_pool.stride(2), P};
  });
}

}  // namespace kvboost
