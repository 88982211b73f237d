// Fused optimizer steps on CPU: one pass per element over the gradient, the
// state and the parameter — every leaf of a step in one call, one
// OpenMP-parallel region split evenly across leaf boundaries — with the
// arithmetic of shardax.optim's reference transforms in the same order, each
// operation rounded as written (built with -ffp-contract=off; where torch's kernels
// fuse a multiply-add — lerp, addcmul, add with alpha — so does this, with
// std::fma). torch's vectorised sqrt is not always correctly rounded, so
// results agree with the reference to about an ulp.
//
// Every kernel computes the update u of one element (the learning rate
// applied, as optax's updates) and then, in the same pass, either
//   out[i] = u                          (apply = 0: the functional update), or
//   out[i] = p[i] + u                   (apply = 1: the step; out may be p),
// and, when ``shadow`` is given, writes out[i] rounded to fp16/bf16 there
// too (fp32 master weights and their low-precision params in one pass).
// Gradients may be fp32, fp16 or bf16 (widened exactly, as torch's cast).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "half.h"

namespace {

enum DType { F32 = 0, F16 = 2, BF16 = 3 };

// torch's lerp: fma(w, end - start, start) for |w| < 0.5, else
// fma(-(end - start), 1 - w, end).
inline float lerp(float start, float end, float w) {
  return std::fabs(w) < 0.5f ? std::fma(w, end - start, start)
                             : std::fma(-(end - start), 1.0f - w, end);
}

template <int T>
inline float load(const void* x, int64_t i) {
  if constexpr (T == BF16) return sx::bf16_to_f32(static_cast<const uint16_t*>(x)[i]);
  if constexpr (T == F16) return sx::f16_to_f32(static_cast<const uint16_t*>(x)[i]);
  return static_cast<const float*>(x)[i];
}

template <int T>
inline void store_shadow(void* x, int64_t i, float v) {
  if constexpr (T == BF16) static_cast<uint16_t*>(x)[i] = sx::f32_to_bf16(v);
  if constexpr (T == F16) static_cast<uint16_t*>(x)[i] = sx::f32_to_f16(v);
}

// One tensor's worth of a step, as the caller lays it out (9 int64 per
// leaf): the two state buffers (Adam: mu, nu; the one-buffer kernels: the
// buffer read and the one written, which may be the same), the gradient and
// its dtype, the param (0: none), where the result goes, the shadow (0:
// none) and its dtype, and the element count.
struct Leaf {
  int64_t s0, s1, g, g_type, p, out, shadow, shadow_type, n;
};
static_assert(sizeof(Leaf) == 9 * sizeof(int64_t), "Leaf is 9 int64");

template <class T>
inline T* at(int64_t address) {
  return reinterpret_cast<T*>(static_cast<intptr_t>(address));
}

// Everything a loop calls is inlined into it (the rule, the conversions): a
// call left in the loop body keeps it from being vectorised, and with dozens
// of instantiations GCC's inlining budget otherwise runs out.
#if defined(__GNUC__) || defined(__clang__)
#define SX_FLATTEN __attribute__((flatten))
#else
#define SX_FLATTEN
#endif

// Software prefetch: the loop streams four arrays at once, more than the
// hardware prefetchers keep far enough ahead on their own; asking for each
// stream's lines kAhead elements ahead, into L2 (locality 2: a few percent
// better than into L1 here), made the memory-bound step ~10 % faster on this
// host. Addresses are computed as integers (a prefetch past the end of an
// array is harmless, pointer arithmetic there is not).
constexpr int64_t kBlock = 64;   // elements per round of prefetches
constexpr int64_t kAhead = 512;  // how far ahead, in elements (2 KiB of fp32)

template <class T>
inline void ahead(const void* x, int64_t j, int write) {
#if defined(__GNUC__) || defined(__clang__)
  const uintptr_t base = reinterpret_cast<uintptr_t>(x) + (j + kAhead) * sizeof(T);
  for (uintptr_t k = 0; k < kBlock * sizeof(T); k += 64) {
    const void* line = reinterpret_cast<const void*>(base + k);
    if (write) {
      __builtin_prefetch(line, 1, 2);
    } else {
      __builtin_prefetch(line, 0, 2);
    }
  }
#else
  (void)x, (void)j, (void)write;
#endif
}

// One leaf's elements [begin, end): u = rule(s0, s1, p, i, g_i, decay),
// then the result (see the top of the file).
template <int G, int S, bool Apply, class Decay, class Rule>
SX_FLATTEN void span(const Leaf& leaf, int64_t begin, int64_t end, const Rule& rule_) {
  // Private copies: the loop's stores cannot alias them, so the compiler
  // keeps the scalars and pointers in registers and vectorises the loop.
  const Rule rule = rule_;
  float* const s0 = at<float>(leaf.s0);
  float* const s1 = at<float>(leaf.s1);
  const void* const g = at<const void>(leaf.g);
  const float* const p = at<const float>(leaf.p);
  float* const out = at<float>(leaf.out);
  void* const shadow = at<void>(leaf.shadow);
  for (int64_t j = begin; j < end; j += kBlock) {
    ahead<float>(s0, j, 1);
    ahead<float>(s1, j, 1);
    ahead<std::conditional_t<G == F32, float, uint16_t>>(g, j, 0);
    if (p != nullptr) ahead<float>(p, j, 1);
    const int64_t stop = end - j < kBlock ? end : j + kBlock;
#pragma omp simd
    for (int64_t i = j; i < stop; ++i) {
      const float u = rule(s0, s1, p, i, load<G>(g, i), Decay{});
      const float o = Apply ? p[i] + u : u;
      out[i] = o;
      if constexpr (S != F32) store_shadow<S>(shadow, i, o);
    }
  }
}

template <int G, int S, class Decay, class Rule>
void by_apply(const Leaf& leaf, int64_t b, int64_t e, bool apply, const Rule& rule) {
  if (apply) return span<G, S, true, Decay>(leaf, b, e, rule);
  span<G, S, false, Decay>(leaf, b, e, rule);
}

template <int G, class Decay, class Rule>
void by_shadow(const Leaf& leaf, int64_t b, int64_t e, bool apply, const Rule& rule) {
  if (leaf.shadow == 0) return by_apply<G, F32, Decay>(leaf, b, e, apply, rule);
  if (leaf.shadow_type == BF16) return by_apply<G, BF16, Decay>(leaf, b, e, apply, rule);
  by_apply<G, F16, Decay>(leaf, b, e, apply, rule);
}

template <class Decay, class Rule>
void by_grad(const Leaf& leaf, int64_t b, int64_t e, bool apply, const Rule& rule) {
  if (leaf.g_type == BF16) return by_shadow<BF16, Decay>(leaf, b, e, apply, rule);
  if (leaf.g_type == F16) return by_shadow<F16, Decay>(leaf, b, e, apply, rule);
  by_shadow<F32, Decay>(leaf, b, e, apply, rule);
}

// Elements a thread takes at a time (a multiple of 16: a cache line of
// floats). The threads take chunks as they finish the last, not an equal
// share each: on a busy host one descheduled thread would otherwise hold
// up the whole step.
constexpr int64_t kChunk = int64_t{1} << 15;

template <class Decay, class Rule>
void chunk(const Leaf* leaves, const std::vector<int64_t>& starts, int64_t lo, int64_t hi,
           bool apply, const Rule& rule) {
  const int64_t count = static_cast<int64_t>(starts.size()) - 1;
  // the first leaf ending after lo
  int64_t k = std::upper_bound(starts.begin() + 1, starts.end(), lo) - (starts.begin() + 1);
  for (; k < count && starts[k] < hi; ++k) {
    const int64_t b = lo > starts[k] ? lo - starts[k] : 0;
    const int64_t e = hi - starts[k] < leaves[k].n ? hi - starts[k] : leaves[k].n;
    if (b < e) by_grad<Decay>(leaves[k], b, e, apply, rule);
  }
}

// Run ``rule`` over every element of ``count`` leaves in one parallel
// region, their concatenated elements cut in chunks that the threads take
// in turn (no barrier per leaf); 0, or -1 for a leaf whose dtypes it does
// not know or that lacks the param it needs (decay, or apply).
template <class Rule>
int run(const Leaf* leaves, int64_t count, int apply, bool decay, const Rule& rule) {
  std::vector<int64_t> starts(static_cast<size_t>(count) + 1, 0);
  for (int64_t k = 0; k < count; ++k) {
    const Leaf& l = leaves[k];
    const bool grad_ok = l.g_type == F32 || l.g_type == BF16 || l.g_type == F16;
    const bool shadow_ok = l.shadow == 0 || l.shadow_type == BF16 || l.shadow_type == F16;
    if (!grad_ok || !shadow_ok || l.n < 0 || ((apply || decay) && l.p == 0)) return -1;
    starts[k + 1] = starts[k] + l.n;
  }
  const int64_t total = starts[count];
  const int64_t chunks = (total + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(dynamic, 1) if (total > 65536)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * kChunk, hi = total - lo < kChunk ? total : lo + kChunk;
    if (decay) {
      chunk<std::true_type>(leaves, starts, lo, hi, apply != 0, rule);
    } else {
      chunk<std::false_type>(leaves, starts, lo, hi, apply != 0, rule);
    }
  }
  return 0;
}

// g / (sqrt(v) + eps) · neg_lr, rounded step by step as the reference.
inline float scaled(float g, float v, float eps, float neg_lr) {
  float d = std::sqrt(v);
  d = d + eps;
  return (g / d) * neg_lr;
}

}  // namespace

