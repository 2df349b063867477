// Quantized matmuls: int8 and int4 weights times int8 activations (W8A8 and
// W4A8), one tiled kernel for both (AVX-512 VNNI where the CPU has it).
//
// The arithmetic is tandem.model.linear's reference: each row of x is
// quantized to int8 in groups of 32 inputs, one scale (absmax / 127) per group,
// the way llama.cpp's Q8_0 quantizes activations (a per-token scale cost +4.8%
// perplexity on the default model, per-group +0.9%: one outlier no longer
// flattens the rest of the row). Each group's products are summed exactly in
// int32 and scaled once:
//   int8: y[n] = w_scale[n] * sum_g xs[g] * gs[n, g] * sum_{k in g} qx[k] qw[n, k]
//         (gs = 1 without group scales; GGUF's Q8_0 blocks are qw * gs exactly);
//   int4: y[n] = sum_g xs[g] * (gs[n, g] * sum_{k in g} qx[k] qw[n, k] + lo[n, g] * sum_{k in g} qx[k])
//         (the weight is qw * gs + lo, qw in 0..15: GGUF's Q4_1 / Q4_K blocks exactly);
//   int4 with the fixed offset 8 (GGUF's Q4_0, w = (qw - 8) * gs): lo = -8 gs,
//         which the integer sums take instead (below), and the tiles hold no lo.
//
// VNNI multiplies unsigned by signed bytes: int4 weights are unsigned already;
// int8 weights are stored + 128 (u8). A group's integer sums start at -offset
// * sum qx (offset 128 for int8, 8 for Q4_0's int4, 0 with a lo: QuantizedRows
// holds both starts, broadcast from memory), so the
// float epilogue per group, row and tile is a convert and a multiply-add, plus
// a multiply with group scales and a second multiply-add with lo. That
// epilogue is what keeps a batch below VPDPBUSD's peak (dropping the lo term
// takes int4 past Q8_0).
// Weights are packed so no horizontal sums are needed (fbgemm's trick): tile t
// holds output columns 16 t .. 16 t + 15, and each 64-byte chunk of a tile
// holds 4 consecutive inputs of its 16 columns (byte 4 j + r: column j), so one
// instruction adds 4 products to each of 16 outputs.
//   int8: chunk c holds inputs 4c .. 4c + 3 (packed [tiles, kp / 4, 16, 4]);
//   int4: group g of a tile is one 320-byte block (packed [tiles, G, 320]): 4
//         chunks of 64 bytes, chunk c holding in its low nibbles inputs 32g + 4c ..
//         32g + 4c + 3 and in its high nibbles the 16 after them (a row's GGUF
//         bytes tiled the way int8's are), then the group's 16 fp16 scales and 16
//         fp16 lo (Q4_0's blocks: 288 bytes, no lo). One stream per tile: with
//         scales and lo in two arrays beside it a single row's matvec kept 12
//         streams in flight per thread and read a DRAM-sized weight slower.
// int8's group scales (Q8_0) are fp16 [tiles, G, 16], each tile's together.
// Batch 1 streams the weights at memory speed (int4 reads half of int8's
// bytes); batches keep a tile pair in L2 while 4 rows of x at a time pass it.
// Batched, both run below VPDPBUSD's peak (int8 about as fast as torch._int_mm
// without group scales): the per-group float epilogue shares the pipes.
// Without VNNI a portable loop computes the same integers.
#pragma once

#include "common.h"

