// Quantized matmuls: int4 (any CPU) and int8 W8A8 (AVX-512 VNNI).
#pragma once

#include "common.h"

namespace tandem {

// int4 weights for any number of rows (torch's CPU int4 matmul decodes at ~8
// tok/s here). Group g (32 weights) of row n is 16 bytes at packed[n, 16 g]:
// byte i holds weight 32 g + i in its low nibble and 32 g + 16 + i in its high
// one, and the weight is q * scale[n, g] + lo[n, g] (Int4Linear's reference).
// Few rows (decode): the nibbles are unpacked in registers and each group's dot
// product is scaled once, y = sum_g scale_g (q_g . x_g) + sum_g lo_g sum(x_g),
// so the weights stream at memory speed. More rows (prefill): the weight is
// dequantized to fp32 and multiplied by torch's GEMM.
constexpr int64_t kInt4GemvMaxRows = 4;

void int4_dequantize_rows(const uint8_t* packed, const float* scale, const float* lo, int64_t n0,
                          int64_t n1, int64_t K, float* w) {
  const int64_t G = K / 32;
  for (int64_t n = n0; n < n1; n++)
    for (int64_t g = 0; g < G; g++) {
      const uint8_t* by = packed + n * (K / 2) + g * 16;
      const float s = scale[n * G + g], l = lo[n * G + g];
      float* wg = w + n * K + g * 32;
#pragma omp simd
      for (int i = 0; i < 16; i++) wg[i] = static_cast<float>(by[i] & 15) * s + l;
#pragma omp simd
      for (int i = 0; i < 16; i++) wg[i + 16] = static_cast<float>(by[i] >> 4) * s + l;
    }
}

// xsum [K / 32]: the sums of x's groups of 32, for the lo terms.
inline void int4_group_sums(const float* x, int64_t K, float* xsum) {
  for (int64_t g = 0; g < K / 32; g++) {
    const float* xg = x + g * 32;
    float t = 0.f;
#pragma omp simd reduction(+ : t)
    for (int64_t i = 0; i < 32; i++) t += xg[i];
    xsum[g] = t;
  }
}

// y[n] for one row x, output rows [n0, n1); xsum [G] = per-group sums of x.
void int4_gemv_rows(const uint8_t* packed, const float* scale, const float* lo, int64_t n0,
                    int64_t n1, int64_t K, const float* x, const float* xsum, float* y) {
  const int64_t G = K / 32;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = packed + n * (K / 2);
    const float* sr = scale + n * G;
    float zero_term = 0.f;
#pragma omp simd reduction(+ : zero_term)
    for (int64_t g = 0; g < G; g++) zero_term += lo[n * G + g] * xsum[g];
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
      const __m512i v =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16)));
      const __m512 q0 = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
      const __m512 q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
      const __m512 t = _mm512_fmadd_ps(q1, _mm512_loadu_ps(x + g * 32 + 16),
                                       _mm512_mul_ps(q0, _mm512_loadu_ps(x + g * 32)));
      acc = _mm512_fmadd_ps(_mm512_set1_ps(sr[g]), t, acc);
    }
    y[n] = _mm512_reduce_add_ps(acc) + zero_term;
#else
    float acc = 0.f;
    for (int64_t g = 0; g < G; g++) {
      const uint8_t* by = row + g * 16;
      float t = 0.f;
#pragma omp simd reduction(+ : t)
      for (int i = 0; i < 16; i++)
        t += static_cast<float>(by[i] & 15) * x[g * 32 + i] +
             static_cast<float>(by[i] >> 4) * x[g * 32 + 16 + i];
      acc += sr[g] * t;
    }
    y[n] = acc + zero_term;
#endif
  }
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& lo) {
  check_float_rows(x, "x");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), G = K / 32;
  TORCH_CHECK(x.dim() == 2 && K % 32 == 0 && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous() && packed.size(1) == K / 2,
              "int4_linear: packed must be a contiguous uint8 [N, K / 2] with K % 32 == 0");
  TORCH_CHECK(scale.is_contiguous() && lo.is_contiguous() && scale.numel() == N * G &&
                  lo.numel() == N * G && scale.scalar_type() == at::kFloat &&
                  lo.scalar_type() == at::kFloat,
              "int4_linear: scale and lo must be contiguous float32 [N, K / 32]");
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* lp = lo.data_ptr<float>();
  if (M > kInt4GemvMaxRows) {
    auto w = at::empty({N, K}, x.options());
    float* wp = w.data_ptr<float>();
    at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
      int4_dequantize_rows(pp, sp, lp, b, e, K, wp);
    });
    return at::mm(x, w.t());
  }
  auto out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  std::vector<float> xsum(M * G);  // per-group sums of each row, for the lo terms
  for (int64_t m = 0; m < M; m++) int4_group_sums(xp + m * xs, K, xsum.data() + m * G);
  at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
    for (int64_t m = 0; m < M; m++)
      int4_gemv_rows(pp, sp, lp, b, e, K, xp + m * xs, xsum.data() + m * G, op + m * N);
  });
  return out;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// W8A8 linear for any number of rows, with the arithmetic of fbgemm's path in
