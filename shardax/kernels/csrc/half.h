// fp16 and bf16 <-> fp32, bit for bit as torch converts: widening is exact,
// narrowing rounds to nearest even (NaN stays NaN, overflow becomes inf,
// fp16 subnormals are rounded like any other value).
//
// Without branches or loops — every case is computed and the right one
// selected — so that a loop calling them is vectorised. Each agrees with a
// plain case-by-case conversion on every input (checked exhaustively, all
// 2^32 floats and all 2^16 halves, when they were written).
#pragma once
#include <cstdint>
#include <cstring>

namespace sx {

inline float bits_to_f32(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint32_t f32_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

inline float bf16_to_f32(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  const uint32_t bits = f32_to_bits(f);
  const uint32_t nan = (bits >> 16) | 0x40u;                        // quieted
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;  // nearest even
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  // zero or subnormal: man · 2^-24, exact in fp32
  const uint32_t tiny = f32_to_bits(static_cast<float>(static_cast<int32_t>(man)) * 0x1p-24f);
  const uint32_t normal = ((exp + 127 - 15) << 23) | (man << 13);
  const uint32_t special = 0x7f800000u | (man << 13);  // inf, NaN
  return bits_to_f32(sign | (exp == 0 ? tiny : (exp == 31 ? special : normal)));
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t bits = f32_to_bits(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t absb = bits & 0x7fffffffu;
  // below the least normal half (2^-14): adding 0.5 (whose ulp, 2^-24, is
  // the subnormals' step) rounds to the nearest even multiple of the step,
  // and the sum's low bits are that multiple (0x400: rounded up to 2^-14)
  const uint32_t tiny = f32_to_bits(bits_to_f32(absb) + 0.5f) - 0x3f000000u;
  // normal: rebias, then round the 13 dropped bits to nearest even (a carry
  // out of the mantissa bumps the exponent, up to inf)
  const uint32_t normal = (absb - ((127u - 15u) << 23) + 0xfffu + ((absb >> 13) & 1u)) >> 13;
  const uint32_t big = absb > 0x7f800000u ? 0x7e00u : 0x7c00u;  // NaN, else inf
  const uint32_t half = absb >= 0x477ff000u ? big : (absb < 0x38800000u ? tiny : normal);
  return static_cast<uint16_t>(sign | half);
}

}  // namespace sx
