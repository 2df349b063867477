// Prefill attention over the paged KV cache: each sequence's new queries (the
// last q_len of its ctx tokens, already written to the cache) attend causally
// to its context (or, in a sliding window of W, to their last W keys),
// reading K/V through the block table.
//
// It replaces a gather of each context into a padded fp32 copy and torch's
// SDPA with an additive mask, which ran well below the fp32 FMA peak and took
// much of a long prompt's prefill (benchmarks/prefill_attention.py compares
// them). On a bf16 cache with AVX512_BF16 the products are bf16 pairs
// (tile_block_bf16), faster than the fp16 cache's kernel.
#pragma once

#include "attention.h"

namespace tandem {

// A cache row of D values as fp32, times its scale (1 but for int8).
template <typename KV>
inline void widen_row(const KV* src, float s, int64_t D, float* dst) {
#ifdef __AVX512F__
  if (D % 16 == 0) {
    const __m512 sv = _mm512_set1_ps(s);
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(load16(src + d), sv));
    return;
  }
#endif
  for (int64_t d = 0; d < D; d++) dst[d] = static_cast<float>(src[d]) * s;
}

// A tile is up to 16 query rows of one KV head: (query token, query head)
// pairs, one per vector lane. Everything per row then lives in lanes: a key's
// scores for the tile are one vector (the sum over d of Q^T[d] times the key's
// d-th value), the online softmax's max and sum need no horizontal reduction,
// and the output accumulates transposed, O^T[d] += P[key] * V[key][d].
struct PrefillTile {
  float* qt;  // [D][16] the rows' queries, transposed and scaled (bf16 tiles: unscaled)
  float* ot;  // [D][16] their un-normalized outputs, transposed
  float m[16], l[16];
  int32_t limit[16];  // the last key position each row sees (padding lanes: the last row's)
  int32_t first[16];  // the first (0 but in a sliding window); lanes ascend in both
  int64_t rows, keys;
  float softcap;  // scores soft-capped at this (Gemma 2), or 0
};

#ifdef __AVX512F__
// The causal mask (and a window's) on a block's scores sc [n][16], in blocks
// that reach past a row's position or before its first key, and the rows' new
// max; where a row's max grew, its sum and outputs are rescaled. Returns the
// max to subtract, which t.m then holds: -FLT_MAX for a row that has seen no
// key yet (a window's row whose first key lies past this block), so that its
// masked scores come out ~1e-38 (exp_approx's floor), not NaN.
inline __m512 block_softmax(PrefillTile& t, int64_t n, int64_t k0, int64_t D, float* sc) {
  const __m512i lim = _mm512_loadu_si512(t.limit), first = _mm512_loadu_si512(t.first);
  const __m512 lowest = _mm512_set1_ps(-INFINITY);
  const __m512 mold = _mm512_loadu_ps(t.m);
  __m512 mv = mold;
  const bool masked = k0 + n - 1 > t.limit[0] || k0 < t.first[15];
  for (int64_t o = 0; o < n; o++) {
    __m512 s = _mm512_load_ps(sc + o * 16);
    if (masked) {
      const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(k0 + o));
      const __mmask16 out =
          _mm512_cmpgt_epi32_mask(key, lim) | _mm512_cmplt_epi32_mask(key, first);
      s = _mm512_mask_mov_ps(s, out, lowest);
      _mm512_store_ps(sc + o * 16, s);
    }
    mv = _mm512_max_ps(mv, s);
  }
  const __m512 base = _mm512_max_ps(mv, _mm512_set1_ps(-FLT_MAX));
  if (_mm512_cmp_ps_mask(mv, mold, _CMP_GT_OQ)) {
    const __m512 alpha = exp_approx16(_mm512_sub_ps(mold, base));  // -inf - -inf: NaN
    _mm512_storeu_ps(t.l, _mm512_mul_ps(_mm512_loadu_ps(t.l), alpha));
    for (int64_t d = 0; d < D; d++)
      _mm512_store_ps(t.ot + d * 16, _mm512_mul_ps(_mm512_load_ps(t.ot + d * 16), alpha));
    _mm512_storeu_ps(t.m, mv);
  }
  return base;
}
#endif

