// Fused optimizer steps on CPU: one pass per element over the gradient, the
// state and the parameter, OpenMP-parallel, with the arithmetic of
// shardax.optim's reference transforms in the same order, each operation
// rounded as written (built with -ffp-contract=off; where torch's kernels
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
#include <cmath>
#include <cstdint>
#include <type_traits>

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

// Where an update goes: see the top of the file.
struct Io {
  const void* g;
  int g_type;
  const float* p;
  float* out;
  int apply;
  void* shadow;
  int shadow_type;
};

template <int G, int S, bool Apply, class Rule>
void drive(const Io& io_, int64_t n, const Rule& rule_) {
#pragma omp parallel if (n > 65536)
  {
    // Private copies: the loop's stores cannot alias them, so the compiler
    // keeps the scalars and pointers in registers and vectorises the loop.
    const Rule rule = rule_;
    const void* const g = io_.g;
    const float* const p = io_.p;
    float* const out = io_.out;
    void* const shadow = io_.shadow;
#pragma omp for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float u = rule(i, load<G>(g, i));
      const float o = Apply ? p[i] + u : u;
      out[i] = o;
      if constexpr (S != F32) store_shadow<S>(shadow, i, o);
    }
  }
}

template <int G, int S, class Rule>
void apply_or_not(const Io& io, int64_t n, const Rule& rule) {
  if (io.apply) {
    drive<G, S, true>(io, n, rule);
  } else {
    drive<G, S, false>(io, n, rule);
  }
}

template <int G, class Rule>
void by_shadow(const Io& io, int64_t n, const Rule& rule) {
  if (io.shadow == nullptr) return apply_or_not<G, F32>(io, n, rule);
  if (io.shadow_type == BF16) return apply_or_not<G, BF16>(io, n, rule);
  return apply_or_not<G, F16>(io, n, rule);
}

// Run ``rule(i, g_i) -> u_i`` over n elements; 0, or -1 for a dtype it does not know.
template <class Rule>
int run(const Io& io, int64_t n, const Rule& rule) {
  const bool shadow_ok = io.shadow == nullptr || io.shadow_type == BF16 || io.shadow_type == F16;
  if (!shadow_ok || (io.apply && io.p == nullptr)) return -1;
  switch (io.g_type) {
    case F32: by_shadow<F32>(io, n, rule); return 0;
    case BF16: by_shadow<BF16>(io, n, rule); return 0;
    case F16: by_shadow<F16>(io, n, rule); return 0;
    default: return -1;
  }
}

// g / (sqrt(v) + eps) · neg_lr, rounded step by step as the reference.
inline float scaled(float g, float v, float eps, float neg_lr) {
  float d = std::sqrt(v);
  d = d + eps;
  return (g / d) * neg_lr;
}

