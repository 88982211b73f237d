// Shared-memory collectives' native core. Each collective runs whole in one
// call (no Python in its loop, the GIL released throughout): a group's
// segment holds, per member, a control block of counters and a *slot* cut
// into a ring of chunks. A member writes the chunk its peers need into its
// ring, publishes it by bumping its ``produced`` counter, reads the peers'
// chunk of the same number straight into its output (reducing as it goes;
// an all-reduce also publishes its reduced piece, ``reduced``) and bumps
// its ``consumed`` counter, which frees that ring position for reuse.
// Chunks are small (hundreds of KiB), so a peer reads a chunk while it is
// still in cache, and the writer runs one chunk ahead of its reads.
// Counters only grow: every member issues the same collectives in the same
// order with the same chunk counts, so chunk numbers agree without a
// barrier between collectives.
//
// A collective whose group checks signatures is preceded by sx_agree: each
// member writes its signature (a few int64 saying what it is about to do)
// into its control block, bumps ``signed``, waits for the others' and
// compares them, then bumps ``checked``; two signature buffers alternate,
// and a member overwrites one only once every peer has checked it.
//
// Every wait checks the peers it waits for: a timeout returns -1, a dead
// peer (process gone or a zombie, checked every 20 ms) -2, with missing[i]
// set for each member at fault. Reductions (fp32, fp64, fp16, bf16, int32,
// int64; sum, max, min) combine the members in segment order; 16-bit floats
// are reduced in fp32 and rounded once, to nearest even, as torch rounds.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "half.h"

