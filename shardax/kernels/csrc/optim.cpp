// Fused optimizer steps on CPU: one pass per element over the gradient, the
// state and the parameter — every leaf of a step in one call, one
// OpenMP-parallel region split across leaf boundaries — with the arithmetic
// of shardax.optim's reference transforms in the same order, each operation
// rounded as written (built with -ffp-contract=off; where torch's kernels
// fuse a multiply-add — lerp, addcmul, add with alpha — so does this, with
// std::fma). Two departures, each within an ulp of the update: torch's
// vectorised sqrt is not always correctly rounded, and Adam's update is
// m / d where the reference computes 1 / (d / m) — a division fewer, as
// torch's fused AdamW: 0.56 rather than 0.69 ns an element in cache on a
// Zen 3 core, against the ~0.75 ns a one-thread step takes to stream its
// 28 bytes, which the arithmetic must stay well under.
//
// Every kernel computes the update u of one element (the learning rate
// applied, as optax's updates) and then, in the same pass, either
//   out[i] = u                          (apply = 0: the functional update), or
//   out[i] = p[i] + u                   (apply = 1: the step; out may be p),
// and, when ``shadow`` is given, writes out[i] rounded to fp16/bf16 there
// too (fp32 master weights and their low-precision params in one pass).
// Gradients may be fp32, fp16 or bf16 (widened exactly, as torch's cast).
//
// The loops are vectorised: an element's inputs are all read before any of
// its outputs is written, and every access is at the element's own index,
// so buffers that are the same (out and p, a one-buffer kernel's two state
// buffers) carry no dependence from one element to the next — which the
// loop says to the compiler (SX_SIMD) instead of letting it check aliasing
// at run time and fall back to scalar code when out is p.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "half.h"

#if defined(_OPENMP)
#define SX_SIMD _Pragma("omp simd")
#elif defined(__clang__)
#define SX_SIMD _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define SX_SIMD _Pragma("GCC ivdep")
#else
#define SX_SIMD
#endif