extern "C" {

// Use ``n`` threads in this thread's next kernels (torch's count: a rank
// that set torch.set_num_threads gets as many here).
void sx_threads(int n) {
#ifdef _OPENMP
  if (n > 0) omp_set_num_threads(n);
#else
  (void)n;
#endif
}

}  // extern "C"

namespace {

// Adam's update, the weight decay decoupled (AdamW) or, with ``L2``, added
// to the gradient first (Adam's L2): see sx_adamw and sx_adam_l2.
template <bool L2>
int adam(const Leaf* leaves, int64_t count, int apply, double w1_, double b2_, double w2_,
         double sbc2_, double eps_, double inv_bc1_, double wd_, double neg_lr_) {
  const float w1 = static_cast<float>(w1_), fb2 = static_cast<float>(b2_);
  const float w2 = static_cast<float>(w2_), sbc2 = static_cast<float>(sbc2_);
  const float eps = static_cast<float>(eps_), inv_bc1 = static_cast<float>(inv_bc1_);
  const float wd = static_cast<float>(wd_), neg_lr = static_cast<float>(neg_lr_);
  return run(leaves, count, apply, wd_ != 0.0,
             [=](float* mu, float* nu, const float* p, int64_t i, float gi, auto with_decay) {
               constexpr bool decay = decltype(with_decay)::value;
               if constexpr (decay && L2) gi = std::fma(wd, p[i], gi);
               const float m = lerp(mu[i], gi, w1);
               const float v = std::fma(w2 * gi, gi, nu[i] * fb2);
               float d = std::sqrt(v);
               d = d / sbc2;
               d = d + eps;
               float u = (1.0f / (d / m)) * inv_bc1;
               if constexpr (decay && !L2) u = std::fma(wd, p[i], u);
               mu[i] = m;
               nu[i] = v;
               return u * neg_lr;
             });
}

}  // namespace