// One block's n staged keys (kb, vb: [n][D] fp32, from key position k0) into
// a tile; sc: [block][16] scratch.
inline void tile_block(PrefillTile& t, const float* kb, const float* vb, int64_t n, int64_t k0,
                       int64_t D, float* sc) {
  const float* qt = t.qt;
  float* ot = t.ot;
#ifdef __AVX512F__
  if (D % 16 == 0) {
    // Scores, 8 keys at a time: 8 independent FMA chains hide the latency.
    int64_t o = 0;
    for (; o + 8 <= n; o += 8) {
      __m512 acc[8];
      for (int k = 0; k < 8; k++) acc[k] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d++) {
        const __m512 qd = _mm512_load_ps(qt + d * 16);
        for (int k = 0; k < 8; k++)
          acc[k] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kb[(o + k) * D + d]), acc[k]);
      }
      for (int k = 0; k < 8; k++) _mm512_store_ps(sc + (o + k) * 16, acc[k]);
    }
    for (; o < n; o++) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d++)
        acc = _mm512_fmadd_ps(_mm512_load_ps(qt + d * 16), _mm512_set1_ps(kb[o * D + d]), acc);
      _mm512_store_ps(sc + o * 16, acc);
    }
    if (t.softcap > 0.f) softcap_scores(sc, n * 16, t.softcap);
    const __m512 mv = block_softmax(t, n, k0, D, sc);
    __m512 lv = _mm512_loadu_ps(t.l);
    for (o = 0; o < n; o++) {
      const __m512 p = exp_approx16(_mm512_sub_ps(_mm512_load_ps(sc + o * 16), mv));
      _mm512_store_ps(sc + o * 16, p);
      lv = _mm512_add_ps(lv, p);
    }
    _mm512_storeu_ps(t.l, lv);
    // O^T[d] += P[o] * V[o][d], 16 dims of accumulators at a time.
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 acc[16];
      for (int i = 0; i < 16; i++) acc[i] = _mm512_load_ps(ot + (d0 + i) * 16);
      for (o = 0; o < n; o++) {
        const __m512 p = _mm512_load_ps(sc + o * 16);
        const float* v = vb + o * D + d0;
        for (int i = 0; i < 16; i++) acc[i] = _mm512_fmadd_ps(p, _mm512_set1_ps(v[i]), acc[i]);
      }
      for (int i = 0; i < 16; i++) _mm512_store_ps(ot + (d0 + i) * 16, acc[i]);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < 16; i++) {
    float bm = t.m[i];
    for (int64_t o = 0; o < n; o++) {
      float s = 0.f;
      for (int64_t d = 0; d < D; d++) s += qt[d * 16 + i] * kb[o * D + d];
      if (t.softcap > 0.f) s = softcap1(s, t.softcap);
      sc[o * 16 + i] = k0 + o > t.limit[i] || k0 + o < t.first[i] ? -INFINITY : s;
      bm = std::max(bm, sc[o * 16 + i]);
    }
    if (bm > t.m[i]) {
      const float alpha = exp_approx(t.m[i] - bm);
      t.l[i] *= alpha;
      for (int64_t d = 0; d < D; d++) ot[d * 16 + i] *= alpha;
      t.m[i] = bm;
    }
    const float base = std::max(t.m[i], -FLT_MAX);  // as block_softmax's
    for (int64_t o = 0; o < n; o++) {
      const float p = exp_approx(sc[o * 16 + i] - base);
      t.l[i] += p;
      for (int64_t d = 0; d < D; d++) ot[d * 16 + i] += p * vb[o * D + d];
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// A bf16 cache multiplies in bf16 (VDPBF16PS: two products per fp32 lane and
// instruction, summed in fp32): the queries are rounded to bf16 as a bf16
// model's are, K and V are what the cache holds. A pair is two bf16 in one
// 32-bit lane, the first in its low half.

// Lane i of a and b -> lane i's pair (bf16(a[i]), bf16(b[i])).
inline __m512i bf16_pairs(__m512 a, __m512 b) {
  const __m512i ab = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));  // a0..a15 b0..b15
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, ab);
}