namespace {

enum DType { F32 = 0, F16 = 2, BF16 = 3 };

// torch's lerp with a fixed weight w: fma(w, end - start, start) for
// |w| < 0.5, else fma(-(end - start), 1 - w, end) — written as
// fma(c, end - start, base) with c taken once (-(x)·y and x·(-y) are the
// same exact product) and base picked by a mask, not a branch: a select on
// a loop-invariant bool is what keeps GCC from vectorising a loop it did
// not unswitch.
struct Lerp {
  float c;
  uint32_t start_mask;  // all ones: base = start; zero: base = end
  explicit Lerp(float w)
      : c(std::fabs(w) < 0.5f ? w : -(1.0f - w)),
        start_mask(std::fabs(w) < 0.5f ? ~uint32_t{0} : 0) {}
  float operator()(float start, float end) const {
    const uint32_t base =
        (sx::f32_to_bits(start) & start_mask) | (sx::f32_to_bits(end) & ~start_mask);
    return std::fma(c, end - start, sx::bits_to_f32(base));
  }
};

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

// What a rule makes of one element: the update (the learning rate applied)
// and the new values of the state buffers. A rule with ``kBoth`` reads and
// writes both buffers (Adam's mu and nu); the others read s0 and write s1.
struct Out {
  float u, s0, s1;
};

// Everything a loop calls is inlined into it (the rule, the conversions): a
// call left in the loop body keeps it from being vectorised, and with dozens
// of instantiations GCC's inlining budget otherwise runs out.
#if defined(__GNUC__) || defined(__clang__)
#define SX_FLATTEN __attribute__((flatten))
#else
#define SX_FLATTEN
#endif

// One leaf's elements [begin, end) under ``rule``, then the result (see the
// top of the file). The param is read where the rule decays or the result
// is applied. No software prefetch: with the loop vectorised the hardware
// prefetchers keep up, and asking for each stream's lines ahead (256 to
// 4096 elements, into L1, L2 or non-temporally) made the step 5-10 % slower
// on Zen 3, at one thread and two.
template <int G, int S, bool Apply, bool Decay, class Rule>
SX_FLATTEN void span(const Leaf& leaf, int64_t begin, int64_t end, const Rule& rule_) {
  constexpr bool kParam = Apply || Decay;
  // Private copies: the loop's stores cannot alias them, so the compiler
  // keeps the scalars and pointers in registers.
  const Rule rule = rule_;
  float* const s0 = at<float>(leaf.s0);
  float* const s1 = at<float>(leaf.s1);
  const void* const g = at<const void>(leaf.g);
  const float* const p = at<const float>(leaf.p);
  float* const out = at<float>(leaf.out);
  void* const shadow = at<void>(leaf.shadow);
  SX_SIMD
  for (int64_t i = begin; i < end; ++i) {
    const float a = s0[i];
    const float b = Rule::kBoth ? s1[i] : 0.0f;
    const float pi = kParam ? p[i] : 0.0f;
    const Out r = rule.template step<Decay>(a, b, pi, load<G>(g, i));
    if constexpr (Rule::kBoth) s0[i] = r.s0;
    s1[i] = r.s1;
    const float o = Apply ? pi + r.u : r.u;
    out[i] = o;
    if constexpr (S != F32) store_shadow<S>(shadow, i, o);
  }
}

template <int G, int S, class Rule>
void by_flags(const Leaf& leaf, int64_t b, int64_t e, bool apply, bool decay, const Rule& rule) {
  if (apply && decay) return span<G, S, true, true>(leaf, b, e, rule);
  if (apply) return span<G, S, true, false>(leaf, b, e, rule);
  if (decay) return span<G, S, false, true>(leaf, b, e, rule);
  span<G, S, false, false>(leaf, b, e, rule);
}

template <int G, class Rule>
void by_shadow(const Leaf& leaf, int64_t b, int64_t e, bool apply, bool decay, const Rule& rule) {
  if (leaf.shadow == 0) return by_flags<G, F32>(leaf, b, e, apply, decay, rule);
  if (leaf.shadow_type == BF16) return by_flags<G, BF16>(leaf, b, e, apply, decay, rule);
  by_flags<G, F16>(leaf, b, e, apply, decay, rule);
}

template <class Rule>
void by_grad(const Leaf& leaf, int64_t b, int64_t e, bool apply, bool decay, const Rule& rule) {
  if (leaf.g_type == BF16) return by_shadow<BF16>(leaf, b, e, apply, decay, rule);
  if (leaf.g_type == F16) return by_shadow<F16>(leaf, b, e, apply, decay, rule);
  by_shadow<F32>(leaf, b, e, apply, decay, rule);
}

// Elements a thread takes at a time (a multiple of 16: a cache line of
// floats). The threads take chunks as they finish the last, not an equal
// share each: on a busy host one descheduled thread would otherwise hold
// up the whole step.
constexpr int64_t kChunk = int64_t{1} << 15;

template <class Rule>
void chunk(const Leaf* leaves, const std::vector<int64_t>& starts, int64_t lo, int64_t hi,
           bool apply, bool decay, const Rule& rule) {
  const int64_t count = static_cast<int64_t>(starts.size()) - 1;
  // the first leaf ending after lo
  int64_t k = std::upper_bound(starts.begin() + 1, starts.end(), lo) - (starts.begin() + 1);
  for (; k < count && starts[k] < hi; ++k) {
    const int64_t b = lo > starts[k] ? lo - starts[k] : 0;
    const int64_t e = hi - starts[k] < leaves[k].n ? hi - starts[k] : leaves[k].n;
    if (b < e) by_grad(leaves[k], b, e, apply, decay, rule);
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
    chunk(leaves, starts, lo, hi, apply != 0, decay, rule);
  }
  return 0;
}

// g / (sqrt(v) + eps) · neg_lr, rounded step by step as the reference.
inline float scaled(float g, float v, float eps, float neg_lr) {
  float d = std::sqrt(v);
  d = d + eps;
  return (g / d) * neg_lr;
}

// Adam's update, the weight decay decoupled (AdamW) or, with ``L2``, added
// to the gradient first (Adam's L2): see sx_adamw and sx_adam_l2.
template <bool L2>
struct Adam {
  static constexpr bool kBoth = true;  // s0 = mu, s1 = nu
  Lerp w1;
  float b2, w2, sbc2, eps, inv_bc1, wd, neg_lr;
  template <bool Decay>
  Out step(float mu, float nu, float p, float g) const {
    if (Decay && L2) g = std::fma(wd, p, g);
    const float m = w1(mu, g);
    const float v = std::fma(w2 * g, g, nu * b2);
    float d = std::sqrt(v);
    d = d / sbc2;
    d = d + eps;
    float u = (m / d) * inv_bc1;
    if (Decay && !L2) u = std::fma(wd, p, u);
    return {u * neg_lr, m, v};
  }
};

// Lion: s0 = mu, s1 = mu_out.
struct Lion {
  static constexpr bool kBoth = false;
  Lerp w1, w2;
  float wd, neg_lr;
  template <bool Decay>
  Out step(float mu, float, float p, float g) const {
    const float c = w1(mu, g);
    float u = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : c);  // sign, keeping 0 (and NaN)
    if (Decay) u = std::fma(wd, p, u);
    return {u * neg_lr, 0.0f, w2(mu, g)};
  }
};