namespace {

enum DType { F32 = 0, F64 = 1, F16 = 2, BF16 = 3, I32 = 4, I64 = 5 };
enum Op { SUM = 0, MAX = 1, MIN = 2 };
// Lines of a control block: counters, then two signature buffers.
enum Counter { BARRIER = 0, PRODUCED = 1, CONSUMED = 2, REDUCED = 3, SIGNED = 4, CHECKED = 5 };

constexpr int kLine = 64;
constexpr int kSigWidth = 16;                          // int64 per signature, at most
constexpr int kSigOff = 6 * kLine;                     // the two buffers' offset in a block
constexpr int kSigBytes = kSigWidth * 8;               // one buffer (two lines)
constexpr int kCtlBytes = kSigOff + 2 * kSigBytes;     // one control block per member
constexpr int kMaxMembers = 1024;

// What Python's ``_Segment`` shares with the core (a ctypes.Structure with
// the same fields in the same order).
struct Seg {
  char* base;            // the mapping
  int64_t n, me;         // members, this member's index
  int64_t slot_off;      // offset of member 0's slot
  int64_t slot_bytes;    // bytes between slots
  int64_t chunk_bytes;   // one ring position
  int64_t ring;          // positions per slot (>= 2)
  int64_t table_off;     // all-to-all size tables (two of n * n int64)
  int64_t timeout_us;
  const int64_t* pids;   // members' pids, for liveness
  int32_t* missing;      // out: members at fault after -1 / -2
  uint64_t chunks;       // chunks this member has published so far
  uint64_t barriers;     // barriers so far
  uint64_t signs;        // signatures agreed so far
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline std::atomic<uint64_t>* counter(const Seg* s, int64_t member, int which) {
  return reinterpret_cast<std::atomic<uint64_t>*>(s->base + member * kCtlBytes + which * kLine);
}

inline int64_t* sig_buffer(const Seg* s, int64_t member, uint64_t seq) {
  return reinterpret_cast<int64_t*>(s->base + member * kCtlBytes + kSigOff +
                                    static_cast<int64_t>(seq % 2) * kSigBytes);
}

inline char* slot_chunk(const Seg* s, int64_t member, uint64_t chunk) {
  return s->base + s->slot_off + member * s->slot_bytes +
         static_cast<int64_t>(chunk % static_cast<uint64_t>(s->ring)) * s->chunk_bytes;
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

// Wait until counter ``which`` of every other member reaches ``target``.
// 0, or -1 / -2 with s->missing set (see the top of the file).
int wait_all(const Seg* s, int which, uint64_t target) {
  auto behind = [&](int64_t i) {
    return i != s->me && counter(s, i, which)->load(std::memory_order_acquire) < target;
  };
  auto lagging = [&]() {
    int64_t count = 0;
    for (int64_t i = 0; i < s->n; ++i) count += behind(i);
    return count;
  };
  if (lagging() == 0) return 0;
  const auto start = std::chrono::steady_clock::now();
  int64_t last_check = 0;
  for (uint64_t spin = 0;; ++spin) {
    if (lagging() == 0) return 0;
    if (spin < 256) {
      cpu_relax();
      continue;
    }
    auto waited = std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::steady_clock::now() - start).count();
    if (waited > s->timeout_us) {
      for (int64_t i = 0; i < s->n; ++i) s->missing[i] = behind(i);
      return -1;
    }
    if (s->pids != nullptr && waited / 20000 != last_check) {  // every 20 ms: is anyone dead?
      last_check = waited / 20000;
      int dead = 0;
      for (int64_t i = 0; i < s->n; ++i) {
        s->missing[i] = behind(i) && !alive(s->pids[i]);
        dead += s->missing[i];
      }
      if (dead) return -2;
    }
    if (waited > 1000) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else {
      std::this_thread::yield();
    }
  }
}

int barrier(Seg* s) {
  const uint64_t seq = ++s->barriers;
  counter(s, s->me, BARRIER)->store(seq, std::memory_order_release);
  return wait_all(s, BARRIER, seq);
}

// The chunk pipeline shared by every collective: for t in [0, k), publish
// chunk t (``put``: fill this member's ring position), then read chunk t of
// the peers (``get``: 0, or an error to return), one chunk behind the
// writes. A ring position is refilled only once every member has read it.
template <typename Put, typename Get>
int pipeline(Seg* s, int64_t k, Put put, Get get) {
  const uint64_t base = s->chunks;
  const uint64_t ring = static_cast<uint64_t>(s->ring);
  for (int64_t t = 0; t <= k; ++t) {
    if (t < k) {
      const uint64_t g = base + t;
      if (g >= ring) {
        int rc = wait_all(s, CONSUMED, g - ring + 1);
        if (rc) return rc;
      }
      put(t, g);
      counter(s, s->me, PRODUCED)->store(g + 1, std::memory_order_release);
      s->chunks = g + 1;
    }
    if (t >= 1) {
      const uint64_t g = base + t - 1;
      int rc = wait_all(s, PRODUCED, g + 1);
      if (!rc) rc = get(t - 1, g);
      if (rc) return rc;
      counter(s, s->me, CONSUMED)->store(g + 1, std::memory_order_release);
    }
  }
  return 0;
}

// --- reductions ------------------------------------------------------------------

using sx::bf16_to_f32;
using sx::f16_to_f32;
using sx::f32_to_bf16;
using sx::f32_to_f16;

template <typename T>
inline T combine(T a, T b, int op) {
  if (op == SUM) return a + b;
  if (op == MAX) return a > b ? a : b;
  return a < b ? a : b;
}

// dst[i] = srcs[0][i] op srcs[1][i] op ... (left to right, in T; 16-bit
// floats in fp32, rounded once), a block at a time so that each pass is a
// plain vectorisable loop. dst may be one of the sources (in place): with
// more than two, the block is combined aside and then stored.
template <typename T, int OP>
void reduce_block(T* dst, const T* const* srcs, int n, int64_t count) {
  constexpr int64_t kBlock = 1024;
  T acc[kBlock];
  for (int64_t lo = 0; lo < count; lo += kBlock) {
    const int64_t len = std::min(kBlock, count - lo);
    const T* a = srcs[0] + lo;
    if (n == 1) {
      std::memmove(dst + lo, a, len * sizeof(T));
      continue;
    }
    const T* b = srcs[1] + lo;
    if (n == 2) {  // one pass, element by element: in place is fine
      for (int64_t i = 0; i < len; ++i) dst[lo + i] = combine<T>(a[i], b[i], OP);
      continue;
    }
    for (int64_t i = 0; i < len; ++i) acc[i] = combine<T>(a[i], b[i], OP);
    for (int j = 2; j < n; ++j) {
      const T* c = srcs[j] + lo;
      for (int64_t i = 0; i < len; ++i) acc[i] = combine<T>(acc[i], c[i], OP);
    }
    std::memcpy(dst + lo, acc, len * sizeof(T));
  }
}

template <float (*Load)(uint16_t), uint16_t (*Store)(float), int OP>
void reduce_half_block(uint16_t* dst, const uint16_t* const* srcs, int n, int64_t count) {
  constexpr int64_t kBlock = 1024;
  float acc[kBlock];
  for (int64_t lo = 0; lo < count; lo += kBlock) {
    const int64_t len = std::min(kBlock, count - lo);
    const uint16_t* a = srcs[0] + lo;
    for (int64_t i = 0; i < len; ++i) acc[i] = Load(a[i]);
    for (int j = 1; j < n; ++j) {
      const uint16_t* b = srcs[j] + lo;
      for (int64_t i = 0; i < len; ++i) acc[i] = combine<float>(acc[i], Load(b[i]), OP);
    }
    uint16_t* d = dst + lo;
    for (int64_t i = 0; i < len; ++i) d[i] = Store(acc[i]);
  }
}

template <typename T>
void reduce_typed(T* dst, const T* const* srcs, int n, int64_t count, int op) {
  if (op == SUM) reduce_block<T, SUM>(dst, srcs, n, count);
  else if (op == MAX) reduce_block<T, MAX>(dst, srcs, n, count);
  else reduce_block<T, MIN>(dst, srcs, n, count);
}

template <float (*Load)(uint16_t), uint16_t (*Store)(float)>
void reduce_half(uint16_t* dst, const uint16_t* const* srcs, int n, int64_t count, int op) {
  if (op == SUM) reduce_half_block<Load, Store, SUM>(dst, srcs, n, count);
  else if (op == MAX) reduce_half_block<Load, Store, MAX>(dst, srcs, n, count);
  else reduce_half_block<Load, Store, MIN>(dst, srcs, n, count);
}

int itemsize(int dtype) {
  switch (dtype) {
    case F32: case I32: return 4;
    case F64: case I64: return 8;
    case F16: case BF16: return 2;
    default: return 0;
  }
}

// dst[i] = op over j of srcs[j][i] for ``count`` elements, several threads
// for large counts. False for a dtype/op it does not know.
bool reduce(void* dst, const void* const* srcs, int n, int64_t count, int dtype, int op) {
  if (op < SUM || op > MIN || n < 1 || itemsize(dtype) == 0) return false;
  const int64_t block = 1 << 16;  // elements per parallel task
  const int64_t tasks = (count + block - 1) / block;
#pragma omp parallel for schedule(static) if (tasks > 4)
  for (int64_t b = 0; b < tasks; ++b) {
    const int64_t lo = b * block, len = std::min(block, count - lo);
    const int64_t off = lo * itemsize(dtype);
    const void* part[kMaxMembers];
    for (int j = 0; j < n; ++j) part[j] = static_cast<const char*>(srcs[j]) + off;
    void* d = static_cast<char*>(dst) + off;
    switch (dtype) {
      case F32: reduce_typed(static_cast<float*>(d), reinterpret_cast<const float* const*>(part), n, len, op); break;
      case F64: reduce_typed(static_cast<double*>(d), reinterpret_cast<const double* const*>(part), n, len, op); break;
      case I32: reduce_typed(static_cast<int32_t*>(d), reinterpret_cast<const int32_t* const*>(part), n, len, op); break;
      case I64: reduce_typed(static_cast<int64_t*>(d), reinterpret_cast<const int64_t* const*>(part), n, len, op); break;
      case F16: reduce_half<f16_to_f32, f32_to_f16>(static_cast<uint16_t*>(d), reinterpret_cast<const uint16_t* const*>(part), n, len, op); break;
      case BF16: reduce_half<bf16_to_f32, f32_to_bf16>(static_cast<uint16_t*>(d), reinterpret_cast<const uint16_t* const*>(part), n, len, op); break;
    }
  }
  return true;
}

// Copy ``nbytes`` with several threads when large.
void copy(void* dst, const void* src, int64_t nbytes) {
  if (nbytes <= 0 || dst == src) return;
  const int64_t block = 1 << 20;
  const int64_t blocks = (nbytes + block - 1) / block;
#pragma omp parallel for schedule(static) if (blocks > 4)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t off = b * block;
    const int64_t len = std::min(block, nbytes - off);
    std::memcpy(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off, len);
  }
}

// An output at least this large is written with streaming stores: it
// cannot stay in the caches for whoever reads it next (half of a common
// 32 MiB L3; the sizes a VM reports are the host's, so none is asked).
constexpr int64_t kStreamBytes = int64_t{16} << 20;

// Copy ``nbytes`` (one thread: the callers copy a ring chunk at a time);
// with ``stream``, into memory not read again soon (a large output, see
// kStreamBytes) with streaming stores where the CPU has them — which write
// whole lines without first reading them for ownership, a third less
// memory traffic than a plain copy's — fenced, so that the bytes are
// visible to whoever is told next that they are there.
void copy_out(void* dst, const void* src, int64_t nbytes, bool stream) {
  if (nbytes <= 0 || dst == src) return;
#if defined(__SSE2__)
  if (stream && nbytes >= 256) {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    const int64_t head = static_cast<int64_t>((-reinterpret_cast<uintptr_t>(d)) & 63);
    std::memcpy(d, s, head);
    d += head, s += head, nbytes -= head;
    for (; nbytes >= 64; d += 64, s += 64, nbytes -= 64) {
#if defined(__AVX__)
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d), a);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32), b);
#else
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
#endif
    }
    std::memcpy(d, s, nbytes);
    _mm_sfence();
    return;
  }