inline __m512bh pairs_at(const uint32_t* p) {
  return reinterpret_cast<__m512bh>(_mm512_load_si512(p));
}
inline __m512bh pair_everywhere(uint32_t pair) {
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
}

// A block's values as tile_block_bf16 reads them, from its rows v (slot_stride
// apart): vp [(bs + 1) / 2][D] pairs of two keys' values for one dim (the
// second 0 past the block's n keys). Its keys are read where they lie: a cache
// row is pairs of a key's dims already (staging them in a copy was slower).
inline void stage_bf16_values(const at::BFloat16* v, int64_t n, int64_t slot_stride, int64_t D,
                              uint32_t* vp) {
  // qwords 0-7 (4 values each) as 0 4 1 5 2 6 3 7: an unpack of two rows
  // then pairs values 0-15 in order (lo) or 16-31 (hi), 3 instructions for 32
  // pairs (widening to fp32 and bf16_pairs: 6 for 16).
  const __m512i order = _mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0);
  for (int64_t o = 0; o < n; o += 2) {
    const at::BFloat16* a = v + o * slot_stride;
    const at::BFloat16* b = a + slot_stride;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i x = _mm512_permutexvar_epi64(order, _mm512_loadu_si512(a + d));
      const __m512i y = o + 1 < n ? _mm512_permutexvar_epi64(order, _mm512_loadu_si512(b + d))
                                  : _mm512_setzero_si512();
      _mm512_store_si512(vp + o / 2 * D + d, _mm512_unpacklo_epi16(x, y));
      _mm512_store_si512(vp + o / 2 * D + d + 16, _mm512_unpackhi_epi16(x, y));
    }
  }
}

// tile_block in bf16 products: qp [D / 2][16] pairs of the rows' query dims
// (unscaled: the scores take the scale, so a query is rounded once, as
// decode's qk_bf16 rounds it), kp a key's pairs of dims (keys k_stride pairs
// apart), vp as stage_bf16_values leaves them; pp [(bs + 1) / 2][16] scratch
// for pairs of probabilities.
inline void tile_block_bf16(PrefillTile& t, const uint32_t* qp, const uint32_t* kp,
                            int64_t k_stride, const uint32_t* vp, int64_t n, int64_t k0,
                            int64_t D, float scale, float* sc, uint32_t* pp) {
  const __m512 sv = _mm512_set1_ps(scale);
  const int64_t D2 = D / 2;
  int64_t o = 0;
  for (; o + 8 <= n; o += 8) {  // 8 independent chains, as tile_block's
    __m512 acc[8];
    for (int k = 0; k < 8; k++) acc[k] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D2; d++) {
      const __m512bh qd = pairs_at(qp + d * 16);
      for (int k = 0; k < 8; k++)
        acc[k] = _mm512_dpbf16_ps(acc[k], qd, pair_everywhere(kp[(o + k) * k_stride + d]));
    }
    for (int k = 0; k < 8; k++) _mm512_store_ps(sc + (o + k) * 16, _mm512_mul_ps(acc[k], sv));
  }
  for (; o < n; o++) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < D2; d++)
      acc = _mm512_dpbf16_ps(acc, pairs_at(qp + d * 16), pair_everywhere(kp[o * k_stride + d]));
    _mm512_store_ps(sc + o * 16, _mm512_mul_ps(acc, sv));
  }
  if (t.softcap > 0.f) softcap_scores(sc, n * 16, t.softcap);
  const __m512 mv = block_softmax(t, n, k0, D, sc);
  // Probabilities of keys 2i and 2i + 1 paired, then O^T[d] += both at once.
  __m512 lv = _mm512_loadu_ps(t.l);
  for (int64_t i = 0; i < (n + 1) / 2; i++) {
    const __m512 pa = exp_approx16(_mm512_sub_ps(_mm512_load_ps(sc + 2 * i * 16), mv));
    const __m512 pb = 2 * i + 1 < n
                          ? exp_approx16(_mm512_sub_ps(_mm512_load_ps(sc + (2 * i + 1) * 16), mv))
                          : _mm512_setzero_ps();
    lv = _mm512_add_ps(lv, _mm512_add_ps(pa, pb));
    _mm512_store_si512(pp + i * 16, bf16_pairs(pa, pb));
  }
  _mm512_storeu_ps(t.l, lv);
  float* ot = t.ot;
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_load_ps(ot + (d0 + i) * 16);
    for (int64_t i2 = 0; i2 < (n + 1) / 2; i2++) {
      const __m512bh p = pairs_at(pp + i2 * 16);
      const uint32_t* v = vp + i2 * D + d0;
      for (int i = 0; i < 16; i++) acc[i] = _mm512_dpbf16_ps(acc[i], p, pair_everywhere(v[i]));
    }
    for (int i = 0; i < 16; i++) _mm512_store_ps(ot + (d0 + i) * 16, acc[i]);
  }
}
#endif

