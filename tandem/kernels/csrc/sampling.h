// Sampling: a row's unnormalised probabilities in one pass, for the sampler's race.
#pragma once

#include <limits>
#include <tuple>

#include "common.h"

namespace tandem {

// weights[r, i] = exp((logits[r, i] - max_r) / temperature[r]), with masked
// (-inf) logits weighing exactly 0; also returns max_r ([R, 1]).
//
// The torch path (tandem/worker/sampler.py) takes five passes over the logits
// (amax, sub, div, clamp, exp) plus two more to zero masked entries. Here it is
// one max pass and one exp pass per row. The exponent is floored at -87 as
// the torch path's clamp does (sampler.py's EXP_FLOOR): e^-87 is a normal float,
// so no result takes the denormal slow path.
std::tuple<at::Tensor, at::Tensor> exp_weights(const at::Tensor& logits,
                                               const at::Tensor& temperature) {
  check_float_rows(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits must be contiguous [R, V]");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.dim() == 1 &&
                  temperature.size(0) == logits.size(0) && temperature.is_contiguous(),
              "temperature must be float32 [R]");
  const int64_t rows = logits.size(0), v = logits.size(1);
  at::Tensor weights = at::empty_like(logits);
  at::Tensor row_max = at::empty({rows, 1}, logits.options());
  const float* l = logits.data_ptr<float>();
  const float* temp = temperature.data_ptr<float>();
  float* w = weights.data_ptr<float>();
  float* mx = row_max.data_ptr<float>();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr float kExpFloor = -87.f;
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float* x = l + r * v;
      float* o = w + r * v;
      float m = kNegInf;
      int64_t i = 0;
#if defined(__AVX512F__)
      __m512 vm = _mm512_set1_ps(kNegInf);
      for (; i + 16 <= v; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + i));
      m = _mm512_reduce_max_ps(vm);
#endif
      for (; i < v; i++) m = std::max(m, x[i]);
      mx[r] = m;
      const float inv_t = 1.f / temp[r];
      for (i = 0; i < v; i++) {
        // e is finite, so e * 0 is 0; a select here (?:) stops g++ 12 vectorizing.
        const float e = exp_approx(std::max((x[i] - m) * inv_t, kExpFloor));
        o[i] = e * static_cast<float>(x[i] != kNegInf);
      }
    }
  });
  return {weights, row_max};
}

}  // namespace tandem
