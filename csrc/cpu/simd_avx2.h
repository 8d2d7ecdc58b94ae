// AVX2 row helpers for the CPU placement kernel (place.cpp): 8 fp32 lanes at a time, the same arithmetic
// as the scalar loops (separate multiply and add, never an fma; RNE casts), so results stay bit-identical
// to the torch reference. Used for head_dim % 8 == 0, rotary half % 8 == 0 and group % 8 == 0 (every
// real model); anything else takes the scalar loops.
#pragma once

#ifdef __AVX2__
#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "../kvboost.h"

namespace kvboost {
namespace avx2 {

// 8 uint8 codes -> 8 floats.
static inline __m256 codes_u8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 4 bytes of packed int4 (even channel in the low nibble) -> 8 floats in channel order.
static inline __m256 codes_u4(const uint8_t* p) {
  int32_t w;
  std::memcpy(&w, p, 4);
  const __m128i dup = _mm_shuffle_epi8(_mm_cvtsi32_si128(w), _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1,
                                                                           -1, -1, -1, -1, -1));
  __m256i c = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(dup), _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
  return _mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(0x0f)));
}

template <typename T>
static inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));  // exact widening
  }
}

// x rounded through the destination dtype and back (round_to<T> on 8 lanes). Only float and bf16 are
// vectorized; callers keep fp16 destinations on the scalar path (c10's NaN bits differ from F16C's).
// kNaN=false skips the NaN fix-up: for dequantized rows, which are finite by construction (the quantizer
// refuses non-finite input and the stored scales are checksummed), it is dead work on the hot path.
template <typename T, bool kNaN = true>
static inline __m256 round_to8(__m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const __m256i u = _mm256_castps_si256(v);
    __m256i r = _mm256_add_epi32(
        u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
    if constexpr (!kNaN) return _mm256_castsi256_ps(r);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
  }
}

template <typename T, bool kNaN = true>
static inline void store8(T* out, __m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(out, v);
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>, "fp16 destinations use the scalar path");
    // round_to8 leaves the bf16 bits in the high half of each lane: shift down and pack.
    const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round_to8<T, kNaN>(v)), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
  }
}

// 16 floats -> 16 Dst values with one 256-bit store for bf16 (two packed halves).
template <typename T, bool kNaN = true>
static inline void store16(T* out, __m256 v0, __m256 v1) {
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(out, v0);
    _mm256_storeu_ps(out + 8, v1);
  } else {
    const __m256i r0 = _mm256_srli_epi32(_mm256_castps_si256(round_to8<T, kNaN>(v0)), 16);
    const __m256i r1 = _mm256_srli_epi32(_mm256_castps_si256(round_to8<T, kNaN>(v1)), 16);
    // packus interleaves 128-bit lanes (r0 lo, r1 lo, r0 hi, r1 hi); the permute restores channel order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xd8));
  }
}

// One row of D channels: ``load(c)`` yields channels [c, c + 8) in fp32 (the to_dense value before the cast);
// keys get the rotate_half RoPE rotation of their first R channels (round to Dst first, as to_dense does,
// then two products and one add), everything is stored as Dst. All in registers, no row buffer.
template <typename Dst, bool kNaN, typename Load>
static inline void emit(Load&& load, Dst* out, int64_t D, int64_t R, const float* cs, const float* sn) {
  int64_t c = 0;
  if (cs != nullptr) {
    const int64_t half = R / 2;
    for (int64_t i = 0; i < half; i += 8) {
      const __m256 a = round_to8<Dst, kNaN>(load(i));
      const __m256 b = round_to8<Dst, kNaN>(load(i + half));
      const __m256 lo = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(cs + i)), _mm256_mul_ps(b, _mm256_loadu_ps(sn + i)));
      const __m256 hi = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(cs + i + half)),
                                      _mm256_mul_ps(a, _mm256_loadu_ps(sn + i + half)));
      store8<Dst, kNaN>(out + i, lo);
      store8<Dst, kNaN>(out + i + half, hi);
    }
    c = R;
  }
  for (; c + 16 <= D; c += 16) store16<Dst, kNaN>(out + c, load(c), load(c + 8));
  for (; c < D; c += 8) store8<Dst, kNaN>(out + c, load(c));
}

// K row of quantized codes with per-channel (scale, min) already in fp32: x = code * scale + min.
template <int BITS, typename Dst>
static inline void place_k_quant(const uint8_t* codes, const float* sc, const float* mn, Dst* out, int64_t D,
                                 int64_t R, const float* cs, const float* sn) {
  emit<Dst, false>([&](int64_t c) {
    const __m256 q = BITS == 8 ? codes_u8(codes + c) : codes_u4(codes + c / 2);
    return _mm256_add_ps(_mm256_mul_ps(q, _mm256_loadu_ps(sc + c)), _mm256_loadu_ps(mn + c));
  }, out, D, R, cs, sn);
}

// V row: one fp16 (scale, min) per group of G channels (G % 8 == 0), expanded once per 8-lane block.
template <int BITS, typename Dst>
static inline void place_v_quant(const uint8_t* codes, const c10::Half* sc, const c10::Half* mn, Dst* out, int64_t D,
                                 int64_t G, int64_t ngd) {
  alignas(64) float s8[kMaxHeadDim / 8 + 1];
  alignas(64) float m8[kMaxHeadDim / 8 + 1];
  for (int64_t g = 0, b = 0; g < ngd; ++g) {
    const float s = static_cast<float>(sc[g]), m = static_cast<float>(mn[g]);
    for (int64_t c = g * G; c < std::min(D, (g + 1) * G); c += 8, ++b) s8[b] = s, m8[b] = m;
  }
  emit<Dst, false>([&](int64_t c) {
    const __m256 q = BITS == 8 ? codes_u8(codes + c) : codes_u4(codes + c / 2);
    return _mm256_add_ps(_mm256_mul_ps(q, _mm256_set1_ps(s8[c / 8])), _mm256_set1_ps(m8[c / 8]));
  }, out, D, 0, nullptr, nullptr);
}

// Dense row of T; a same-dtype row that is not rotated is a plain copy (round_to is the identity there).
template <typename T, typename Dst>
static inline void place_dense(const T* p, Dst* out, int64_t D, int64_t R, const float* cs, const float* sn) {
  if constexpr (std::is_same_v<T, Dst>) {
    if (cs == nullptr) {
      std::memcpy(out, p, D * sizeof(T));
      return;
    }
  }
  emit<Dst, true>([&](int64_t c) { return load8<T>(p + c); }, out, D, R, cs, sn);
}

}  // namespace avx2
}  // namespace kvboost
#endif  // __AVX2__