// A work item: consecutive tiles of one sequence's KV head (query heads
// [g0, g0 + gn)), tokens [j0, j0 + tokens). Its tiles share each block's K and
// V rows, read and widened to fp32 once: at a 2000-token context, one tile per
// item read the cache ~20 times per layer, from L3 rather than L1/L2.
struct PrefillItem {
  int64_t b, kvh, g0, gn, j0, tokens;
};
constexpr int64_t kPrefillTiles = 4;  // tiles per item, at most

// Rows of tile k (lanes i): token j0 + k * (16 / gn) + i / gn, query head
// kvh * G + g0 + i % gn.
template <typename KV>
void prefill_item(const PrefillItem& it, const float* q, int64_t qs0, int64_t qs1, const KV* cache,
                  const float* kv_scale, const int32_t* table, int64_t ctx, int64_t qlen,
                  int64_t q0, int64_t hkv, int64_t G, int64_t D, int64_t block_size, float scale,
                  int64_t window, float softcap, float* out, std::vector<float>& buf) {
  const int64_t per_tile = 16 / it.gn, ntiles = (it.tokens + per_tile - 1) / per_tile;
  const int64_t slot_stride = 2 * hkv * D;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const bool bf16 = std::is_same_v<KV, at::BFloat16> && D % 32 == 0;
#else
  const bool bf16 = false;
#endif
  // Q^T and O^T per tile [D][16], the block's K and V [bs][D] (bf16: Q^T's
  // pairs per tile [D / 2][16] and V's [bs / 2][D] pairs),
  // scores [bs][16] (bf16: and pairs of probabilities [bs / 2][16]); 64-byte
  // aligned (each part a multiple of 16 floats where vectors load it).
  const int64_t half_bs = (block_size + 1) / 2;
  const int64_t staged = bf16 ? ntiles * D * 8 + half_bs * (D + 16) : 2 * block_size * D;
  buf.assign(ntiles * D * 32 + staged + block_size * 16 + 16, 0.f);
  float* base_ptr = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) &
                                             ~static_cast<uintptr_t>(63));
  float* kb = base_ptr + ntiles * D * 32;
  float* vb = kb + block_size * D;
  float* sc = kb + staged;
  uint32_t* qp = reinterpret_cast<uint32_t*>(kb);  // bf16's parts, over kb and vb
  uint32_t* vp = qp + ntiles * D * 8;
  uint32_t* pp = vp + half_bs * D;
  // bf16 tiles scale the scores, so their queries are rounded once (tile_block_bf16).
  const float qscale = bf16 ? 1.f : scale;
  PrefillTile tiles[kPrefillTiles];
  int64_t keys = 0;
  for (int64_t k = 0; k < ntiles; k++) {
    PrefillTile& t = tiles[k];
    t.qt = base_ptr + k * D * 32;
    t.ot = t.qt + D * 16;
    t.rows = std::min(per_tile, it.tokens - k * per_tile) * it.gn;
    t.softcap = softcap;
    std::fill(t.m, t.m + 16, -INFINITY);
    std::fill(t.l, t.l + 16, 0.f);
    for (int64_t i = 0; i < 16; i++) {
      const int64_t r = i < t.rows ? i : t.rows - 1, j = it.j0 + k * per_tile + r / it.gn;
      const int64_t h = it.kvh * G + it.g0 + r % it.gn;
      t.limit[i] = static_cast<int32_t>(ctx - qlen + j);
      t.first[i] = window > 0 ? std::max<int32_t>(0, t.limit[i] - window + 1) : 0;
      if (i < t.rows)
        for (int64_t d = 0; d < D; d++)
          t.qt[d * 16 + i] = query_as<KV>(q[(q0 + j) * qs0 + h * qs1 + d]) * qscale;
    }
    t.keys = t.limit[t.rows - 1] + 1;  // a tile's last row sees the most
    keys = std::max(keys, t.keys);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (bf16)
      for (int64_t d = 0; d < D; d += 2)
        _mm512_store_si512(qp + (k * D + d) * 8, bf16_pairs(_mm512_load_ps(t.qt + d * 16),
                                                            _mm512_load_ps(t.qt + (d + 1) * 16)));
#endif
  }
  // Blocks from the one holding the first tile's first key (0 without a window).
  for (int64_t k0 = tiles[0].first[0] / block_size * block_size; k0 < keys; k0 += block_size) {
    const int64_t n = std::min(block_size, keys - k0);
    // A tile takes the blocks from its first row's first key to its last row's key.
    auto sees = [&](const PrefillTile& t) { return k0 < t.keys && k0 + n > t.first[0]; };
    const int64_t base = static_cast<int64_t>(table[k0 / block_size]) * block_size;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if constexpr (std::is_same_v<KV, at::BFloat16>) {
      if (bf16) {
        const at::BFloat16* rows = cache + base * slot_stride + it.kvh * D;
        stage_bf16_values(rows + hkv * D, n, slot_stride, D, vp);
        for (int64_t k = 0; k < ntiles; k++)
          if (sees(tiles[k]))
            tile_block_bf16(tiles[k], qp + k * D * 8, reinterpret_cast<const uint32_t*>(rows),
                            slot_stride / 2, vp, std::min(n, tiles[k].keys - k0), k0, D, scale,
                            sc, pp);
        continue;
      }
    }
#endif
    for (int64_t o = 0; o < n; o++) {  // the block's K and V rows in fp32
      const KV* row = cache + (base + o) * slot_stride + it.kvh * D;
      const float* s = kv_scale ? kv_scale + (base + o) * 2 * hkv + it.kvh : nullptr;
      widen_row(row, s ? s[0] : 1.f, D, kb + o * D);
      widen_row(row + hkv * D, s ? s[hkv] : 1.f, D, vb + o * D);
    }
    for (int64_t k = 0; k < ntiles; k++)
      if (sees(tiles[k]))
        tile_block(tiles[k], kb, vb, std::min(n, tiles[k].keys - k0), k0, D, sc);
  }
  for (int64_t k = 0; k < ntiles; k++) {
    const PrefillTile& t = tiles[k];
    for (int64_t r = 0; r < t.rows; r++) {
      const int64_t j = it.j0 + k * per_tile + r / it.gn, h = it.kvh * G + it.g0 + r % it.gn;
      float* dst = out + (q0 + j) * hkv * G * D + h * D;
      const float inv = 1.f / t.l[r];
      for (int64_t d = 0; d < D; d++) dst[d] = t.ot[d * 16 + r] * inv;
    }
  }
}

