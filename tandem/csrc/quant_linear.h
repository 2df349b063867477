// Quantized matmuls: int4 and int8 W8A8 (AVX-512 VNNI where the CPU has it).
#pragma once

#include "common.h"

namespace tandem {

// int4 weights for any number of rows (torch's CPU int4 matmul decodes at ~8
// tok/s here). Group g (32 weights) of row n is 16 bytes at packed[n, 16 g]:
// byte i holds weight 32 g + i in its low nibble and 32 g + 16 + i in its high
// one, and the weight is q * scale[n, g] + lo[n, g] (Int4Linear's reference),
// scale and lo in fp16 (GGUF's Q4_0 / Q4_1 blocks exactly: d and -8 d, or d and m).
// Few rows (decode): the nibbles are unpacked in registers and each group's dot
// product is scaled once, y = sum_g scale_g (q_g . x_g) + sum_g lo_g sum(x_g),
// so the weights stream at memory speed. More rows (prefill): the weight is
// dequantized to fp32 and multiplied by torch's GEMM.
constexpr int64_t kInt4GemvMaxRows = 4;

void int4_dequantize_rows(const uint8_t* packed, const uint16_t* scale, const uint16_t* lo,
                          int64_t n0, int64_t n1, int64_t K, float* w) {
  const int64_t G = K / 32;
  for (int64_t n = n0; n < n1; n++)
    for (int64_t g = 0; g < G; g++) {
      const uint8_t* by = packed + n * (K / 2) + g * 16;
      const float s = half_to_float(scale[n * G + g]), l = half_to_float(lo[n * G + g]);
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
void int4_gemv_rows(const uint8_t* packed, const uint16_t* scale, const uint16_t* lo, int64_t n0,
                    int64_t n1, int64_t K, const float* x, const float* xsum, float* y) {
  const int64_t G = K / 32;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = packed + n * (K / 2);
    const uint16_t* sr = scale + n * G;
    float zero_term = 0.f;
    for (int64_t g = 0; g < G; g++) zero_term += half_to_float(lo[n * G + g]) * xsum[g];
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
      const __m512i v =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16)));
      const __m512 q0 = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
      const __m512 q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
      const __m512 t = _mm512_fmadd_ps(q1, _mm512_loadu_ps(x + g * 32 + 16),
                                       _mm512_mul_ps(q0, _mm512_loadu_ps(x + g * 32)));
      acc = _mm512_fmadd_ps(_mm512_set1_ps(half_to_float(sr[g])), t, acc);
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
      acc += half_to_float(sr[g]) * t;
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
                  lo.numel() == N * G && scale.scalar_type() == at::kHalf &&
                  lo.scalar_type() == at::kHalf,
              "int4_linear: scale and lo must be contiguous float16 [N, K / 32]");
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const uint16_t* sp = half_ptr(scale);
  const uint16_t* lp = half_ptr(lo);
  if (M > kInt4GemvMaxRows) {
    // Dequantized kInt4DequantRows output rows at a time for the GEMM: the fp32
    // copy stays a few MB, not the whole matrix (an 8B model's gate/up: 470 MB).
    constexpr int64_t kInt4DequantRows = 1024;
    auto out = at::empty({M, N}, x.options());
    auto w = at::empty({std::min(N, kInt4DequantRows), K}, x.options());
    for (int64_t n0 = 0; n0 < N; n0 += kInt4DequantRows) {
      const int64_t nb = std::min(kInt4DequantRows, N - n0);
      float* wp = w.data_ptr<float>();
      at::parallel_for(0, nb, 16, [&](int64_t b, int64_t e) {  // rows n0 + [b, e)
        int4_dequantize_rows(pp + n0 * (K / 2), sp + n0 * G, lp + n0 * G, b, e, K, wp);
      });
      out.narrow(1, n0, nb).copy_(at::mm(x, w.narrow(0, 0, nb).t()));
    }
    return out;
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

// W8A8 linear for any number of rows, with the arithmetic of
// tandem.model.linear.Int8Linear's reference: the weights are int8 with one
// scale per output channel; each row of x is quantized to int8 in groups of
// 32 inputs, one scale (absmax / 127) per group, the way llama.cpp's Q8_0
// quantizes activations (a per-token scale cost +4.8% perplexity on the
// default model, per-group +0.9%: one outlier no longer flattens the rest of
// the row). Each group's products are summed exactly in int32 and scaled
// once: y[n] = w_scale[n] * sum_g x_scale[g] * sum_{k in g} q_x[k] q_w[n, k].
//
// VNNI multiplies unsigned by signed bytes, so the weights are stored + 128
// (u8) and each group subtracts 128 * sum_{k in g} q_x[k]. They are packed so
// no horizontal sums are needed (fbgemm's trick): tile j holds output columns
// 16 j .. 16 j + 15, and each 64-byte row of a tile holds 4 consecutive
// inputs of its 16 columns, so one instruction adds 4 products to each of 16
// outputs. Batch 1 streams the weights at memory speed; batches keep a tile
// pair in L1 while 4 rows of x at a time pass it. Without VNNI a portable
// loop computes the same integers.
// x [M, K] f32; packed [ceil(N/16), kp/4, 16, 4] uint8 (K zero-padded to kp,
// a multiple of 32, padding weights 128 = 0); w_scale [16 ceil(N/16)].
// Optionally the weights also have a scale per group of 32 inputs (GGUF's
// Q8_0 blocks exactly: q * d): g_scale fp16 [ceil(N/16), kp/32, 16], each
// tile's group scales together; then y[n] = w_scale[n] * sum_g x_scale[g] *
// g_scale[n, g] * sum_{k in g} q_x[k] q_w[n, k].
constexpr int64_t kInt8Group = 32;
constexpr int64_t kInt8RowBlock = 4;

// Row r [K] quantized per group of 32 into q [kp] (the tail left 0), with
// each group's scale and the sum of its quantized values.
inline void int8_quantize_row(const float* r, int64_t K, int8_t* q, float* scale,
                              int32_t* qsum) {
  for (int64_t g = 0, k0 = 0; k0 < K; g++, k0 += kInt8Group) {
    const int64_t n = std::min(kInt8Group, K - k0);
    float amax = 0.f;
#pragma omp simd reduction(max : amax)
    for (int64_t k = 0; k < n; k++) amax = std::fabs(r[k0 + k]) > amax ? std::fabs(r[k0 + k]) : amax;
    const float s = std::max(amax, 1e-12f) / 127.0f;
    int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < n; k++) {
      const float v = std::nearbyint(r[k0 + k] / s);
      q[k0 + k] = static_cast<int8_t>(v);
      sum += static_cast<int32_t>(v);
    }
    scale[g] = s;
    qsum[g] = sum;
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Outputs of tiles [tile0, tile1) (16 each) for M quantized rows q [M, kp]
// (scales and sums [M, kp / 32]): out[m, n] = y (+ bias[n]) (+ out[m, n] when
// accumulate).
inline void int8_tiles(const int8_t* q, const float* xs, const int32_t* qs, int64_t kp, int64_t M,
                       const uint8_t* wp, const float* w_scale, const uint16_t* gs, int64_t N,
                       int64_t tile0, int64_t tile1, const float* bias, bool accumulate,
                       float* out, int64_t os) {
  const int64_t kq = kp / 4, G = kp / kInt8Group;
  for (int64_t t0 = tile0; t0 < tile1; t0 += 2) {
    const int64_t nt = std::min<int64_t>(2, tile1 - t0);
    const uint8_t* w0 = wp + t0 * kq * 64;
    const uint8_t* w1 = w0 + (nt > 1 ? kq * 64 : 0);
    for (int64_t m0 = 0; m0 < M; m0 += kInt8RowBlock) {
      const int64_t mr = std::min<int64_t>(kInt8RowBlock, M - m0);
      __m512 facc[kInt8RowBlock][2];
      for (int i = 0; i < kInt8RowBlock; i++) facc[i][0] = facc[i][1] = _mm512_setzero_ps();
      for (int64_t g = 0; g < G; g++) {
        __m512i acc[kInt8RowBlock][2];
        for (int i = 0; i < kInt8RowBlock; i++) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
        for (int64_t c = g * 8; c < g * 8 + 8; c++) {
          const __m512i wv0 = _mm512_loadu_si512(w0 + c * 64);
          const __m512i wv1 = _mm512_loadu_si512(w1 + c * 64);
          for (int64_t i = 0; i < mr; i++) {
            int32_t four;
            std::memcpy(&four, q + (m0 + i) * kp + c * 4, 4);
            const __m512i av = _mm512_set1_epi32(four);
            acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], wv0, av);
            acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], wv1, av);
          }
        }
        __m512 gv[2] = {_mm512_set1_ps(1.f), _mm512_set1_ps(1.f)};
        for (int64_t j = 0; gs && j < nt; j++)
          gv[j] = _mm512_cvtph_ps(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(gs + ((t0 + j) * G + g) * 16)));
        for (int64_t i = 0; i < mr; i++) {
          const __m512i corr = _mm512_set1_epi32(128 * qs[(m0 + i) * G + g]);
          const __m512 sv = _mm512_set1_ps(xs[(m0 + i) * G + g]);
          for (int64_t j = 0; j < nt; j++)
            facc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][j], corr)),
                                         gs ? _mm512_mul_ps(sv, gv[j]) : sv, facc[i][j]);
        }
      }
      for (int64_t j = 0; j < nt; j++) {
        const int64_t n0 = (t0 + j) * 16, nn = std::min<int64_t>(16, N - n0);
        const __mmask16 keep = static_cast<__mmask16>((1u << nn) - 1);
        const __m512 ws = _mm512_loadu_ps(w_scale + n0);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
        for (int64_t i = 0; i < mr; i++) {
          __m512 v = _mm512_mul_ps(facc[i][j], ws);
          float* o = out + (m0 + i) * os + n0;
          if (bias) v = _mm512_add_ps(v, bv);
          if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(keep, o), v);
          _mm512_mask_storeu_ps(o, keep, v);
        }
      }
    }
  }
}

