// Dense fp32 matmul for a few rows of activations (decode): out = x @ W.T
// with W in HF's [out, in] layout, over a range of outputs, so a thread team
// splits one matmul with no reduction across threads.
//
// Decode is bound by reading W, so W is read exactly once: 4 of its rows at a
// time, each 16-float chunk loaded once and multiplied with up to 4 rows of x
// held in registers (more rows of x reuse the 4 W rows from L1). While a tile
// streams, the next tile's lines are prefetched, one per 64 floats: a little
// faster than the hardware prefetcher alone (and than MKL called per matmul).
//
// Each output is summed in the same order (16-wide chunks over k, then one
// horizontal add) whatever the number of rows, so a sequence's result does
// not depend on what it is batched with.
#pragma once

#include "common.h"

namespace tandem {

#ifdef __AVX512F__
// res[m][r] = x[m] . w[r] for R rows of w (stride K) and M rows of x (stride xs).
template <int R, int M>
inline void dot_tile(const float* w, int64_t K, const float* x, int64_t xs, float (&res)[4][4]) {
  __m512 acc[M][R];
  for (int m = 0; m < M; m++)
    for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(w + R * K + R * k), _MM_HINT_T0);
    __m512 wv[R];
    for (int r = 0; r < R; r++) wv[r] = _mm512_loadu_ps(w + r * K + k);
    for (int m = 0; m < M; m++) {
      const __m512 xv = _mm512_loadu_ps(x + m * xs + k);
      for (int r = 0; r < R; r++) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[R];
    for (int r = 0; r < R; r++) wv[r] = _mm512_maskz_loadu_ps(mask, w + r * K + k);
    for (int m = 0; m < M; m++) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * xs + k);
      for (int r = 0; r < R; r++) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; m++)
    for (int r = 0; r < R; r++) res[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}
#else
template <int R, int M>
inline void dot_tile(const float* w, int64_t K, const float* x, int64_t xs, float (&res)[4][4]) {
  for (int m = 0; m < M; m++)
    for (int r = 0; r < R; r++) {
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < K; k++) s += x[m * xs + k] * w[r * K + k];
      res[m][r] = s;
    }
}
#endif

template <int R>
inline void dot_rows(int64_t mc, const float* w, int64_t K, const float* x, int64_t xs,
                     float (&res)[4][4]) {
  switch (mc) {
    case 1: return dot_tile<R, 1>(w, K, x, xs, res);
    case 2: return dot_tile<R, 2>(w, K, x, xs, res);
    case 3: return dot_tile<R, 3>(w, K, x, xs, res);
    default: return dot_tile<R, 4>(w, K, x, xs, res);
  }
}

// out[m, n] = x[m] . w[n] (+ bias[n]) (+ out[m, n] when accumulate: a fused
// residual add) for the M rows of x (stride xs) and outputs n in [n0, n1) of
// W [N, K]; out has row stride os.
inline void matvec(const float* w, int64_t K, const float* x, int64_t xs, int64_t M, int64_t n0,
                   int64_t n1, const float* bias, bool accumulate, float* out, int64_t os) {
  float res[4][4];
  for (int64_t n = n0; n < n1;) {
    const int64_t r = n1 - n >= 4 ? 4 : 1;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t mc = std::min<int64_t>(4, M - m0);
      if (r == 4)
        dot_rows<4>(mc, w + n * K, K, x + m0 * xs, xs, res);
      else
        dot_rows<1>(mc, w + n * K, K, x + m0 * xs, xs, res);
      for (int64_t m = 0; m < mc; m++)
        for (int64_t i = 0; i < r; i++) {
          float& o = out[(m0 + m) * os + n + i];
          const float v = res[m][i] + (bias ? bias[n + i] : 0.f);
          o = accumulate ? o + v : v;
        }
    }
    n += r;
  }
}

// Thread t's share [begin, end) of n outputs: contiguous, in whole units
// (matvec's tiles of 4, or a head's rows).
inline std::pair<int64_t, int64_t> share(int64_t n, int64_t t, int64_t threads,
                                         int64_t unit = 4) {
  const int64_t units = (n + unit - 1) / unit;
  return {std::min(n, units * t / threads * unit), std::min(n, units * (t + 1) / threads * unit)};
}

// x [M, K] @ w [N, K].T (+ bias): tandem::matvec as an op, the threads
// splitting the outputs as in the decode step (for tests and the benchmarks'
// memory-bandwidth probe).
at::Tensor matvec_op(const at::Tensor& x, const at::Tensor& w,
                     const std::optional<at::Tensor>& bias) {
  check_float_rows(x, "x");
  check_float_rows(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.is_contiguous() && x.size(1) == w.size(1),
              "matvec: x must be [M, K] and w a contiguous [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (bias) {
    check_float_rows(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "matvec: bias must be [N]");
  }
  auto out = at::empty({M, N}, x.options());
  const int64_t threads = at::get_num_threads();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      const auto [n0, n1] = share(N, t, threads);
      matvec(w.data_ptr<float>(), K, x.data_ptr<float>(), x.stride(0), M, n0, n1,
             bias ? bias->data_ptr<float>() : nullptr, false, out.data_ptr<float>(), N);
    }
  });
  return out;
}

}  // namespace tandem
