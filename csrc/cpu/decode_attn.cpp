// One decode row's attention on CPU, fp32: out[h] = softmax(scale * q[h] . K[kv(h), :length]) @ V[kv(h), :length].
//
// Decode attention is one query row per head over the whole context, which torch's fused CPU kernel (flash
// SDPA) is not built for (SmolLM2 at 1.8K tokens: 10 ms of a 30 ms step for 83 MB of fp32 K/V). This kernel
// runs each query row in two passes over its KV head: scores, then the weighted sum of values, with the row's
// accumulators in registers. It is bound by reading K/V from memory, so the query rows of one KV head (GQA) that
// a thread holds walk it together, in blocks of kChunk rows that stay in cache while each of them reads the
// block: the KV head is read from memory once per thread, not once per query row.
//
// Results depend on the row alone: a row is computed by one thread, with the same operations in the same order
// whichever rows share its walk, whatever the thread count or the other rows, so the batched server's rows are
// batch-invariant through it. Numerics: fp32; a score is a chain of multiply-adds over the head dimension's
// 8-lane registers, then its 8 lanes summed in a fixed order; the weighted sum multiply-adds in position order
// (fused where the CPU has FMA); exp from a degree-6 polynomial of the Cephes form (relative error about 2e-7
// against the correctly rounded exp). Not bitwise torch's SDPA; the torch reference
// (kvboost_core/kernels/reference.py) is SDPA and the tests bound the difference against float64.
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

#ifdef __AVX2__
// Where one KV head's rows live: row t in page pages[t / P] at slot t % P, each page `page` floats after the
// last. The dense case is one page (pages = {0}, P = length). Rows are walked page by page, in position order,
// so a paged call sums in the dense call's order and gives its bits.
struct Walk {
  const float* base;     // the head's slot 0 in page 0
  const int64_t* pages;  // page ids in position order
  int64_t page, row, P;  // strides (floats) between pages and between rows; rows per page
};

// a * b + c: one rounding where the CPU has FMA, else the product rounded, then the sum
static inline __m256 madd(__m256 a, __m256 b, __m256 c) {
#ifdef __FMA__
  return _mm256_fmadd_ps(a, b, c);
#else
  return _mm256_add_ps(_mm256_mul_ps(a, b), c);
#endif
}