namespace tandem {

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

// The tile formats (see the top of this file).
enum class TileFormat { kInt8, kInt4, kInt4Offset8 };

// A quantized weight as the tile kernel reads it: int8 (w_scale [16 tiles],
// gs optional) or int4 (its scales, and lo unless kInt4Offset8, inside packed).
struct TileWeight {
  TileFormat format;
  const uint8_t* packed;
  const float* w_scale;  // int8 only
  const uint16_t* gs;    // int8 only: fp16 [tiles, G, 16], or nullptr (no group scales)
  int64_t N;
};

// An int4 tile's bytes per group: 32 inputs x 16 columns of nibbles, 16 fp16
// scales, 16 fp16 lo (none with the fixed offset).
constexpr int64_t kInt4GroupBytes = 256 + 32 + 32;
constexpr int64_t kInt4Offset8GroupBytes = 256 + 32;

template <TileFormat F>
constexpr int64_t group_bytes() {
  return F == TileFormat::kInt8 ? kInt8Group * 16
                                : F == TileFormat::kInt4 ? kInt4GroupBytes : kInt4Offset8GroupBytes;
}

// What the stored weights exceed the true ones by, in units of their scale
// (int8: + 128 to make them u8; Q4_0: 8), subtracted from each group's sums.
template <TileFormat F>
constexpr int32_t weight_offset() {
  return F == TileFormat::kInt8 ? 128 : F == TileFormat::kInt4Offset8 ? 8 : 0;
}

// Bytes of one tile of 16 outputs over kp inputs.
template <TileFormat F>
constexpr int64_t tile_bytes(int64_t kp) {
  return kp / kInt8Group * group_bytes<F>();
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Rows m0 .. m0 + MR - 1 of tiles t0 .. t0 + NT - 1, of which the first nt are
// stored (the others repeat tile t0 + nt - 1). MR and NT are template
// parameters so the accumulators live in registers and the loops unroll: with a
// runtime row count g++ kept flags on the stack and branched per row inside the
// innermost loop (batched matmuls far below VNNI's peak).
//
// pf, when set, is a share of the next tiles' bytes to bring into cache while
// this block multiplies: pf_group bytes of it per group (see quant_tiles).
//
// A block of one row and one tile (a single stream's decode) sums each group
// in two accumulators, alternate chunks (int4: low and high nibbles), halving
// its VPDPBUSD chain: a little faster from L3. Four tiles at a time are faster
// still from L3 (see quant_tiles for why one row takes one tile anyway).
template <TileFormat F, int MR, int NT>
inline void quant_block(const int8_t* q, const float* xs, const int32_t* start, const float* xq,
                        int64_t kp, int64_t m0, const TileWeight& w, int64_t t0, int64_t nt,
                        const float* bias, bool accumulate, float* out, int64_t os,
                        const uint8_t* pf = nullptr, int64_t pf_group = 0) {
  constexpr bool kInt4 = F != TileFormat::kInt8;
  constexpr bool kSplit = MR == 1 && NT == 1;
  constexpr int64_t GB = group_bytes<F>();
  const int64_t G = kp / kInt8Group, tb = tile_bytes<F>(kp);
  const __m512i low4 = _mm512_set1_epi8(15);
  int64_t tile[NT];
  const uint8_t* wt[NT];
  for (int j = 0; j < NT; j++) {
    tile[j] = t0 + std::min<int64_t>(j, nt - 1);
    wt[j] = w.packed + tile[j] * tb;
  }
  const int8_t* qm = q + m0 * kp;
  auto broadcast4 = [&](int i, int64_t k) {  // q[m0 + i, k .. k + 3] in every lane
    int32_t four;
    std::memcpy(&four, qm + i * kp + k, 4);
    return _mm512_set1_epi32(four);
  };
  __m512 facc[MR][NT];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NT; j++) facc[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    for (int64_t o = 0; o < pf_group; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(pf + g * pf_group + o), _MM_HINT_T1);
    __m512i acc[MR][NT], acc2 = _mm512_setzero_si512();  // acc2: kSplit's second chain
    for (int i = 0; i < MR; i++) {
      // Broadcast from memory: computed here (a multiply, then a broadcast from
      // a general register, per row and group) it was slower.
      const __m512i init = weight_offset<F>() ? _mm512_set1_epi32(start[(m0 + i) * G + g])
                                              : _mm512_setzero_si512();
      for (int j = 0; j < NT; j++) acc[i][j] = init;
    }
    if constexpr (kInt4) {
      for (int c = 0; c < 4; c++) {
        __m512i lw[NT], hw[NT];
        for (int j = 0; j < NT; j++) {
          const __m512i r = _mm512_loadu_si512(wt[j] + g * GB + c * 64);
          lw[j] = _mm512_and_si512(r, low4);
          hw[j] = _mm512_and_si512(_mm512_srli_epi16(r, 4), low4);
        }
        for (int i = 0; i < MR; i++) {
          const __m512i al = broadcast4(i, g * 32 + c * 4);
          const __m512i ah = broadcast4(i, g * 32 + 16 + c * 4);
          for (int j = 0; j < NT; j++) {
            acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], lw[j], al);
            __m512i& high = kSplit ? acc2 : acc[i][j];
            high = _mm512_dpbusd_epi32(high, hw[j], ah);
          }
        }
      }
    } else {
      // Counted from 0 with the unroll asked for, the 8 chunks of a group unroll
      // and the accumulators stay put; counted from g * 8, g++ 12 kept the loop
      // and copied all MR x NT accumulators between registers every chunk (16
      // moves per 8 VPDPBUSD). Unrolled, the kernel is faster from cache; decode
      // steps bound by DRAM do not change.
#pragma GCC unroll 8
      for (int c = 0; c < 8; c++) {
        __m512i wv[NT];
        for (int j = 0; j < NT; j++) wv[j] = _mm512_loadu_si512(wt[j] + (g * 8 + c) * 64);
        for (int i = 0; i < MR; i++) {
          const __m512i av = broadcast4(i, (g * 8 + c) * 4);
          for (int j = 0; j < NT; j++) {
            __m512i& a = kSplit && (c & 1) ? acc2 : acc[i][j];
            a = _mm512_dpbusd_epi32(a, wv[j], av);
          }
        }
      }
    }
    if constexpr (kSplit) acc[0][0] = _mm512_add_epi32(acc[0][0], acc2);
    auto fp16x16 = [](const void* p) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    };
    const bool scaled = kInt4 || w.gs;  // group scales (int8's are optional)
    __m512 gv[NT], lv[NT];
    for (int j = 0; j < NT; j++) {
      if constexpr (kInt4)
        gv[j] = fp16x16(wt[j] + g * GB + 256);
      else
        gv[j] = w.gs ? fp16x16(w.gs + (tile[j] * G + g) * 16) : _mm512_set1_ps(1.f);
      if constexpr (F == TileFormat::kInt4) lv[j] = fp16x16(wt[j] + g * GB + 288);
    }
    for (int i = 0; i < MR; i++) {
      const int64_t mg = (m0 + i) * G + g;
      const __m512 sv = _mm512_set1_ps(xs[mg]);
      for (int j = 0; j < NT; j++) {
        facc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][j]),
                                     scaled ? _mm512_mul_ps(sv, gv[j]) : sv, facc[i][j]);
        if constexpr (F == TileFormat::kInt4)
          facc[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(xq[mg]), lv[j], facc[i][j]);
      }
    }
  }
  for (int64_t j = 0; j < nt; j++) {
    const int64_t n0 = (t0 + j) * 16, nn = std::min<int64_t>(16, w.N - n0);
    const __mmask16 keep = static_cast<__mmask16>((1u << nn) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < MR; i++) {
      __m512 v = facc[i][j];
      if constexpr (F == TileFormat::kInt8) v = _mm512_mul_ps(v, _mm512_loadu_ps(w.w_scale + n0));
      float* o = out + (m0 + i) * os + n0;
      if (bias) v = _mm512_add_ps(v, bv);
      if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(keep, o), v);
      _mm512_mask_storeu_ps(o, keep, v);
    }
  }
}

