// Blockwise int8 and int4 quantization: ``block`` consecutive elements share
// one fp32 scale (their absolute maximum / 127, or / 7 for int4) and are
// stored as round(x / scale), rounded to nearest even, in [-127, 127] (int8)
// or [-7, 7] (int4). The last block may be short.
// int4 packs two values a byte: element 2i in the low nibble of byte i,
// element 2i + 1 in the high one, each in two's complement; an odd count
// leaves the last high nibble 0. ``block`` must be even there, so that
// every block starts on a byte.
// Bit for bit the torch references' (shardax.kernels.cuda.quantize_int8_reference,
// shardax.kernels._quant.quantize_int4_reference): a true division per
// element, widening of bf16/fp16 exact, narrowing of the dequantized value
// to nearest even (half.h).
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "half.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// dtype codes, as torch's: 0 fp32, 2 fp16, 3 bf16
inline float load(const void* x, int dtype, int64_t i) {
  if (dtype == 3) return sx::bf16_to_f32(static_cast<const uint16_t*>(x)[i]);
  if (dtype == 2) return sx::f16_to_f32(static_cast<const uint16_t*>(x)[i]);
  return static_cast<const float*>(x)[i];
}

inline void store(void* x, int dtype, int64_t i, float v) {
  if (dtype == 3) {
    static_cast<uint16_t*>(x)[i] = sx::f32_to_bf16(v);
  } else if (dtype == 2) {
    static_cast<uint16_t*>(x)[i] = sx::f32_to_f16(v);
  } else {
    static_cast<float*>(x)[i] = v;
  }
}

template <int DTYPE>
void quantize_block(const void* x, int64_t lo, int64_t hi, int8_t* q, float* scale) {
  float peak = 0.0f;
  for (int64_t i = lo; i < hi; ++i) peak = std::fmax(peak, std::fabs(load(x, DTYPE, i)));
  const float s = peak / 127.0f;
  *scale = s;
  if (s > 0.0f) {
    for (int64_t i = lo; i < hi; ++i) {
      const float r = std::nearbyint(load(x, DTYPE, i) / s);
      q[i] = static_cast<int8_t>(std::fmin(std::fmax(r, -127.0f), 127.0f));
    }
  } else {
    for (int64_t i = lo; i < hi; ++i) q[i] = 0;
  }
}

template <int DTYPE>
void dequantize_block(const int8_t* q, float scale, int64_t lo, int64_t hi, void* out) {
  for (int64_t i = lo; i < hi; ++i) store(out, DTYPE, i, static_cast<float>(q[i]) * scale);
}

// int4: one value's code, in [-7, 7] (``s`` > 0)
inline int code4(float v, float s) {
  const float r = std::nearbyint(v / s);
  return static_cast<int>(std::fmin(std::fmax(r, -7.0f), 7.0f));
}

inline uint8_t pack4(int lo, int hi) {
  return static_cast<uint8_t>((lo & 0xf) | ((hi & 0xf) << 4));
}

// the nibble's two's complement value: 0..7 as is, 8..15 as -8..-1
inline float unpack4(unsigned nibble) {
  return static_cast<float>(static_cast<int>(nibble ^ 8u) - 8);
}

// elements [lo, hi) into bytes [lo / 2, (hi + 1) / 2); ``lo`` even
template <int DTYPE>
void quantize_block4(const void* x, int64_t lo, int64_t hi, uint8_t* q, float* scale) {
  float peak = 0.0f;
  for (int64_t i = lo; i < hi; ++i) peak = std::fmax(peak, std::fabs(load(x, DTYPE, i)));
  const float s = peak / 7.0f;
  *scale = s;
  const int64_t pairs = (hi - lo) / 2;
  uint8_t* out = q + lo / 2;
  if (s > 0.0f) {
    for (int64_t j = 0; j < pairs; ++j) {
      const int64_t i = lo + 2 * j;
      out[j] = pack4(code4(load(x, DTYPE, i), s), code4(load(x, DTYPE, i + 1), s));
    }
    if ((hi - lo) & 1) out[pairs] = pack4(code4(load(x, DTYPE, hi - 1), s), 0);
  } else {
    for (int64_t j = 0; j < (hi - lo + 1) / 2; ++j) out[j] = 0;
  }
}