// Eight lanes of p[0..7] summed per vector, lane j of the result = the sum of p[j]'s lanes, in the order
// ((0+1)+(2+3)) + ((4+5)+(6+7)): the same fixed order for every key, whatever its place in a block of eight.
static inline __m256 sum_lanes8(const __m256* p) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(p[4], p[5]), _mm256_hadd_ps(p[6], p[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// q . k over D = 8 * NV values, lanes not yet summed: a chain of multiply-adds over the NV registers in order
template <int NV>
static inline __m256 dot_lanes(const __m256* q, const float* k) {
  __m256 p = _mm256_mul_ps(q[0], _mm256_loadu_ps(k));
  for (int i = 1; i < NV; ++i) p = madd(q[i], _mm256_loadu_ps(k + 8 * i), p);
  return p;
}

// Walks a KV head's rows in position order, page by page, without a division per row
struct Cursor {
  const Walk& w;
  int64_t page, slot;
  Cursor(const Walk& walk, int64_t t) : w(walk), page(t / walk.P), slot(t % walk.P) {}
  const float* next() {
    const float* r = w.base + w.pages[page] * w.page + slot * w.row;
    if (++slot == w.P) slot = 0, ++page;
    return r;
  }
};

// s[t] = sc * q . k[t] for keys [t0, t1), eight at a time, their lanes summed in one transpose (sum_lanes8).
// t0 is a multiple of 8; a short last block (t1 = n only) reads zeros for its missing keys, so every key's
// score has the same order of sums wherever its block starts.
template <int NV>
static void scores_v(const __m256* qv, const Walk& k, int64_t t0, int64_t t1, float sc, float* s) {
  alignas(32) static const float zeros[8 * NV] = {};
  const __m256 scv = _mm256_set1_ps(sc);
  const float* kp[8];
  Cursor keys(k, t0);
  for (int64_t t = t0; t < t1; t += 8) {
    const int m = static_cast<int>(std::min<int64_t>(8, t1 - t));
    for (int j = 0; j < 8; ++j) kp[j] = j < m ? keys.next() : zeros;
    __m256 p[8];
    for (int j = 0; j < 8; ++j) p[j] = dot_lanes<NV>(qv, kp[j]);
    const __m256 r = _mm256_mul_ps(sum_lanes8(p), scv);
    if (m == 8) {
      _mm256_storeu_ps(s + t, r);
    } else {
      alignas(32) float tail[8];
      _mm256_store_ps(tail, r);
      std::copy(tail, tail + m, s + t);
    }
  }
}

// out += sum_t w[t] * v[t] for value rows [t0, t1) of D = 8 * NV values, in registers, in t order
template <int NV>
static inline void weighted_rows(float* out, const float* w, const Walk& v, int64_t t0, int64_t t1) {
  __m256 acc[NV];
  for (int i = 0; i < NV; ++i) acc[i] = _mm256_loadu_ps(out + 8 * i);
  Cursor values(v, t0);
  for (int64_t t = t0; t < t1; ++t) {
    const float* vp = values.next();
    const __m256 wt = _mm256_set1_ps(w[t]);
    for (int j = 0; j < NV; ++j) acc[j] = madd(wt, _mm256_loadu_ps(vp + 8 * j), acc[j]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(out + 8 * i, acc[i]);
}

constexpr int64_t kChunk = 256;  // keys per block that the G rows of a group run through while it is in cache

// The G query rows of one KV head (a GQA group), D = 8 * NV: scores into s[g * n + t], softmax, then the
// weighted sums of values into out[g * D ...]. The keys and values are walked in blocks of kChunk rows, each
// block run through by all G rows while it is in cache, so the KV head is read from memory once; a row's
// operations are the same, in the same order, whatever G is (and as for G = 1).
template <int NV>
static void group_v(const float* q, int64_t G, const Walk& k, const Walk& v, int64_t n, float sc, float* s,
                    float* out) {
  constexpr int64_t D = 8 * NV;
  for (int64_t t0 = 0; t0 < n; t0 += kChunk) {
    const int64_t t1 = std::min(t0 + kChunk, n);
    for (int64_t g = 0; g < G; ++g) {
      __m256 qv[NV];
      for (int i = 0; i < NV; ++i) qv[i] = _mm256_loadu_ps(q + g * D + 8 * i);
      scores_v<NV>(qv, k, t0, t1, sc, s + g * n);
    }
  }
  std::vector<float> inv(static_cast<size_t>(G));
  for (int64_t g = 0; g < G; ++g) inv[g] = 1.0f / softmax_numer(s + g * n, n);
  std::fill(out, out + G * D, 0.0f);
  for (int64_t t0 = 0; t0 < n; t0 += kChunk) {
    const int64_t t1 = std::min(t0 + kChunk, n);
    for (int64_t g = 0; g < G; ++g) weighted_rows<NV>(out + g * D, s + g * n, v, t0, t1);
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < D; ++i) out[g * D + i] *= inv[g];
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

// Every query head's row, the heads split over threads (9 split 5 + 4 on 2). A thread's consecutive rows of one
// KV head (h / group) run together through group_v where D is 16, 32, 64 or 128 (else row by row, row_scalar);
// a row's result is the same whichever rows share its run, so it does not depend on the thread count.
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
    std::vector<float> s(static_cast<size_t>(n * std::min(group, end - begin)));
    for (int64_t h = begin; h < end;) {
      const int64_t hk = h / group, G = std::min((hk + 1) * group, end) - h;  // rows h .. h + G share KV head hk
      const Walk k = walk(hk, true), v = walk(hk, false);
      const float* qh = qp + h * D;
      float* oh = op + h * D;
      h += G;
#ifdef __AVX2__
      if (D == 64) { group_v<8>(qh, G, k, v, n, sc, s.data(), oh); continue; }
      if (D == 128) { group_v<16>(qh, G, k, v, n, sc, s.data(), oh); continue; }
      if (D == 32) { group_v<4>(qh, G, k, v, n, sc, s.data(), oh); continue; }
      if (D == 16) { group_v<2>(qh, G, k, v, n, sc, s.data(), oh); continue; }
#endif
      for (int64_t g = 0; g < G; ++g) row_scalar(qh + g * D, k, v, n, D, sc, s.data(), oh + g * D);
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
