// Fused optimizer steps on CPU: one pass per element over the gradient, the
// state and (for weight decay) the parameter, OpenMP-parallel, with the
// arithmetic of shardax.optim's reference transforms in the same order,
// each operation rounded as written (built with -ffp-contract=off; where
// torch's kernels fuse a multiply-add — lerp, addcmul, add with alpha — so
// does this, with std::fma). torch's vectorised sqrt is not always
// correctly rounded, so results agree with the reference to about an ulp.
#include <cmath>
#include <cstdint>

// torch's lerp: fma(w, end - start, start) for |w| < 0.5, else
// fma(-(end - start), 1 - w, end).
static inline float lerp(float start, float end, float w) {
  return std::fabs(w) < 0.5f ? std::fma(w, end - start, start)
                             : std::fma(-(end - start), 1.0f - w, end);
}

extern "C" {

// AdamW's update (adamw: scale_by_adam, add_decayed_weights, scale_by_learning_rate):
//   mu ← lerp(mu, g, w1)                      (in place)
//   nu ← fma(w2·g, g, nu·b2)                  (in place)
//   d  ← sqrt(nu) / sbc2 + eps
//   u  ← (1 / (d / mu)) · inv_bc1
//   u  ← fma(wd, p, u)          when p is given
//   u  ← u · neg_lr
// with the scalars computed by the caller as the reference computes them, in
// double, and rounded to float here.
void sx_adamw_f32(float* mu, float* nu, const float* g, const float* p, float* u, int64_t n,
                  double w1_, double b2_, double w2_, double sbc2_, double eps_, double inv_bc1_,
                  double wd_, double neg_lr_) {
  const float w1 = static_cast<float>(w1_), fb2 = static_cast<float>(b2_);
  const float w2 = static_cast<float>(w2_), sbc2 = static_cast<float>(sbc2_);
  const float eps = static_cast<float>(eps_), inv_bc1 = static_cast<float>(inv_bc1_);
  const float wd = static_cast<float>(wd_), neg_lr = static_cast<float>(neg_lr_);
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float m = lerp(mu[i], gi, w1);
    const float v = std::fma(w2 * gi, gi, nu[i] * fb2);
    float d = std::sqrt(v);
    d = d / sbc2;
    d = d + eps;
    float ui = (1.0f / (d / m)) * inv_bc1;
    if (p != nullptr) ui = std::fma(wd, p[i], ui);
    mu[i] = m;
    nu[i] = v;
    u[i] = ui * neg_lr;
  }
}

// Lion's update (lion: scale_by_lion, add_decayed_weights, scale_by_learning_rate):
//   u  ← sign(lerp(mu, g, w1)); u ← fma(wd, p, u) when p is given; u ← u · neg_lr
//   mu_out ← lerp(mu, g, w2)   (a new buffer: the reference leaves the old state alone)
void sx_lion_f32(const float* mu, const float* g, const float* p, float* mu_out, float* u,
                 int64_t n, double w1_, double w2_, double wd_, double neg_lr_) {
  const float w1 = static_cast<float>(w1_), w2 = static_cast<float>(w2_);
  const float wd = static_cast<float>(wd_), neg_lr = static_cast<float>(neg_lr_);
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float c = lerp(mu[i], g[i], w1);
    float ui = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : c);  // sign, keeping 0 (and NaN)
    if (p != nullptr) ui = std::fma(wd, p[i], ui);
    u[i] = ui * neg_lr;
    mu_out[i] = lerp(mu[i], g[i], w2);
  }
}

}  // extern "C"