// ``run`` with ``rule(i, g_i, decay)``, ``decay`` a compile-time bool (a
// branch per element would keep the compiler from vectorising the loop).
template <class Rule>
int run_decay(const Io& io, int64_t n, bool decay, const Rule& rule) {
  if (decay) {
    return run(io, n, [rule](int64_t i, float gi) { return rule(i, gi, std::true_type{}); });
  }
  return run(io, n, [rule](int64_t i, float gi) { return rule(i, gi, std::false_type{}); });
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
int adam(float* mu, float* nu, const void* g, int g_type, const float* p, float* out, int apply,
         void* shadow, int shadow_type, int64_t n, double w1_, double b2_, double w2_,
         double sbc2_, double eps_, double inv_bc1_, double wd_, double neg_lr_) {
  const float w1 = static_cast<float>(w1_), fb2 = static_cast<float>(b2_);
  const float w2 = static_cast<float>(w2_), sbc2 = static_cast<float>(sbc2_);
  const float eps = static_cast<float>(eps_), inv_bc1 = static_cast<float>(inv_bc1_);
  const float wd = static_cast<float>(wd_), neg_lr = static_cast<float>(neg_lr_);
  if (wd_ != 0.0 && p == nullptr) return -1;
  const Io io{g, g_type, p, out, apply, shadow, shadow_type};
  return run_decay(io, n, wd_ != 0.0, [=](int64_t i, float gi, auto with_decay) {
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

extern "C" {

// AdamW (adamw: scale_by_adam, add_decayed_weights, scale_by_learning_rate):
//   mu ← lerp(mu, g, w1)                      (in place)
//   nu ← fma(w2·g, g, nu·b2)                  (in place)
//   d  ← sqrt(nu) / sbc2 + eps
//   u  ← (1 / (d / mu)) · inv_bc1
//   u  ← fma(wd, p, u)          when wd ≠ 0
//   u  ← u · neg_lr
// with the scalars computed by the caller as the reference computes them, in
// double, and rounded to float here.
int sx_adamw(float* mu, float* nu, const void* g, int g_type, const float* p, float* out,
             int apply, void* shadow, int shadow_type, int64_t n, double w1, double b2, double w2,
             double sbc2, double eps, double inv_bc1, double wd, double neg_lr) {
  return adam<false>(mu, nu, g, g_type, p, out, apply, shadow, shadow_type, n, w1, b2, w2, sbc2,
                     eps, inv_bc1, wd, neg_lr);
}

// Adam with L2 (adam: [add_decayed_weights], scale_by_adam,
// scale_by_learning_rate): g ← fma(wd, p, g) when wd ≠ 0, then AdamW's
// update without its decoupled decay.
int sx_adam_l2(float* mu, float* nu, const void* g, int g_type, const float* p, float* out,
               int apply, void* shadow, int shadow_type, int64_t n, double w1, double b2,
               double w2, double sbc2, double eps, double inv_bc1, double wd, double neg_lr) {
  return adam<true>(mu, nu, g, g_type, p, out, apply, shadow, shadow_type, n, w1, b2, w2, sbc2,
                    eps, inv_bc1, wd, neg_lr);
}

// Lion (lion: scale_by_lion, add_decayed_weights, scale_by_learning_rate):
//   u  ← sign(lerp(mu, g, w1)); u ← fma(wd, p, u) when wd ≠ 0; u ← u · neg_lr
//   mu_out ← lerp(mu, g, w2)   (mu_out may be mu)
int sx_lion(const float* mu, float* mu_out, const void* g, int g_type, const float* p, float* out,
            int apply, void* shadow, int shadow_type, int64_t n, double w1_, double w2_,
            double wd_, double neg_lr_) {
  const float w1 = static_cast<float>(w1_), w2 = static_cast<float>(w2_);
  const float wd = static_cast<float>(wd_), neg_lr = static_cast<float>(neg_lr_);
  if (wd_ != 0.0 && p == nullptr) return -1;
  const Io io{g, g_type, p, out, apply, shadow, shadow_type};
  return run_decay(io, n, wd_ != 0.0, [=](int64_t i, float gi, auto with_decay) {
    const float m = mu[i];
    const float c = lerp(m, gi, w1);
    float u = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : c);  // sign, keeping 0 (and NaN)
    if constexpr (decltype(with_decay)::value) u = std::fma(wd, p[i], u);
    mu_out[i] = lerp(m, gi, w2);
    return u * neg_lr;
  });
}

// Adagrad (adagrad: [add_decayed_weights], scale_by_rss, scale_by_learning_rate):
//   g  ← fma(wd, p, g) when wd ≠ 0   (L2: the decay goes through the scaling)
//   acc_out ← fma(g, g, acc)          (acc_out may be acc)
//   u  ← g / (sqrt(acc_out) + eps) · neg_lr
int sx_adagrad(const float* acc, float* acc_out, const void* g, int g_type, const float* p,
               float* out, int apply, void* shadow, int shadow_type, int64_t n, double wd_,
               double eps_, double neg_lr_) {
  const float wd = static_cast<float>(wd_), eps = static_cast<float>(eps_);
  const float neg_lr = static_cast<float>(neg_lr_);
  if (wd_ != 0.0 && p == nullptr) return -1;
  const Io io{g, g_type, p, out, apply, shadow, shadow_type};
  return run_decay(io, n, wd_ != 0.0, [=](int64_t i, float gi, auto with_decay) {
    if constexpr (decltype(with_decay)::value) gi = std::fma(wd, p[i], gi);
    const float a = std::fma(gi, gi, acc[i]);
    acc_out[i] = a;
    return scaled(gi, a, eps, neg_lr);
  });
}

// RMSprop without centering or momentum (rmsprop: [add_decayed_weights],
// scale_by_rms, scale_by_learning_rate):
//   g  ← fma(wd, p, g) when wd ≠ 0
//   nu_out ← fma(w·g, g, nu·decay)    (w = 1 - decay; nu_out may be nu)
//   u  ← g / (sqrt(nu_out) + eps) · neg_lr
int sx_rmsprop(const float* nu, float* nu_out, const void* g, int g_type, const float* p,
               float* out, int apply, void* shadow, int shadow_type, int64_t n, double decay_,
               double w_, double wd_, double eps_, double neg_lr_) {
  const float decay = static_cast<float>(decay_), w = static_cast<float>(w_);
  const float wd = static_cast<float>(wd_), eps = static_cast<float>(eps_);
  const float neg_lr = static_cast<float>(neg_lr_);
  if (wd_ != 0.0 && p == nullptr) return -1;
  const Io io{g, g_type, p, out, apply, shadow, shadow_type};
  return run_decay(io, n, wd_ != 0.0, [=](int64_t i, float gi, auto with_decay) {
    if constexpr (decltype(with_decay)::value) gi = std::fma(wd, p[i], gi);
    const float v = std::fma(w * gi, gi, nu[i] * decay);
    nu_out[i] = v;
    return scaled(gi, v, eps, neg_lr);
  });
}

}  // extern "C"