#else
// The same integers without VNNI: output j of a tile, input 4 c + r, is byte
// 64 c + 4 j + r of the tile.
inline void int8_tiles(const int8_t* q, const float* xs, const int32_t* qs, int64_t kp, int64_t M,
                       const uint8_t* wp, const float* w_scale, const uint16_t* gs, int64_t N,
                       int64_t tile0, int64_t tile1, const float* bias, bool accumulate,
                       float* out, int64_t os) {
  const int64_t kq = kp / 4, G = kp / kInt8Group;
  for (int64_t t = tile0; t < tile1; t++) {
    const uint8_t* w = wp + t * kq * 64;
    for (int64_t m = 0; m < M; m++) {
      float facc[16] = {0.f};
      for (int64_t g = 0; g < G; g++) {
        int32_t acc[16] = {0};
        for (int64_t c = g * 8; c < g * 8 + 8; c++)
          for (int64_t r = 0; r < 4; r++) {
            const int32_t a = q[m * kp + c * 4 + r];
#pragma omp simd
            for (int64_t j = 0; j < 16; j++) acc[j] += static_cast<int32_t>(w[c * 64 + j * 4 + r]) * a;
          }
        const int32_t corr = 128 * qs[m * G + g];
        const float sv = xs[m * G + g];
        for (int64_t j = 0; j < 16; j++)
          facc[j] += static_cast<float>(acc[j] - corr) *
                     (gs ? sv * half_to_float(gs[(t * G + g) * 16 + j]) : sv);
      }
      const int64_t n0 = t * 16;
      for (int64_t j = 0; j < 16 && n0 + j < N; j++) {
        float v = facc[j] * w_scale[n0 + j];
        if (bias) v += bias[n0 + j];
        float& o = out[m * os + n0 + j];
        o = accumulate ? o + v : v;
      }
    }
  }
}
#endif