// Outputs of tiles [tile0, tile1) (16 each) for M quantized rows q [M, kp]
// (scales xs, the weight offset's starting sums and xs * sum qx as xq [M, kp / 32]):
// out[m, n] = y (+ bias[n]) (+ out[m, n]
// when accumulate). Batches: a tile pair stays in L2 while blocks of 4 rows
// pass it; one row: one tile after the other.
template <TileFormat F>
inline void quant_tiles(const int8_t* q, const float* xs, const int32_t* start, const float* xq,
                        int64_t kp, int64_t M, const TileWeight& w, int64_t tile0, int64_t tile1,
                        const float* bias, bool accumulate, float* out, int64_t os) {
  if (M == 1) {
    // Tiles lie one after the other, so a thread reads its share as one
    // sequential stream (int8 with group scales: two). Four tiles at a time
    // (four streams 16 x kp bytes apart) were faster from L3 for int4 (above)
    // but read a DRAM-sized weight, what a decode step streams, slower, and
    // single-stream decode with them was slower too.
    for (int64_t t = tile0; t < tile1; t++)
      quant_block<F, 1, 1>(q, xs, start, xq, kp, 0, w, t, 1, bias, accumulate, out, os);
    return;
  }
  // A batch reads each tile pair from memory in its first row block and from
  // L2 in the others; the row blocks of a pair each bring 1 / blocks of the
  // next pair into cache, so that read overlaps with arithmetic (batched
  // matmuls over weights from DRAM, and batched serving, went faster).
  const int64_t tb = tile_bytes<F>(kp), G = kp / kInt8Group;
  const int64_t blocks = (M + kInt8RowBlock - 1) / kInt8RowBlock;
  const int64_t pf_group = (2 * tb / G / blocks + 63) / 64 * 64;
  for (int64_t t0 = tile0; t0 < tile1; t0 += 2) {
    const int64_t nt = std::min<int64_t>(2, tile1 - t0);
    const uint8_t* next = t0 + 2 < tile1 ? w.packed + (t0 + 2) * tb : nullptr;
    const int64_t pf_left = next ? std::min<int64_t>(2, tile1 - t0 - 2) * tb : 0;
    auto pf = [&](int64_t m0) -> std::pair<const uint8_t*, int64_t> {
      const int64_t off = m0 / kInt8RowBlock * pf_group * G;  // this block's share
      if (!next || off >= pf_left) return {nullptr, 0};
      return {next + off, std::min(pf_group, (pf_left - off) / G / 64 * 64)};
    };
    int64_t m0 = 0;
    for (; m0 + kInt8RowBlock <= M; m0 += kInt8RowBlock) {
      const auto [p, pg] = pf(m0);
      quant_block<F, kInt8RowBlock, 2>(q, xs, start, xq, kp, m0, w, t0, nt, bias, accumulate, out,
                                       os, p, pg);
    }
    static_assert(kInt8RowBlock == 4, "the tail below covers 1 to 3 rows");
    const auto [p, pg] = pf(m0);
    switch (M - m0) {
      case 3:
        quant_block<F, 3, 2>(q, xs, start, xq, kp, m0, w, t0, nt, bias, accumulate, out, os, p, pg);
        break;
      case 2:
        quant_block<F, 2, 2>(q, xs, start, xq, kp, m0, w, t0, nt, bias, accumulate, out, os, p, pg);
        break;
      case 1:
        quant_block<F, 1, 2>(q, xs, start, xq, kp, m0, w, t0, nt, bias, accumulate, out, os, p, pg);
        break;
      default:
        break;
    }
  }
}