// Every kernel steps ``count`` leaves (see Leaf: s0 and s1 are named in each
// kernel's comment) in one parallel region, with ``apply`` as at the top of
// the file, and returns 0, or -1 for arguments it does not know.
extern "C" {

// AdamW (adamw: scale_by_adam, add_decayed_weights, scale_by_learning_rate),
// s0 = mu, s1 = nu:
//   mu ← lerp(mu, g, w1)                      (in place)
//   nu ← fma(w2·g, g, nu·b2)                  (in place)
//   d  ← sqrt(nu) / sbc2 + eps
//   u  ← (1 / (d / mu)) · inv_bc1
//   u  ← fma(wd, p, u)          when wd ≠ 0
//   u  ← u · neg_lr
// with the scalars computed by the caller as the reference computes them, in
// double, and rounded to float here.
int sx_adamw(const Leaf* leaves, int64_t count, int apply, double w1, double b2, double w2,
             double sbc2, double eps, double inv_bc1, double wd, double neg_lr) {
  return adam<false>(leaves, count, apply, w1, b2, w2, sbc2, eps, inv_bc1, wd, neg_lr);
}

// Adam with L2 (adam: [add_decayed_weights], scale_by_adam,
// scale_by_learning_rate): g ← fma(wd, p, g) when wd ≠ 0, then AdamW's
// update without its decoupled decay.
int sx_adam_l2(const Leaf* leaves, int64_t count, int apply, double w1, double b2, double w2,
               double sbc2, double eps, double inv_bc1, double wd, double neg_lr) {
  return adam<true>(leaves, count, apply, w1, b2, w2, sbc2, eps, inv_bc1, wd, neg_lr);
}

// Lion (lion: scale_by_lion, add_decayed_weights, scale_by_learning_rate),
// s0 = mu, s1 = mu_out:
//   u  ← sign(lerp(mu, g, w1)); u ← fma(wd, p, u) when wd ≠ 0; u ← u · neg_lr
//   mu_out ← lerp(mu, g, w2)   (mu_out may be mu)
int sx_lion(const Leaf* leaves, int64_t count, int apply, double w1_, double w2_, double wd_,
            double neg_lr_) {
  const float w1 = static_cast<float>(w1_), w2 = static_cast<float>(w2_);
  const float wd = static_cast<float>(wd_), neg_lr = static_cast<float>(neg_lr_);
  return run(leaves, count, apply, wd_ != 0.0,
             [=](float* mu, float* mu_out, const float* p, int64_t i, float gi, auto with_decay) {
               const float m = mu[i];
               const float c = lerp(m, gi, w1);
               float u = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : c);  // sign, keeping 0 (and NaN)
               if constexpr (decltype(with_decay)::value) u = std::fma(wd, p[i], u);
               mu_out[i] = lerp(m, gi, w2);
               return u * neg_lr;
             });
}

