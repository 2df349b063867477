// Shared by tandem's CPU kernels: a vectorizable exp and input checks.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace tandem {

// exp(x) for x <= 0 (softmax) and moderate x (SiLU): Cephes' expf, written so
// the compiler vectorizes loops over it (no libm call). ~1 ulp.
inline float exp_approx(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  const float t = x * 1.44269504088896341f + 0.5f;
  int32_t n = static_cast<int32_t>(t);  // floor(t), without a libm call
  n -= static_cast<float>(n) > t ? 1 : 0;
  const float fx = static_cast<float>(n);
  float r = x - fx * 0.693359375f;
  r = r + fx * 2.12194440e-4f;
  float z = r * r;
  float y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r +
              4.1665795894e-2f) * r + 1.6666665459e-1f) * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const int32_t e = (n + 127) << 23;
  return y * __builtin_bit_cast(float, e);
}

#ifdef __AVX512F__
// exp_approx on 16 lanes: the same operations in the same order (no FMA, as
// the scalar code compiles with -ffp-contract=off), so the same results.
inline __m512 exp_approx16(__m512 x) {
  auto c = [](float v) { return _mm512_set1_ps(v); };
  auto mul = [](__m512 p, __m512 q) { return _mm512_mul_ps(p, q); };
  auto add = [](__m512 p, __m512 q) { return _mm512_add_ps(p, q); };
  x = _mm512_min_ps(c(88.3f), _mm512_max_ps(c(-87.3f), x));  // NaN stays NaN, as above
  const __m512 t = add(mul(x, c(1.44269504088896341f)), c(0.5f));
  __m512i n = _mm512_cvttps_epi32(t);
  n = _mm512_mask_sub_epi32(n, _mm512_cmp_ps_mask(_mm512_cvtepi32_ps(n), t, _CMP_GT_OQ), n,
                            _mm512_set1_epi32(1));
  const __m512 fx = _mm512_cvtepi32_ps(n);
  __m512 r = _mm512_sub_ps(x, mul(fx, c(0.693359375f)));
  r = add(r, mul(fx, c(2.12194440e-4f)));
  const __m512 z = mul(r, r);
  __m512 y = add(mul(c(1.9875691500e-4f), r), c(1.3981999507e-3f));
  y = add(mul(y, r), c(8.3334519073e-3f));
  y = add(mul(y, r), c(4.1665795894e-2f));
  y = add(mul(y, r), c(1.6666665459e-1f));
  y = add(mul(y, r), c(5.0000001201e-1f));
  y = add(add(mul(y, z), r), c(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
  return mul(y, _mm512_castsi512_ps(e));
}
#endif

// GGUF's block scales are fp16, and tandem keeps quantized weights' group
// scales in fp16 too (a quarter of int4's bytes instead of a half in fp32).
inline float half_to_float(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

inline const uint16_t* half_ptr(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
}

// src[0 .. n) rounded to fp16 (to nearest even, as torch's .half()).
inline void to_half(const float* src, int64_t n, at::Half* dst) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; i++) dst[i] = at::Half(src[i]);
}

// Attention against a bf16 cache takes its queries rounded to bf16, as a bf16
// model's are, on every path (the AVX512_BF16 kernels multiply bf16 pairs):
// the query's value of type KV's, for a query element x.
template <typename KV>
inline float query_as(float x) {
  if constexpr (std::is_same_v<KV, at::BFloat16>)
    return static_cast<float>(at::BFloat16(x));
  else
    return x;
}

// Gemma 2's attention logit soft-capping, in place: s = cap * tanh(s / cap),
// tanh(x) as 1 - 2 / (1 + e^2x) through exp_approx (its absolute error, ~1e-7
// of cap, is what a score carries into the softmax).
inline float softcap1(float s, float cap) {
  return cap * (1.f - 2.f / (1.f + exp_approx(s * (2.f / cap))));
}

inline void softcap_scores(float* s, int64_t n, float cap) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 c = _mm512_set1_ps(cap), k = _mm512_set1_ps(2.f / cap);
  const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp_approx16(_mm512_mul_ps(_mm512_loadu_ps(s + i), k));
    const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(one, e)));
    _mm512_storeu_ps(s + i, _mm512_mul_ps(c, t));
  }
#endif
  for (; i < n; i++) s[i] = softcap1(s[i], cap);
}

// src[0 .. n) rounded to bf16 (to nearest even, as torch's .bfloat16()).
inline void to_bf16(const float* src, int64_t n, at::BFloat16* dst) {
  int64_t i = 0;
#ifdef __AVX512BF16__
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i))));
#endif
  for (; i < n; i++) dst[i] = at::BFloat16(src[i]);
}

// The instruction sets these kernels were compiled for (-march=native on the
// g++ at hand), named as /proc/cpuinfo names them: a CPU flag the compiler did
// not know leaves its paths out, whatever the CPU has.
inline std::string simd_features() {
  std::string out;
  auto add = [&](const char* name) { out += out.empty() ? name : std::string(" ") + name; };
#ifdef __AVX2__
  add("avx2");
#endif
#ifdef __AVX512F__
  add("avx512f");
#endif
#ifdef __AVX512BW__
  add("avx512bw");
#endif
#ifdef __AVX512VNNI__
  add("avx512_vnni");
#endif
#ifdef __AVX512BF16__
  add("avx512_bf16");
#endif
  return out;
}

// A KV cache's element type: float, fp16 or bf16 values, or int8 with an fp32
// scale per token and head.
enum class KVKind { kFloat, kHalf, kBf16, kInt8 };

// Checks a layer's cache [S, 2, Hkv, D] (and int8's scales) and names its kind.
inline KVKind kv_kind(const at::Tensor& cache, const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(cache.device().is_cpu() && cache.is_contiguous() && cache.dim() == 4,
              "cache must be a contiguous CPU [S, 2, Hkv, D]");
  if (scale) {
    TORCH_CHECK(cache.scalar_type() == at::kChar, "a cache with scales must be int8");
    TORCH_CHECK(scale->is_contiguous() && scale->scalar_type() == at::kFloat,
                "cache scales must be contiguous float32");
    return KVKind::kInt8;
  }
  switch (cache.scalar_type()) {
    case at::kFloat:
      return KVKind::kFloat;
    case at::kHalf:
      return KVKind::kHalf;
    case at::kBFloat16:
      return KVKind::kBf16;
    default:
      TORCH_CHECK(false, "a cache without scales must be float32, float16 or bfloat16");
  }
}

void check_float_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name,
              " must be a float32 CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, " must have contiguous rows");
}

}  // namespace tandem