// Adagrad: s0 = acc, s1 = acc_out.
struct Adagrad {
  static constexpr bool kBoth = false;
  float wd, eps, neg_lr;
  template <bool Decay>
  Out step(float acc, float, float p, float g) const {
    if (Decay) g = std::fma(wd, p, g);
    const float a = std::fma(g, g, acc);
    return {scaled(g, a, eps, neg_lr), 0.0f, a};
  }
};

// RMSprop: s0 = nu, s1 = nu_out.
struct Rmsprop {
  static constexpr bool kBoth = false;
  float decay, w, wd, eps, neg_lr;
  template <bool Decay>
  Out step(float nu, float, float p, float g) const {
    if (Decay) g = std::fma(wd, p, g);
    const float v = std::fma(w * g, g, nu * decay);
    return {scaled(g, v, eps, neg_lr), 0.0f, v};
  }
};

template <bool L2>
int adam(const Leaf* leaves, int64_t count, int apply, double w1, double b2, double w2,
         double sbc2, double eps, double inv_bc1, double wd, double neg_lr) {
  const Adam<L2> rule{Lerp(static_cast<float>(w1)), static_cast<float>(b2),
                      static_cast<float>(w2),       static_cast<float>(sbc2),
                      static_cast<float>(eps),      static_cast<float>(inv_bc1),
                      static_cast<float>(wd),       static_cast<float>(neg_lr)};
  return run(leaves, count, apply, wd != 0.0, rule);
}

}  // namespace

// Every kernel steps ``count`` leaves (see Leaf: s0 and s1 are named in each
// kernel's comment) in one parallel region, with ``apply`` as at the top of
// the file, and returns 0, or -1 for arguments it does not know.
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

// AdamW (adamw: scale_by_adam, add_decayed_weights, scale_by_learning_rate),
// s0 = mu, s1 = nu:
//   mu ← lerp(mu, g, w1)                      (in place)
//   nu ← fma(w2·g, g, nu·b2)                  (in place)
//   d  ← sqrt(nu) / sbc2 + eps
//   u  ← (mu / d) · inv_bc1      (the reference: (1 / (d / mu)) · inv_bc1)
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
int sx_lion(const Leaf* leaves, int64_t count, int apply, double w1, double w2, double wd,
            double neg_lr) {
  const Lion rule{Lerp(static_cast<float>(w1)), Lerp(static_cast<float>(w2)),
                  static_cast<float>(wd), static_cast<float>(neg_lr)};
  return run(leaves, count, apply, wd != 0.0, rule);
}

// Adagrad (adagrad: [add_decayed_weights], scale_by_rss, scale_by_learning_rate),
// s0 = acc, s1 = acc_out:
//   g  ← fma(wd, p, g) when wd ≠ 0   (L2: the decay goes through the scaling)
//   acc_out ← fma(g, g, acc)          (acc_out may be acc)
//   u  ← g / (sqrt(acc_out) + eps) · neg_lr
int sx_adagrad(const Leaf* leaves, int64_t count, int apply, double wd, double eps,
               double neg_lr) {
  const Adagrad rule{static_cast<float>(wd), static_cast<float>(eps), static_cast<float>(neg_lr)};
  return run(leaves, count, apply, wd != 0.0, rule);
}

// RMSprop without centering or momentum (rmsprop: [add_decayed_weights],
// scale_by_rms, scale_by_learning_rate), s0 = nu, s1 = nu_out:
//   g  ← fma(wd, p, g) when wd ≠ 0
//   nu_out ← fma(w·g, g, nu·decay)    (w = 1 - decay; nu_out may be nu)
//   u  ← g / (sqrt(nu_out) + eps) · neg_lr
int sx_rmsprop(const Leaf* leaves, int64_t count, int apply, double decay, double w, double wd,
               double eps, double neg_lr) {
  const Rmsprop rule{static_cast<float>(decay), static_cast<float>(w), static_cast<float>(wd),
                     static_cast<float>(eps), static_cast<float>(neg_lr)};
  return run(leaves, count, apply, wd != 0.0, rule);
}

}  // extern "C"