#else
// The same integers without VNNI.
template <TileFormat F>
inline void quant_tiles(const int8_t* q, const float* xs, const int32_t* start, const float* xq,
                        int64_t kp, int64_t M, const TileWeight& w, int64_t tile0, int64_t tile1,
                        const float* bias, bool accumulate, float* out, int64_t os) {
  constexpr bool kInt4 = F != TileFormat::kInt8;
  constexpr int64_t GB = group_bytes<F>();
  const int64_t G = kp / kInt8Group, tb = tile_bytes<F>(kp);
  for (int64_t t = tile0; t < tile1; t++) {
    const uint8_t* wt = w.packed + t * tb;
    auto weight = [&](int64_t k, int64_t j) -> int32_t {  // input k, column j (int8: + 128)
      if constexpr (kInt4) {
        const int64_t g = k / 32, h = k % 32;
        const uint8_t b = wt[g * GB + ((h % 16) / 4) * 64 + j * 4 + k % 4];
        return h < 16 ? (b & 15) : (b >> 4);
      } else {
        return wt[(k / 4) * 64 + j * 4 + k % 4];
      }
    };
    auto int4_group = [&](int64_t g, int64_t off, int64_t j) {  // scale (0) or lo (32)
      uint16_t h;
      std::memcpy(&h, wt + g * GB + 256 + off + 2 * j, 2);
      return half_to_float(h);
    };
    for (int64_t m = 0; m < M; m++) {
      float facc[16] = {0.f};
      for (int64_t g = 0; g < G; g++) {
        int32_t acc[16] = {0};
        for (int64_t k = g * kInt8Group; k < (g + 1) * kInt8Group; k++)
          for (int64_t j = 0; j < 16; j++) acc[j] += weight(k, j) * q[m * kp + k];
        const int64_t mg = m * G + g;
        for (int64_t j = 0; j < 16; j++) {
          const float gsv = kInt4 ? int4_group(g, 0, j)
                                  : w.gs ? half_to_float(w.gs[(t * G + g) * 16 + j]) : 1.f;
          facc[j] += static_cast<float>(acc[j] + (weight_offset<F>() ? start[mg] : 0)) * xs[mg] * gsv;
          if constexpr (F == TileFormat::kInt4)
            facc[j] += xq[mg] * int4_group(g, 32, j);
        }
      }
      const int64_t n0 = t * 16;
      for (int64_t j = 0; j < 16 && n0 + j < w.N; j++) {
        float v = kInt4 ? facc[j] : facc[j] * w.w_scale[n0 + j];
        if (bias) v += bias[n0 + j];
        float& o = out[m * os + n0 + j];
        o = accumulate ? o + v : v;
      }
    }
  }
}
#endif

