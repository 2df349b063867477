// The per-layer glue of a decode step, one pass each: RMSNorm, SiLU-and-mul,
// RoPE plus the KV-cache write.
#pragma once

#include "common.h"

namespace tandem {

// o = x / sqrt(mean(x^2) + eps) * w over one row of n (o may be x).
// 1 / sqrt(mean(x^2) + eps) of one row of n values.
inline float inv_rms(const float* x, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
  return 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
}

inline void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* o) {
  const float inv = inv_rms(x, n, eps);
#pragma omp simd
  for (int64_t i = 0; i < n; i++) o[i] = w[i] * (x[i] * inv);
}

// The gated MLP's activation: SwiGLU's SiLU (Llama and most), GeGLU's GELU
// with the tanh approximation (Gemma).
enum class Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

// One row: o = act(gate) * up. GELU-tanh is 0.5 x (1 + tanh(u)) = x * sigmoid(2u),
// u = sqrt(2 / pi) (x + 0.044715 x^3): SiLU's form, without tanh's 1 + -1 cancellation.
template <Activation A>
inline void act_and_mul_row(const float* g, const float* u, int64_t n, float* o) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) {
    const float x = g[i];
    const float z = A == Activation::kSilu
                        ? -x
                        : -1.5957691216057308f * (x + 0.044715f * x * x * x);  // -2u
    o[i] = x / (1.f + exp_approx(z)) * u[i];
  }
}

inline void act_and_mul_row(Activation a, const float* g, const float* u, int64_t n, float* o) {
  if (a == Activation::kSilu)
    act_and_mul_row<Activation::kSilu>(g, u, n, o);
  else
    act_and_mul_row<Activation::kGeluTanh>(g, u, n, o);
}

// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_float_rows(x, "x");
  check_float_rows(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1), "rms_norm: shape mismatch");
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  auto out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; t++) rms_norm_row(xp + t * xs, wp, n, feps, op + t * n);
  });
  return out;
}

// x: [T, 2N] (gate | up) -> act(gate) * up: [T, N]; activation: an Activation.
at::Tensor act_and_mul(const at::Tensor& x, int64_t activation) {
  check_float_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "act_and_mul: x must be [T, 2N]");
  TORCH_CHECK(activation == 0 || activation == 1, "act_and_mul: unknown activation");
  const Activation a = static_cast<Activation>(activation);
  const int64_t rows = x.size(0), n = x.size(1) / 2, xs = x.stride(0);
  auto out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; t++)
      act_and_mul_row(a, xp + t * xs, xp + t * xs + n, n, op + t * n);
  });
  return out;
}

// RoPE on one token's H query and Hkv key heads, in place (row x is its
// [H + 2 Hkv, D] qkv; HF's rotate_half convention; cos/sin are tandem's
// [P, D] tables, cos = [c, c], sin = [-s, s]), then its K and V heads into
// cache slot `slot`: a dense cache [S, 2, Hkv, D] of float, fp16 or bf16, or int8
// plus an fp32 scale per token and head [S, 2, Hkv, 1] (cache_s non-null).
struct RopeAndCache {
  const float* cos;
  const float* sin;
  int64_t num_heads, hkv, D;
  float* cache_f = nullptr;
  at::Half* cache_h = nullptr;
  at::BFloat16* cache_b = nullptr;
  int8_t* cache_q = nullptr;
  float* cache_s = nullptr;

  // RoPE on one query or key head (D floats) at position pos.
  void rotate(float* a, int64_t pos) const {
    const int64_t half = D / 2;
    const float* c = cos + pos * D;
    const float* s = sin + pos * D + half;  // +sin
    float* y = a + half;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
      const float x1 = a[i], x2 = y[i];
      a[i] = x1 * c[i] - x2 * s[i];
      y[i] = x2 * c[i] + x1 * s[i];
    }
  }

  // Head j of a token's [2, Hkv] K and V heads (K: j < Hkv) into its slot.
  void store(const float* src, int64_t slot, int64_t j) const {
    const int64_t at = (slot * 2 * hkv + j) * D;
    if (cache_f) {
      std::memcpy(cache_f + at, src, D * sizeof(float));
      return;
    }
    if (cache_h) {
      to_half(src, D, cache_h + at);
      return;
    }
    if (cache_b) {
      to_bf16(src, D, cache_b + at);
      return;
    }
    float amax = 0.f;
#pragma omp simd reduction(max : amax)
    for (int64_t i = 0; i < D; i++) amax = std::max(amax, std::fabs(src[i]));
    const float scale = std::max(amax, 1e-8f) / 127.0f;
    cache_s[slot * 2 * hkv + j] = scale;
    for (int64_t i = 0; i < D; i++)
      cache_q[at + i] = static_cast<int8_t>(std::nearbyint(src[i] / scale));
  }

  void token(float* x, int64_t pos, int64_t slot) const {
    for (int64_t h = 0; h < num_heads + hkv; h++) rotate(x + h * D, pos);
    for (int64_t j = 0; j < 2 * hkv; j++) store(x + (num_heads + j) * D, slot, j);
  }
};

// Checks one layer's cache (and scales, for the int8 kind) and points a
// RopeAndCache at it.
inline void bind_cache(RopeAndCache& r, const at::Tensor& cache,
                       const std::optional<at::Tensor>& cache_scale) {
  const KVKind kind = kv_kind(cache, cache_scale);
  r.cache_f = kind == KVKind::kFloat ? cache.data_ptr<float>() : nullptr;
  r.cache_h = kind == KVKind::kHalf ? cache.data_ptr<at::Half>() : nullptr;
  r.cache_b = kind == KVKind::kBf16 ? cache.data_ptr<at::BFloat16>() : nullptr;
  r.cache_q = kind == KVKind::kInt8 ? cache.data_ptr<int8_t>() : nullptr;
  r.cache_s = kind == KVKind::kInt8 ? cache_scale->data_ptr<float>() : nullptr;
}

// In place on qkv [T, H + 2*Hkv, D] (rows contiguous): RopeAndCache for
// every token.
void rotary_embedding_and_cache(const at::Tensor& qkv, const at::Tensor& positions,
                                const at::Tensor& cos, const at::Tensor& sin,
                                int64_t num_heads, int64_t num_kv_heads, const at::Tensor& cache,
                                const std::optional<at::Tensor>& cache_scale,
                                const at::Tensor& slots) {
  check_float_rows(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(1) == num_heads + 2 * num_kv_heads && qkv.is_contiguous(),
              "qkv must be a contiguous [T, H + 2 Hkv, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong,
              "positions and slots must be int64");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "rope tables must be contiguous");
  const int64_t T = qkv.size(0), D = qkv.size(2);
  RopeAndCache r{cos.data_ptr<float>(), sin.data_ptr<float>(), num_heads, num_kv_heads, D};
  bind_cache(r, cache, cache_scale);
  float* qp = qkv.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t row = (num_heads + 2 * num_kv_heads) * D;
  at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; t++) r.token(qp + t * row, pos[t], slot[t]);
  });
}

}  // namespace tandem