template <int DTYPE>
void dequantize_block4(const uint8_t* q, float scale, int64_t lo, int64_t hi, void* out) {
  const int64_t pairs = (hi - lo) / 2;
  const uint8_t* in = q + lo / 2;
  for (int64_t j = 0; j < pairs; ++j) {
    const int64_t i = lo + 2 * j;
    store(out, DTYPE, i, unpack4(in[j] & 0xfu) * scale);
    store(out, DTYPE, i + 1, unpack4(in[j] >> 4) * scale);
  }
  if ((hi - lo) & 1) store(out, DTYPE, hi - 1, unpack4(in[pairs] & 0xfu) * scale);
}

// ``body(dtype as a compile-time constant, block index, lo, hi)`` for every
// block of ``n`` elements, in parallel; 0, or -1 for a dtype or block it does
// not know.
template <class Body>
int for_blocks(int dtype, int64_t n, int64_t block, Body body) {
  if (block <= 0 || (dtype != 0 && dtype != 2 && dtype != 3)) return -1;
  const int64_t blocks = (n + block - 1) / block;
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
    if (dtype == 3) {
      body(std::integral_constant<int, 3>(), b, lo, hi);
    } else if (dtype == 2) {
      body(std::integral_constant<int, 2>(), b, lo, hi);
    } else {
      body(std::integral_constant<int, 0>(), b, lo, hi);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// Use ``n`` threads in this thread's next kernels.
void sx_quant_threads(int n) {
#ifdef _OPENMP
  if (n > 0) omp_set_num_threads(n);
#else
  (void)n;
#endif
}

// x: n elements of ``dtype``; q: n int8; scales: ceil(n / block) floats.
// Returns 0, or -1 for a dtype or block it does not know.
int sx_quantize_int8(const void* x, int dtype, int64_t n, int64_t block, int8_t* q,
                     float* scales) {
  return for_blocks(dtype, n, block, [&](auto d, int64_t b, int64_t lo, int64_t hi) {
    quantize_block<decltype(d)::value>(x, lo, hi, q, scales + b);
  });
}

// out (n elements of ``dtype``) = q * scale of its block.
int sx_dequantize_int8(const int8_t* q, const float* scales, int64_t n, int64_t block, void* out,
                       int dtype) {
  return for_blocks(dtype, n, block, [&](auto d, int64_t b, int64_t lo, int64_t hi) {
    dequantize_block<decltype(d)::value>(q, scales[b], lo, hi, out);
  });
}

// x: n elements of ``dtype``; q: (n + 1) / 2 bytes, two int4 values each
// (low nibble first); scales: ceil(n / block) floats. Returns 0, or -1 for
// a dtype it does not know or a block that is not positive and even.
int sx_quantize_int4(const void* x, int dtype, int64_t n, int64_t block, uint8_t* q,
                     float* scales) {
  if (block % 2 != 0) return -1;
  return for_blocks(dtype, n, block, [&](auto d, int64_t b, int64_t lo, int64_t hi) {
    quantize_block4<decltype(d)::value>(x, lo, hi, q, scales + b);
  });
}

// out (n elements of ``dtype``) = the int4 value * scale of its block.
int sx_dequantize_int4(const uint8_t* q, const float* scales, int64_t n, int64_t block, void* out,
                       int dtype) {
  if (block % 2 != 0) return -1;
  return for_blocks(dtype, n, block, [&](auto d, int64_t b, int64_t lo, int64_t hi) {
    dequantize_block4<decltype(d)::value>(q, scales[b], lo, hi, out);
  });
}

}  // extern "C"