// int8's fp16 group scales of a tiled weight ([tiles, G, 16]), or empty.
inline bool tile_groups_ok(const at::Tensor& t, int64_t tiles, int64_t kp) {
  return t.numel() == 0 ||
         (t.device().is_cpu() && t.scalar_type() == at::kHalf && t.is_contiguous() &&
          t.numel() == tiles * (kp / kInt8Group) * 16);
}

// Checks a tiled weight's tensors against an [N, K] matmul: int8 (packed
// [tiles, kp / 4, 16, 4], w_scale float32 [16 tiles], group scales or empty) or
// int4 (packed [tiles, K / 32, 320] with its scales and lo, or [.., 288] with
// its scales for the fixed offset 8; a and b empty).
inline void check_tiles(bool int4, const at::Tensor& packed, const at::Tensor& a,
                        const at::Tensor& b, int64_t N, int64_t K, const char* name) {
  const int64_t tiles = (N + 15) / 16, kp = (K + kInt8Group - 1) / kInt8Group * kInt8Group;
  bool ok = packed.device().is_cpu() && packed.is_contiguous() &&
            packed.scalar_type() == at::kByte && packed.size(0) == tiles;
  if (int4)
    ok = ok && K % kInt8Group == 0 && packed.dim() == 3 && packed.size(1) * kInt8Group == K &&
         (packed.size(2) == kInt4GroupBytes || packed.size(2) == kInt4Offset8GroupBytes) &&
         a.numel() == 0 && b.numel() == 0;
  else
    ok = ok && packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 4 &&
         packed.size(1) * 4 == kp && a.scalar_type() == at::kFloat && a.is_contiguous() &&
         a.numel() == tiles * 16 && tile_groups_ok(b, tiles, kp);
  TORCH_CHECK(ok, name, ": the tensors do not hold a tiled ", int4 ? "int4" : "int8", " ", N,
              " x ", K, " weight (tandem.model.linear's layout)");
}

// A checked weight's format follows from its tensors: int4 tiles without lo
// are 288 bytes a group.
inline TileWeight tile_weight(bool int4, const at::Tensor& packed, const at::Tensor& a,
                              const at::Tensor& b, int64_t N) {
  if (int4)
    return {packed.size(2) == kInt4Offset8GroupBytes ? TileFormat::kInt4Offset8 : TileFormat::kInt4,
            packed.data_ptr<uint8_t>(), nullptr, nullptr, N};
  return {TileFormat::kInt8, packed.data_ptr<uint8_t>(), a.data_ptr<float>(),
          b.numel() ? half_ptr(b) : nullptr, N};
}

