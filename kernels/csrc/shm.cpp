// Shared-memory collectives' native core: a barrier over per-rank counters
// in a shared segment, and elementwise reductions of several buffers into
// one (fp32, fp64, fp16, bf16, int32, int64; sum, max, min), OpenMP-parallel
// and vectorised by the compiler. 16-bit floats are reduced in fp32 and
// rounded once, to nearest even, as torch rounds.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>

namespace {

enum DType { F32 = 0, F64 = 1, F16 = 2, BF16 = 3, I32 = 4, I64 = 5 };
enum Op { SUM = 0, MAX = 1, MIN = 2 };

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; man <<= 1; } while ((man & 0x400u) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint32_t sign = (bits >> 16) & 0x8000u;
  uint32_t absb = bits & 0x7fffffffu;
  if (absb > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (absb >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow → inf
  if (absb < 0x38800000u) {  // subnormal or zero in half
    if (absb < 0x33000000u) return static_cast<uint16_t>(sign);  // below half the least subnormal
    uint32_t e = absb >> 23;
    uint32_t m = (absb & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;  // 113 + 13 - e
    uint32_t half = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t e = (absb >> 23) - 127 + 15;
  uint32_t m = absb & 0x7fffffu;
  uint32_t half = (e << 10) | (m >> 13);
  uint32_t rem = m & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(sign | half);
}

template <typename T>
inline T combine(T a, T b, int op) {
  if (op == SUM) return a + b;
  if (op == MAX) return a > b ? a : b;
  return a < b ? a : b;
}

template <typename T>
void reduce_native(T* dst, const T* const* srcs, int n, int64_t count, int op) {
#pragma omp parallel for schedule(static) if (count > 65536)
  for (int64_t i = 0; i < count; ++i) {
    T acc = srcs[0][i];
    for (int j = 1; j < n; ++j) acc = combine(acc, srcs[j][i], op);
    dst[i] = acc;
  }
}

template <float (*Load)(uint16_t), uint16_t (*Store)(float)>
void reduce_half(uint16_t* dst, const uint16_t* const* srcs, int n, int64_t count, int op) {
#pragma omp parallel for schedule(static) if (count > 65536)
  for (int64_t i = 0; i < count; ++i) {
    float acc = Load(srcs[0][i]);
    for (int j = 1; j < n; ++j) acc = combine(acc, Load(srcs[j][i]), op);
    dst[i] = Store(acc);
  }
}

// Whether process ``pid`` runs (not gone, not a zombie): /proc/<pid>/stat.
bool alive(int64_t pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", static_cast<long long>(pid));
  std::FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[512];
  size_t len = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[len] = 0;
  const char* close = std::strrchr(buf, ')');
  if (close == nullptr || close[1] == 0 || close[2] == 0) return true;
  return close[2] != 'Z' && close[2] != 'X';
}

}  // namespace

extern "C" {

// Wait until every rank's counter reaches ``seq`` after setting ours to it.
// Counters sit ``stride`` bytes apart from ``flags``. Returns 0; -1 after
// ``timeout_us`` with missing[i] = 1 for each rank that did not arrive; or
// -2 as soon as a rank that has not arrived is dead (pids[i] gone or a
// zombie), with missing[i] = 1 for the dead ones.
int sx_barrier(void* flags, int stride, int n, int me, uint64_t seq, int64_t timeout_us,
               int* missing, const int64_t* pids) {
  auto counter = [&](int i) {
    return reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(flags) + int64_t(i) * stride);
  };
  counter(me)->store(seq, std::memory_order_release);
  const auto start = std::chrono::steady_clock::now();
  int64_t last_check = 0;
  for (uint64_t spin = 0;; ++spin) {
    int behind = 0;
    for (int i = 0; i < n; ++i) behind += counter(i)->load(std::memory_order_acquire) < seq;
    if (behind == 0) return 0;
    if (spin < 256) {
      cpu_relax();
      continue;
    }
    auto waited = std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::steady_clock::now() - start).count();
    if (waited > timeout_us) {
      for (int i = 0; i < n; ++i) missing[i] = counter(i)->load(std::memory_order_acquire) < seq;
      return -1;
    }
    if (pids != nullptr && waited / 20000 != last_check) {  // every 20 ms: is anyone dead?
      last_check = waited / 20000;
      int dead = 0;
      for (int i = 0; i < n; ++i) {
        missing[i] = counter(i)->load(std::memory_order_acquire) < seq && !alive(pids[i]);
        dead += missing[i];
      }
      if (dead) return -2;
    }
    if (waited > 2000) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else {
      std::this_thread::yield();
    }
  }
}

// dst[i] = op over j of srcs[j][i], for ``count`` elements. Returns 0, or -1
// for a dtype/op it does not know (the caller must not use dst then).
int sx_reduce(void* dst, void** srcs, int n, int64_t count, int dtype, int op) {
  if (op < SUM || op > MIN || n < 1) return -1;
  switch (dtype) {
    case F32: reduce_native(static_cast<float*>(dst), reinterpret_cast<const float* const*>(srcs), n, count, op); return 0;
    case F64: reduce_native(static_cast<double*>(dst), reinterpret_cast<const double* const*>(srcs), n, count, op); return 0;
    case I32: reduce_native(static_cast<int32_t*>(dst), reinterpret_cast<const int32_t* const*>(srcs), n, count, op); return 0;
    case I64: reduce_native(static_cast<int64_t*>(dst), reinterpret_cast<const int64_t* const*>(srcs), n, count, op); return 0;
    case F16: reduce_half<f16_to_f32, f32_to_f16>(static_cast<uint16_t*>(dst), reinterpret_cast<const uint16_t* const*>(srcs), n, count, op); return 0;
    case BF16: reduce_half<bf16_to_f32, f32_to_bf16>(static_cast<uint16_t*>(dst), reinterpret_cast<const uint16_t* const*>(srcs), n, count, op); return 0;
    default: return -1;
  }
}

// Copy ``nbytes`` from src to dst with several threads (large buffers).
void sx_copy(void* dst, const void* src, int64_t nbytes) {
  const int64_t block = 1 << 20;
  const int64_t blocks = (nbytes + block - 1) / block;
#pragma omp parallel for schedule(static) if (blocks > 4)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t off = b * block;
    const int64_t len = off + block <= nbytes ? block : nbytes - off;
    std::memcpy(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off, len);
  }
}

}  // extern "C"