// tandem.model.linear.Int8Linear: each row x is scaled to absmax 1 (sx),
// quantized with the parameters fbgemm picks for the range [-1, 1] (scale
// 2/255, zero point 128), multiplied in exact int32 by the per-channel int8
// weights, and rescaled as fbgemm does: float(acc) * (a_scale * w_scale[n]),
// then * sx. Outputs are bit-identical to fbgemm's wherever fbgemm's int16
// pair sums do not saturate (tested), and exact where they do.
//
// The weights are packed so no horizontal sums are needed (fbgemm's trick):
// tile j holds output columns 16 j .. 16 j + 15, and each 64-byte row of a
// tile holds 4 consecutive inputs of its 16 columns, so one VNNI instruction
// adds 4 products to each of 16 outputs. Batch 1 streams the weights at
// memory speed (fbgemm's GEMV: ~11 GB/s); batches keep a tile pair in L1
// while 8 rows of x at a time pass it.
// x [M, K] f32; packed [ceil(N/16), ceil(K/4), 16, 4] int8 (int8_pack);
// w_sum, mult [16 ceil(N/16)]: row sums of the weights and a_scale * w_scale.
constexpr int64_t kInt8RowBlock = 8;

// Row r [K] scaled to absmax 1 and quantized (zero point 128) into q [kp]
// (kp = K rounded up to 4, the tail left 0); returns the row's scale sx.
inline float int8_quantize_row(const float* r, int64_t K, uint8_t* q) {
  const float a_inv = 1.0f / (2.0f / 255.0f);
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t k = 0; k < K; k++) amax = std::fabs(r[k]) > amax ? std::fabs(r[k]) : amax;
  const float sx = amax > 1e-12f ? amax : 1e-12f;
#pragma omp simd
  for (int64_t k = 0; k < K; k++) {
    const float v = std::nearbyint((r[k] / sx) * a_inv) + 128.0f;
    q[k] = static_cast<uint8_t>(v < 0.f ? 0.f : (v > 255.f ? 255.f : v));
  }
  return sx;
}

// Outputs of tiles [tile0, tile1) (16 each) for M quantized rows qa [M, kp]
// with scales sxs: out[m, n] = y (+ bias[n]) (+ out[m, n] when accumulate).
// Tiles go in pairs, kept in L1 while 8 rows of x at a time pass them.
inline void int8_tiles(const uint8_t* qa, int64_t kp, const float* sxs, int64_t M,
                       const int8_t* wp, const int32_t* ws, const float* mp, int64_t N,
                       int64_t tile0, int64_t tile1, const float* bias, bool accumulate,
                       float* out, int64_t os) {
  const int64_t kq = kp / 4;
  const __m512i zp = _mm512_set1_epi32(128);
  for (int64_t t0 = tile0; t0 < tile1; t0 += 2) {
    const int64_t nt = std::min<int64_t>(2, tile1 - t0);
    const int8_t* w0 = wp + t0 * kq * 64;
    const int8_t* w1 = w0 + (nt > 1 ? kq * 64 : 0);
    for (int64_t m0 = 0; m0 < M; m0 += kInt8RowBlock) {
      const int64_t mr = std::min<int64_t>(kInt8RowBlock, M - m0);
      __m512i acc[kInt8RowBlock][2];
      for (int i = 0; i < kInt8RowBlock; i++) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
      const uint8_t* a = qa + m0 * kp;
      for (int64_t c = 0; c < kq; c++) {
        const __m512i wv0 = _mm512_loadu_si512(w0 + c * 64);
        const __m512i wv1 = _mm512_loadu_si512(w1 + c * 64);
        for (int64_t i = 0; i < mr; i++) {
          int32_t four;
          std::memcpy(&four, a + i * kp + c * 4, 4);
          const __m512i av = _mm512_set1_epi32(four);
          acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], av, wv0);
          acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], av, wv1);
        }
      }
      for (int64_t j = 0; j < nt; j++) {
        const int64_t n0 = (t0 + j) * 16, nn = std::min<int64_t>(16, N - n0);
        const __mmask16 keep = static_cast<__mmask16>((1u << nn) - 1);
        const __m512i corr = _mm512_mullo_epi32(zp, _mm512_loadu_si512(ws + n0));
        const __m512 mv = _mm512_loadu_ps(mp + n0);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
        for (int64_t i = 0; i < mr; i++) {
          __m512 v = _mm512_mul_ps(
              _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][j], corr)), mv),
              _mm512_set1_ps(sxs[m0 + i]));
          float* o = out + (m0 + i) * os + n0;
          if (bias) v = _mm512_add_ps(v, bv);
          if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(keep, o), v);
          _mm512_mask_storeu_ps(o, keep, v);
        }
      }
    }
  }
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_sum,
                       const at::Tensor& mult, int64_t N) {
  check_float_rows(x, "x");
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0), kq = packed.size(1);
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kChar && packed.size(2) == 16 &&
                  packed.size(3) == 4 && kq == (K + 3) / 4 && tiles == (N + 15) / 16,
              "int8_linear: packed must be int8_pack's layout for x's width and N outputs");
  TORCH_CHECK(w_sum.scalar_type() == at::kInt && mult.scalar_type() == at::kFloat &&
                  w_sum.numel() == tiles * 16 && mult.numel() == tiles * 16,
              "int8_linear: w_sum (int32) and mult (float32) need one entry per padded output");
  auto out = at::empty({M, N}, x.options());
  // Quantized rows, zero-padded to whole 4-byte groups (padding adds 0 * w).
  const int64_t kp = kq * 4;
  std::vector<uint8_t> qa(M * kp, 0);
  std::vector<float> sxs(M);
  at::parallel_for(0, M, 64, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; m++)
      sxs[m] = int8_quantize_row(x.data_ptr<float>() + m * x.stride(0), K, qa.data() + m * kp);
  });
  at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t b, int64_t e) {
    int8_tiles(qa.data(), kp, sxs.data(), M, packed.data_ptr<int8_t>(),
               w_sum.data_ptr<int32_t>(), mult.data_ptr<float>(), N, b * 2,
               std::min(e * 2, tiles), nullptr, false, out.data_ptr<float>(), N);
  });
  return out;
}
#endif

}  // namespace tandem