// Rows x [M, K] quantized for the tile kernel: q [M, kp] and, per group [M, kp / 32],
// its scale and what its integer sums start at for each weight offset.
struct QuantizedRows {
  int64_t M = 0, kp = 0;
  std::vector<int8_t> q;
  std::vector<float> xs;
  std::vector<int32_t> start128, start8;  // -128 / -8 x the group's sum of q
  // xs * sum q, what a group's lo multiplies (int4 with lo): once per row, so the
  // kernel broadcasts it from memory instead of converting and multiplying it
  // for every tile pair.
  std::vector<float> xq;

  void quantize(const float* x, int64_t stride, int64_t M_, int64_t K, bool parallel) {
    M = M_;
    kp = (K + kInt8Group - 1) / kInt8Group * kInt8Group;
    const int64_t G = kp / kInt8Group;
    q.assign(M * kp, 0);
    xs.resize(M * G);
    start128.resize(M * G);
    start8.resize(M * G);
    xq.resize(M * G);
    auto rows = [&](int64_t b, int64_t e) {
      for (int64_t m = b; m < e; m++) {
        int8_quantize_row(x + m * stride, K, q.data() + m * kp, xs.data() + m * G,
                          start128.data() + m * G);  // the sums, scaled below
        for (int64_t g = m * G; g < (m + 1) * G; g++) {
          const int32_t sum = start128[g];
          xq[g] = xs[g] * static_cast<float>(sum);
          start8[g] = -8 * sum;
          start128[g] = -128 * sum;
        }
      }
    };
    if (parallel)
      at::parallel_for(0, M, 64, rows);
    else
      rows(0, M);
  }

  // Outputs of tiles [tile0, tile1) of weight w into out (see quant_tiles).
  void apply(const TileWeight& w, int64_t tile0, int64_t tile1, const float* bias,
             bool accumulate, float* out, int64_t os) const {
    auto run = [&](auto format) {
      constexpr TileFormat F = decltype(format)::value;
      static_assert(weight_offset<TileFormat::kInt8>() == 128 &&
                    weight_offset<TileFormat::kInt4Offset8>() == 8);
      const int32_t* start = F == TileFormat::kInt8 ? start128.data() : start8.data();
      quant_tiles<F>(q.data(), xs.data(), start, xq.data(), kp, M, w, tile0, tile1, bias,
                     accumulate, out, os);
    };
    switch (w.format) {
      case TileFormat::kInt8:
        return run(std::integral_constant<TileFormat, TileFormat::kInt8>{});
      case TileFormat::kInt4:
        return run(std::integral_constant<TileFormat, TileFormat::kInt4>{});
      case TileFormat::kInt4Offset8:
        return run(std::integral_constant<TileFormat, TileFormat::kInt4Offset8>{});
    }
  }
};

// y = x W^T for a tiled int8 (a: w_scale, b: group scales or empty) or int4
// (a, b empty) weight of N outputs.
at::Tensor quant_linear(bool int4, const at::Tensor& x, const at::Tensor& packed,
                        const at::Tensor& a, const at::Tensor& b, int64_t N) {
  check_float_rows(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be a matrix");
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0);
  check_tiles(int4, packed, a, b, N, K, int4 ? "int4_linear" : "int8_linear");
  const TileWeight w = tile_weight(int4, packed, a, b, N);
  auto out = at::empty({M, N}, x.options());
  QuantizedRows rows;
  rows.quantize(x.data_ptr<float>(), x.stride(0), M, K, true);
  at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t b0, int64_t e) {
    rows.apply(w, b0 * 2, std::min(e * 2, tiles), nullptr, false, out.data_ptr<float>(), N);
  });
  return out;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                       const at::Tensor& g_scale, int64_t N) {
  return quant_linear(false, x, packed, w_scale, g_scale, N);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  return quant_linear(true, x, packed, at::empty({0}), at::empty({0}), N);
}

}  // namespace tandem