// q [T, H, D]: the new queries of every sequence, back to back (sequence b's
// from query_starts[b]); returns [T, H * D].
at::Tensor paged_attention_prefill(const at::Tensor& q, const at::Tensor& cache,
                                   const std::optional<at::Tensor>& cache_scale,
                                   const at::Tensor& block_tables, const at::Tensor& context_lens,
                                   const at::Tensor& query_starts, int64_t block_size,
                                   double scale, int64_t window, double softcap) {
  check_float_rows(q, "q");
  TORCH_CHECK(q.dim() == 3, "q must be [T, H, D]");
  const KVKind kind = kv_kind(cache, cache_scale);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), hkv = cache.size(2);
  TORCH_CHECK(cache.size(3) == D, "q and cache head sizes do not match");
  TORCH_CHECK(H % hkv == 0, "q and cache heads do not match");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none)");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() &&
                  query_starts.scalar_type() == at::kInt && query_starts.is_contiguous(),
              "block_tables, context_lens and query_starts must be contiguous int32");
  // A tile: 16 / G tokens of all G query heads, or one token of 16 heads.
  const int64_t B = context_lens.numel(), G = H / hkv, gn = std::min<int64_t>(G, 16);
  const int64_t per_tile = 16 / gn;
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B &&
                  query_starts.numel() == B + 1,
              "block_tables and query_starts must have a row (and an end) per sequence");
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* starts = query_starts.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[B] == T, "query_starts must run from 0 to q's rows");
  for (int64_t b = 0; b < B; b++)
    TORCH_CHECK(starts[b + 1] > starts[b] && starts[b + 1] - starts[b] <= lens[b] &&
                    (lens[b] + block_size - 1) / block_size <= block_tables.size(1),
                "each sequence needs queries, within its context and its block table");
  // Items in an order whose halves (or any split into contiguous ranges) hold
  // about equal work: a causal item's keys grow with its position, so items
  // are taken from both ends of each sequence in turn.
  std::vector<PrefillItem> items;
  const int64_t span = kPrefillTiles * per_tile;
  for (int64_t b = 0; b < B; b++) {
    const int64_t qlen = starts[b + 1] - starts[b], n = (qlen + span - 1) / span;
    auto add = [&](int64_t i) {
      for (int64_t kvh = 0; kvh < hkv; kvh++)
        for (int64_t g0 = 0; g0 < G; g0 += gn)
          items.push_back({b, kvh, g0, std::min(gn, G - g0), i * span,
                           std::min(span, qlen - i * span)});
    };
    for (int64_t lo = 0, hi = n - 1; lo <= hi; lo++, hi--) {
      add(lo);
      if (hi != lo) add(hi);
    }
  }
  auto out = at::empty({T, H * D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* sp = kind == KVKind::kInt8 ? cache_scale->data_ptr<float>() : nullptr;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t nb = block_tables.size(1);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t w = begin; w < end; w++) {
      const PrefillItem& it = items[w];
      const int64_t qlen = starts[it.b + 1] - starts[it.b];
      auto run = [&](const auto* kv) {
        prefill_item(it, qp, q.stride(0), q.stride(1), kv, sp, tables + it.b * nb, lens[it.b],
                     qlen, starts[it.b], hkv, G, D, block_size, static_cast<float>(scale),
                     window, static_cast<float>(softcap), op, buf);
      };
      switch (kind) {
        case KVKind::kFloat:
          run(static_cast<const float*>(cache.data_ptr()));
          break;
        case KVKind::kHalf:
          run(static_cast<const at::Half*>(cache.data_ptr()));
          break;
        case KVKind::kBf16:
          run(static_cast<const at::BFloat16*>(cache.data_ptr()));
          break;
        case KVKind::kInt8:
          run(static_cast<const int8_t*>(cache.data_ptr()));
          break;
      }
    }
  });
  return out;
}

}  // namespace tandem