// Adagrad (adagrad: [add_decayed_weights], scale_by_rss, scale_by_learning_rate),
// s0 = acc, s1 = acc_out:
//   g  ← fma(wd, p, g) when wd ≠ 0   (L2: the decay goes through the scaling)
//   acc_out ← fma(g, g, acc)          (acc_out may be acc)
//   u  ← g / (sqrt(acc_out) + eps) · neg_lr
int sx_adagrad(const Leaf* leaves, int64_t count, int apply, double wd_, double eps_,
               double neg_lr_) {
  const float wd = static_cast<float>(wd_), eps = static_cast<float>(eps_);
  const float neg_lr = static_cast<float>(neg_lr_);
  return run(leaves, count, apply, wd_ != 0.0,
             [=](float* acc, float* acc_out, const float* p, int64_t i, float gi, auto with_decay) {
               if constexpr (decltype(with_decay)::value) gi = std::fma(wd, p[i], gi);
               const float a = std::fma(gi, gi, acc[i]);
               acc_out[i] = a;
               return scaled(gi, a, eps, neg_lr);
             });
}

// RMSprop without centering or momentum (rmsprop: [add_decayed_weights],
// scale_by_rms, scale_by_learning_rate), s0 = nu, s1 = nu_out:
//   g  ← fma(wd, p, g) when wd ≠ 0
//   nu_out ← fma(w·g, g, nu·decay)    (w = 1 - decay; nu_out may be nu)
//   u  ← g / (sqrt(nu_out) + eps) · neg_lr
int sx_rmsprop(const Leaf* leaves, int64_t count, int apply, double decay_, double w_,
               double wd_, double eps_, double neg_lr_) {
  const float decay = static_cast<float>(decay_), w = static_cast<float>(w_);
  const float wd = static_cast<float>(wd_), eps = static_cast<float>(eps_);
  const float neg_lr = static_cast<float>(neg_lr_);
  return run(leaves, count, apply, wd_ != 0.0,
             [=](float* nu, float* nu_out, const float* p, int64_t i, float gi, auto with_decay) {
               if constexpr (decltype(with_decay)::value) gi = std::fma(wd, p[i], gi);
               const float v = std::fma(w * gi, gi, nu[i] * decay);
               nu_out[i] = v;
               return scaled(gi, v, eps, neg_lr);
             });
}

}  // extern "C"