// An int8 weight's optional group scales (empty: none) checked against its layout.
inline void check_int8_group_scales(const at::Tensor& g_scale, int64_t tiles, int64_t kp) {
  TORCH_CHECK(g_scale.numel() == 0 ||
                  (g_scale.scalar_type() == at::kHalf && g_scale.is_contiguous() &&
                   g_scale.numel() == tiles * (kp / kInt8Group) * 16),
              "int8 group scales must be float16 [ceil(N / 16), padded K / 32, 16] or empty");
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                       const at::Tensor& g_scale, int64_t N) {
  check_float_rows(x, "x");
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0), kq = packed.size(1);
  const int64_t kp = (K + kInt8Group - 1) / kInt8Group * kInt8Group;
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kByte && packed.size(2) == 16 &&
                  packed.size(3) == 4 && kq * 4 == kp && tiles == (N + 15) / 16,
              "int8_linear: packed must be Int8Linear's layout for x's width and N outputs");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() &&
                  w_scale.numel() == tiles * 16,
              "int8_linear: w_scale must be float32 with one entry per padded output");
  check_int8_group_scales(g_scale, tiles, kp);
  const uint16_t* gs = g_scale.numel() ? half_ptr(g_scale) : nullptr;
  auto out = at::empty({M, N}, x.options());
  const int64_t G = kp / kInt8Group;
  std::vector<int8_t> q(M * kp, 0);
  std::vector<float> xs(M * G);
  std::vector<int32_t> qs(M * G);
  at::parallel_for(0, M, 64, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; m++)
      int8_quantize_row(x.data_ptr<float>() + m * x.stride(0), K, q.data() + m * kp,
                        xs.data() + m * G, qs.data() + m * G);
  });
  at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t b, int64_t e) {
    int8_tiles(q.data(), xs.data(), qs.data(), kp, M, packed.data_ptr<uint8_t>(),
               w_scale.data_ptr<float>(), gs, N, b * 2, std::min(e * 2, tiles), nullptr, false,
               out.data_ptr<float>(), N);
  });
  return out;
}

}  // namespace tandem