#endif
  std::memcpy(dst, src, nbytes);
}

// Where sender ``s`` puts its piece for member ``d`` (d != s) in a chunk cut
// into n - 1 pieces.
inline int64_t piece(int64_t s, int64_t d) { return d < s ? d : d - 1; }

bool valid(const Seg* s) { return s->n >= 1 && s->n <= kMaxMembers && s->ring >= 2; }

}  // namespace

extern "C" {

// Meet every member. 0, -1 (timeout) or -2 (a dead member); see the top.
int sx_barrier(Seg* s) { return barrier(s); }

// Agree on the next collective: publish this member's signature ``sig``
// (``width`` int64), wait for every member's, copy them all into ``table``
// (n rows of ``width``, segment order) and compare their first ``agreed``
// fields with this member's. 0 when they all agree, -5 when some differ
// (every member sees every row, so all of them return -5 and none moves
// data: the segment stays in step), -1 / -2 as for any wait, -3 for a
// width the block has no room for.
int sx_agree(Seg* s, const int64_t* sig, int64_t width, int64_t agreed, int64_t* table) {
  if (!valid(s) || width < 1 || width > kSigWidth || agreed < 0 || agreed > width) return -3;
  const uint64_t seq = ++s->signs;
  if (seq > 2) {  // this buffer last held signature seq - 2: has everyone checked it?
    int rc = wait_all(s, CHECKED, seq - 2);
    if (rc) return rc;
  }
  std::memcpy(sig_buffer(s, s->me, seq), sig, width * 8);
  counter(s, s->me, SIGNED)->store(seq, std::memory_order_release);
  int rc = wait_all(s, SIGNED, seq);
  if (rc) return rc;
  bool same = true;
  for (int64_t j = 0; j < s->n; ++j) {
    const int64_t* row = j == s->me ? sig : sig_buffer(s, j, seq);
    std::memcpy(table + j * width, row, width * 8);
    for (int64_t f = 0; f < agreed; ++f) same = same && row[f] == sig[f];
  }
  counter(s, s->me, CHECKED)->store(seq, std::memory_order_release);
  return same ? 0 : -5;
}

// dst[i] = op over j of srcs[j][i], for ``count`` elements (a building block,
// exported for tests). Returns 0, or -1 for a dtype/op it does not know.
int sx_reduce(void* dst, const void* const* srcs, int n, int64_t count, int dtype, int op) {
  return n <= kMaxMembers && reduce(dst, srcs, n, count, dtype, op) ? 0 : -1;
}

// out ← op over members of their x (``count`` elements; out may be x), as a
// reduce-scatter then an all-gather of each chunk: the chunk is cut into one
// piece per member; each member puts the pieces the others reduce into its
// ring, reduces its own piece (its input read directly, the others' from
// their rings, in member order) straight into out, puts that result into
// its ring too, and copies the others' results into out. 0, -1, -2, or -3
// for a dtype/op the core does not know.
int sx_all_reduce(Seg* s, void* out, const void* x, int64_t count, int dtype, int op) {
  const int size = itemsize(dtype);
  if (!valid(s) || size == 0 || op < SUM || op > MIN) return -3;
  const int n = static_cast<int>(s->n);
  const int64_t me = s->me;
  const int64_t p = s->chunk_bytes / n / size;  // elements of one member's piece
  if (p < 1) return -3;
  const int64_t per = n * p;
  const int64_t k = (count + per - 1) / per;
  const char* in = static_cast<const char*>(x);
  char* dst = static_cast<char*>(out);
  const int64_t result_off = (n - 1) * p * size;
  auto range = [&](int64_t t, int64_t j, int64_t* lo) {
    const int64_t span = std::min(per, count - t * per), q = (span + n - 1) / n;
    *lo = t * per + std::min(span, j * q);
    return std::max<int64_t>(0, std::min(span, (j + 1) * q) - j * q);
  };
  const void* srcs[kMaxMembers];
  return pipeline(
      s, k,
      [&](int64_t t, uint64_t g) {
        char* chunk = slot_chunk(s, me, g);
        int64_t lo;
        for (int64_t d = 0; d < n; ++d)
          if (d != me) {
            const int64_t len = range(t, d, &lo);
            copy(chunk + piece(me, d) * p * size, in + lo * size, len * size);
          }
      },
      [&](int64_t t, uint64_t g) {
        int64_t lo;
        const int64_t len = range(t, me, &lo);
        for (int64_t j = 0; j < n; ++j)
          srcs[j] = j == me ? in + lo * size : slot_chunk(s, j, g) + piece(j, me) * p * size;
        reduce(dst + lo * size, srcs, n, len, dtype, op);
        copy(slot_chunk(s, me, g) + result_off, dst + lo * size, len * size);
        counter(s, me, REDUCED)->store(g + 1, std::memory_order_release);
        int rc = wait_all(s, REDUCED, g + 1);
        if (rc) return rc;
        for (int64_t j = 0; j < n; ++j)
          if (j != me) {
            const int64_t l = range(t, j, &lo);
            copy(dst + lo * size, slot_chunk(s, j, g) + result_off, l * size);
          }
        return 0;
      });
}

// out row rows[j] ← member j's x (``nbytes`` each), for every member j.
int sx_all_gather(Seg* s, void* out, const void* x, int64_t nbytes, const int64_t* rows) {
  if (!valid(s)) return -3;
  const int64_t per = s->chunk_bytes;
  const int64_t k = (nbytes + per - 1) / per;
  auto span = [&](int64_t t) { return std::min(per, nbytes - t * per); };
  return pipeline(
      s, k,
      [&](int64_t t, uint64_t g) {
        copy(slot_chunk(s, s->me, g), static_cast<const char*>(x) + t * per, span(t));
      },
      [&](int64_t t, uint64_t g) {
        for (int64_t j = 0; j < s->n; ++j) {
          const char* src =
              j == s->me ? static_cast<const char*>(x) + t * per : slot_chunk(s, j, g);
          copy(static_cast<char*>(out) + rows[j] * nbytes + t * per, src, span(t));
        }
        return 0;
      });
}

// out ← op over members of their row rows[me] of x (``count`` elements per
// row; row rows[j] is for member j). Only the n - 1 rows the others need go
// through the ring; this member's own row is read directly.
int sx_reduce_scatter(Seg* s, void* out, const void* x, int64_t count, const int64_t* rows,
                      int dtype, int op) {
  const int size = itemsize(dtype);
  if (!valid(s) || size == 0 || op < SUM || op > MIN) return -3;
  const int n = static_cast<int>(s->n);
  const int64_t per = n > 1 ? s->chunk_bytes / (n - 1) / size : std::max<int64_t>(count, 1);
  if (per < 1) return -3;
  const int64_t k = (count + per - 1) / per;
  const int64_t me = s->me;
  const int64_t row_bytes = count * size;
  const char* in = static_cast<const char*>(x);
  const void* srcs[kMaxMembers];
  auto span = [&](int64_t t) { return std::min(per, count - t * per); };
  return pipeline(
      s, k,
      [&](int64_t t, uint64_t g) {
        char* chunk = slot_chunk(s, me, g);
        for (int64_t d = 0; d < n; ++d)
          if (d != me)
            copy(chunk + piece(me, d) * per * size, in + rows[d] * row_bytes + t * per * size,
                 span(t) * size);
      },
      [&](int64_t t, uint64_t g) {
        for (int64_t j = 0; j < n; ++j)
          srcs[j] = j == me ? in + rows[me] * row_bytes + t * per * size
                            : slot_chunk(s, j, g) + piece(j, me) * per * size;
        reduce(static_cast<char*>(out) + t * per * size, srcs, n, span(t), dtype, op);
        return 0;
      });
}

// x ← member root's x (``nbytes``).
int sx_broadcast(Seg* s, void* x, int64_t nbytes, int64_t root) {
  if (!valid(s)) return -3;
  const int64_t per = s->chunk_bytes;
  const int64_t k = (nbytes + per - 1) / per;
  auto span = [&](int64_t t) { return std::min(per, nbytes - t * per); };
  return pipeline(
      s, k,
      [&](int64_t t, uint64_t g) {
        if (s->me == root) copy(slot_chunk(s, root, g), static_cast<char*>(x) + t * per, span(t));
      },
      [&](int64_t t, uint64_t g) {
        if (s->me != root) copy(static_cast<char*>(x) + t * per, slot_chunk(s, root, g), span(t));
        return 0;
      });
}

// Bytes x[send_off[d] : + send_len[d]] go to member d, and member j's bytes
// for this member land at out[recv_off[j] :]. The members first publish
// their send sizes (a table) and check them against recv_len: -4 (with
// got[j], what member j sends) when they disagree. ``size`` is the element
// size: pieces are cut on element boundaries.
//
// Each byte is copied once into the sender's ring and once out of it (its
// own piece once, straight from x): per chunk, a member puts its pieces for
// the others into its ring, copies the same chunk of its own piece, then
// reads the others' pieces for it — its own copy giving them time to
// publish theirs, so that no member waits on another with nothing to do.
// A large output is written with streaming stores (copy_out).
int sx_all_to_all(Seg* s, void* out, const void* x, const int64_t* send_off,
                  const int64_t* send_len, const int64_t* recv_off, const int64_t* recv_len,
                  int64_t size, int64_t* got) {
  if (!valid(s) || size < 1) return -3;
  const int64_t n = s->n, me = s->me;
  // Two tables, alternating: a fast member writes the next one while a slow
  // one may still read this one.
  int64_t* table = reinterpret_cast<int64_t*>(s->base + s->table_off) + (s->barriers % 2) * n * n;
  for (int64_t d = 0; d < n; ++d) table[me * n + d] = send_len[d];
  int rc = barrier(s);
  if (rc) return rc;
  int64_t most = 0;
  bool agree = true;
  for (int64_t j = 0; j < n; ++j) {
    got[j] = table[j * n + me];
    agree = agree && (j == me || got[j] == recv_len[j]);
    for (int64_t d = 0; d < n; ++d)
      if (d != j) most = std::max(most, table[j * n + d]);
  }
  if (!agree) return -4;
  char* const dst = static_cast<char*>(out);
  const char* const src = static_cast<const char*>(x);
  int64_t total = 0;  // this member's output
  for (int64_t j = 0; j < n; ++j) total += recv_len[j];
  const bool stream = total >= kStreamBytes;
  if (n == 1) {
    copy_out(dst + recv_off[me], src + send_off[me], send_len[me], stream);
    return 0;
  }
  const int64_t per = s->chunk_bytes / (n - 1) / size * size;  // bytes per piece per chunk
  if (per < 1) return -3;
  const int64_t k = (most + per - 1) / per;  // the same on every member: from the table
  auto span = [&](int64_t len, int64_t t) {
    return std::max<int64_t>(0, std::min(per, len - t * per));
  };
  rc = pipeline(
      s, k,
      [&](int64_t t, uint64_t g) {
        char* chunk = slot_chunk(s, me, g);
        for (int64_t d = 0; d < n; ++d)
          if (d != me)
            std::memcpy(chunk + piece(me, d) * per, src + send_off[d] + t * per,
                        span(send_len[d], t));
        copy_out(dst + recv_off[me] + t * per, src + send_off[me] + t * per,
                 span(send_len[me], t), stream);
      },
      [&](int64_t t, uint64_t g) {
        for (int64_t j = 0; j < n; ++j)
          if (j != me)
            copy_out(dst + recv_off[j] + t * per, slot_chunk(s, j, g) + piece(j, me) * per,
                     span(recv_len[j], t), stream);
        return 0;
      });
  if (rc) return rc;
  // what of this member's own piece lies beyond the others' longest
  const int64_t done = std::min(send_len[me], k * per);
  copy_out(dst + recv_off[me] + done, src + send_off[me] + done, send_len[me] - done, stream);
  return 0;
}

// The control block's size (the segment layout Python builds must agree).
int64_t sx_control_bytes() { return kCtlBytes; }

}  // extern "C"
