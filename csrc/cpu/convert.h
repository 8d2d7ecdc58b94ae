// float <-> storage conversions for the CPU kernels, rounding exactly like torch's casts
// (round-to-nearest-even). Written against c10's scalar types; with -mf16c the fp16 ones are single
// instructions and the row loops below vectorize.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace kvboost {

template <typename T>
struct Cvt;

template <>
struct Cvt<float> {
  static inline float load(float x) { return x; }
  static inline float store(float x) { return x; }
};

template <>
struct Cvt<c10::BFloat16> {
  static inline float load(c10::BFloat16 x) {
    uint32_t u = static_cast<uint32_t>(x.x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static inline c10::BFloat16 store(float f) {
    // Same bit recipe as c10::BFloat16(float): RNE, NaN -> 0x7FC0.
    uint32_t u;
    std::memcpy(&u, &f, 4);
    uint16_t b = (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0)
                                                  : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return c10::BFloat16(b, c10::BFloat16::from_bits());
  }
};

template <>
struct Cvt<c10::Half> {
  static inline float load(c10::Half x) { return static_cast<float>(x); }
  static inline c10::Half store(float f) { return c10::Half(f); }
};

// x rounded through storage type T and back: what `tensor.to(T).float()` does.
template <typename T>
static inline float round_to(float x) {
  return Cvt<T>::load(Cvt<T>::store(x));
}

// bf16 specialization without the uint16 round trip (vectorizes to plain 32-bit integer ops).
template <>
inline float round_to<c10::BFloat16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

}  // namespace kvboost
