// Decode attention over the paged KV cache (one query per sequence).
#pragma once

#include "common.h"

namespace tandem {

// Decode attention works block by block on one KV head's group of query
// heads: qk_* writes their scores for the block's n keys, pv_* adds the
// probability-weighted V rows to their [group, D] accumulators. Row r of a
// block is at rows + r * row_stride; scales (int8 cache) at sc + r * sc_stride.
struct BlockArgs {
  int64_t n, row_stride, sc_stride, group, D, bs;  // bs: row stride of scores
  int64_t next_offset;  // next block's rows minus this block's (elements); 0: none
};

// The next block of a sequence lives elsewhere in memory, and the hardware
// prefetcher stops at page boundaries: while row r of this block computes,
// fetch row r of the next one (spread out, so the fill buffers never choke)
// into L2 (T1). Into L1 (T0), each prefetch held one of the core's few L1
// miss buffers until DRAM answered, and decode attention read its cache
// about as slowly as if nothing overlapped the arithmetic. Into L2, it speeds
// up attention over a cache read from DRAM and leaves one in cache unchanged.
template <typename KV>
inline void prefetch_row(const KV* row, const BlockArgs& a) {
  if (!a.next_offset) return;
  const char* p = reinterpret_cast<const char*>(row + a.next_offset);
  for (int64_t b = 0; b < a.D * static_cast<int64_t>(sizeof(KV)); b += 64)
    __builtin_prefetch(p + b, 0, 2);  // locality 2: x86's PREFETCHT1
}

template <typename KV>
void qk_generic(const float* q, int64_t qs, const KV* rows, const float* sc, const BlockArgs& a,
                float scale, float* scores) {
  for (int64_t o = 0; o < a.n; o++) {
    const KV* k = rows + o * a.row_stride;
    const float ks = (sc ? sc[o * a.sc_stride] : 1.f) * scale;
    for (int64_t g = 0; g < a.group; g++) {
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < a.D; i++)
        dot += query_as<KV>(q[g * qs + i]) * static_cast<float>(k[i]);
      scores[g * a.bs + o] = dot * ks;
    }
  }
}

template <typename KV>
void pv_generic(const float* probs, const KV* rows, const float* sc, const BlockArgs& a,
                float* acc) {
  for (int64_t o = 0; o < a.n; o++) {
    const KV* v = rows + o * a.row_stride;
    const float vs = sc ? sc[o * a.sc_stride] : 1.f;
    for (int64_t g = 0; g < a.group; g++) {
      const float p = probs[g * a.bs + o] * vs;
#pragma omp simd
      for (int64_t i = 0; i < a.D; i++) acc[g * a.D + i] += p * static_cast<float>(v[i]);
    }
  }
}

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const at::BFloat16* p) {  // bf16 is fp32's top half: exact
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// G query heads x NC 16-float chunks held in registers across the block.
template <typename KV, int G, int NC>
void qk_avx512(const float* q, int64_t qs, const KV* rows, const float* sc, const BlockArgs& a,
               float scale, float* scores) {
  __m512 qv[G][NC];
  for (int g = 0; g < G; g++)
    for (int c = 0; c < NC; c++) {
      if constexpr (std::is_same_v<KV, at::BFloat16>) {  // query_as<KV>, 16 at a time
        alignas(64) float r[16];
        for (int i = 0; i < 16; i++) r[i] = query_as<KV>(q[g * qs + c * 16 + i]);
        qv[g][c] = _mm512_load_ps(r);
      } else {
        qv[g][c] = _mm512_loadu_ps(q + g * qs + c * 16);
      }
    }
  for (int64_t o = 0; o < a.n; o++) {
    const KV* k = rows + o * a.row_stride;
    prefetch_row(k, a);
    __m512 acc[G];
    for (int g = 0; g < G; g++) acc[g] = _mm512_setzero_ps();
    for (int c = 0; c < NC; c++) {
      const __m512 kc = load16(k + c * 16);
      for (int g = 0; g < G; g++) acc[g] = _mm512_fmadd_ps(qv[g][c], kc, acc[g]);
    }
    const float ks = (sc ? sc[o * a.sc_stride] : 1.f) * scale;
    for (int g = 0; g < G; g++) scores[g * a.bs + o] = _mm512_reduce_add_ps(acc[g]) * ks;
  }
}

#ifdef __AVX512BF16__
// qk_avx512 for a bf16 cache: the queries rounded to bf16 (as a bf16 model's
// are), two products per fp32 lane and instruction (VDPBF16PS), a key row used
// as it lies (pairs of dims), summed in fp32.
template <int G, int NC>
void qk_bf16(const float* q, int64_t qs, const at::BFloat16* rows, const float* sc,
             const BlockArgs& a, float scale, float* scores) {
  static_assert(NC % 2 == 0, "32 dims a vector");
  __m512bh qv[G][NC / 2];
  for (int g = 0; g < G; g++)
    for (int c = 0; c < NC / 2; c++)
      qv[g][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + g * qs + c * 32 + 16),
                                     _mm512_loadu_ps(q + g * qs + c * 32));
  for (int64_t o = 0; o < a.n; o++) {
    const at::BFloat16* k = rows + o * a.row_stride;
    prefetch_row(k, a);
    __m512 acc[G];
    for (int g = 0; g < G; g++) acc[g] = _mm512_setzero_ps();
    for (int c = 0; c < NC / 2; c++) {
      const __m512bh kc = reinterpret_cast<__m512bh>(_mm512_loadu_si512(k + c * 32));
      for (int g = 0; g < G; g++) acc[g] = _mm512_dpbf16_ps(acc[g], qv[g][c], kc);
    }
    for (int g = 0; g < G; g++) scores[g * a.bs + o] = _mm512_reduce_add_ps(acc[g]) * scale;
  }
}
#endif

// Accumulators of a head size of NC 16-float chunks are held in registers NB
// chunks at a time: a head size of 256 (Gemma 3's, NC = 16) passes over the
// block's rows (in L1) once per NB chunks, so G x NB accumulators stay in
// registers (G = 4 in one pass: 64 accumulators, spilled on every FMA).
template <int G, int NC>
constexpr int pv_pass_chunks() {
  if constexpr (NC <= 8) return NC;
  return G <= 1 ? 16 : G <= 2 ? 8 : G <= 4 ? 4 : 2;
}

template <typename KV, int G, int NC>
void pv_avx512(const float* probs, const KV* rows, const float* sc, const BlockArgs& a,
               float* acc) {
  constexpr int NB = pv_pass_chunks<G, NC>();
  static_assert(NC % NB == 0, "whole passes");
  for (int c0 = 0; c0 < NC; c0 += NB) {
    __m512 av[G][NB];
    for (int g = 0; g < G; g++)
      for (int c = 0; c < NB; c++) av[g][c] = _mm512_loadu_ps(acc + g * NC * 16 + (c0 + c) * 16);
    for (int64_t o = 0; o < a.n; o++) {
      const KV* v = rows + o * a.row_stride;
      if (c0 == 0) prefetch_row(v, a);
      const float vs = sc ? sc[o * a.sc_stride] : 1.f;
      __m512 p[G];
      for (int g = 0; g < G; g++) p[g] = _mm512_set1_ps(probs[g * a.bs + o] * vs);
      for (int c = 0; c < NB; c++) {
        const __m512 vc = load16(v + (c0 + c) * 16);
        for (int g = 0; g < G; g++) av[g][c] = _mm512_fmadd_ps(p[g], vc, av[g][c]);
      }
    }
    for (int g = 0; g < G; g++)
      for (int c = 0; c < NB; c++)
        _mm512_storeu_ps(acc + g * NC * 16 + (c0 + c) * 16, av[g][c]);
  }
}
#endif

template <typename KV>
struct BlockKernels {
  void (*qk)(const float*, int64_t, const KV*, const float*, const BlockArgs&, float, float*) =
      qk_generic<KV>;
  void (*pv)(const float*, const KV*, const float*, const BlockArgs&, float*) = pv_generic<KV>;
};

#ifdef __AVX512F__
template <typename KV, int NC>
void pick_group(int64_t group, BlockKernels<KV>& k) {
  switch (group) {
#ifdef __AVX512BF16__
#define TANDEM_QK(G)                                                         \
  if constexpr (std::is_same_v<KV, at::BFloat16>) k.qk = qk_bf16<G, NC>; \
  else k.qk = qk_avx512<KV, G, NC>;
#else
#define TANDEM_QK(G) k.qk = qk_avx512<KV, G, NC>;
#endif
#define TANDEM_GROUP(G)          \
  case G:                        \
    TANDEM_QK(G)                 \
    k.pv = pv_avx512<KV, G, NC>; \
    return;
    TANDEM_GROUP(1) TANDEM_GROUP(2) TANDEM_GROUP(3) TANDEM_GROUP(4)
    TANDEM_GROUP(5) TANDEM_GROUP(6) TANDEM_GROUP(7) TANDEM_GROUP(8)
#undef TANDEM_GROUP
#undef TANDEM_QK
    default:
      return;
  }
}
#endif

// Register-blocked kernels for the common shapes (head size 64, 96 (Phi-3's),
// 128 or 256, up to 8 query heads per KV head), the generic loops otherwise.
template <typename KV>
BlockKernels<KV> pick_kernels(int64_t group, int64_t D) {
  BlockKernels<KV> k;
#ifdef __AVX512F__
  if (D == 64) pick_group<KV, 4>(group, k);
  if (D == 96) pick_group<KV, 6>(group, k);
  if (D == 128) pick_group<KV, 8>(group, k);
  if (D == 256) pick_group<KV, 16>(group, k);
#endif
  return k;
}

// Keys per online-softmax step of decode attention: each head's step (a
// max, exps, sums, the rescale of its accumulator) has a fixed cost that a
// 16-key block amortized poorly, a large share of decode attention. 64-key
// steps are faster from cache and no slower from DRAM. A transposing tree for
// the QK sums (16 keys' scores a vector) was no faster from DRAM and was
// dropped.
constexpr int64_t kSoftmaxChunk = 64;

// One step of a head's online softmax: its scores s [n] become exp(s - m')
// in place, m' = max(m, s), and m, l move to m' and l's sum rescaled plus
// theirs; returns the rescale factor exp(m - m') of the earlier sums.
inline float softmax_block(float* s, int64_t n, float& m, float& l) {
  float bm = m, sum = 0.f;
#ifdef __AVX512F__
  // A step is a few vectors (kSoftmaxChunk keys). The scalar loops compared and
  // branched per score and summed a block's 16 lanes serially: per head they
  // took as long as the QK dot products (perf, 2048-token context).
  const __m512 lowest = _mm512_set1_ps(-INFINITY);
  auto lanes = [&](int64_t o) {
    return static_cast<__mmask16>(n - o >= 16 ? 0xFFFF : (1u << (n - o)) - 1);
  };
  __m512 mv = _mm512_set1_ps(m);
  for (int64_t o = 0; o < n; o += 16)
    mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(lowest, lanes(o), s + o));
  bm = _mm512_reduce_max_ps(mv);
  const __m512 bv = _mm512_set1_ps(bm);
  __m512 sv = _mm512_setzero_ps();
  for (int64_t o = 0; o < n; o += 16) {
    const __mmask16 k = lanes(o);
    const __m512 e = exp_approx16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + o), bv));
    _mm512_mask_storeu_ps(s + o, k, e);
    sv = _mm512_mask_add_ps(sv, k, sv, e);
  }
  sum = _mm512_reduce_add_ps(sv);
#else
  for (int64_t o = 0; o < n; o++) bm = s[o] > bm ? s[o] : bm;
#pragma omp simd reduction(+ : sum)
  for (int64_t o = 0; o < n; o++) {
    s[o] = exp_approx(s[o] - bm);
    sum += s[o];
  }
#endif
  const float alpha = exp_approx(m - bm);
  l = l * alpha + sum;
  m = bm;
  return alpha;
}

// One decode query per sequence against part of its paged context: the query
// heads of KV heads [kv0, kv1) over tokens [start0, ctx). A single pass, block
// by block, with an online softmax: each cache row (a slot's K and V heads,
// contiguous) is read from memory once, and the heads sharing a KV head reuse
// it from L1. Leaves the running max m, sum l and un-normalized numerator acc
// [nh, D] of each head for merge_partials.
template <typename KV>
void attend_range(const BlockKernels<KV>& kern, const float* q, int64_t q_head_stride,
                  const KV* cache, const float* kv_scale, const int32_t* table, int64_t start0,
                  int64_t ctx, int64_t block_size, int64_t hkv, int64_t kv0, int64_t kv1,
                  int64_t group, int64_t D, float scale, float softcap, float* m, float* l,
                  float* acc, std::vector<float>& buf) {
  const int64_t nh = (kv1 - kv0) * group, slot_stride = 2 * hkv * D;
  // Blocks per softmax step (kSoftmaxChunk keys, or one larger block).
  const int64_t chunk_blocks = std::max<int64_t>(1, kSoftmaxChunk / block_size);
  const int64_t cs = chunk_blocks * block_size;  // row stride of the scores
  buf.resize(nh * cs);
  float* sc = buf.data();  // [nh, cs] scores, then probabilities
  std::fill(m, m + nh, -INFINITY);
  std::fill(l, l + nh, 0.f);
  std::fill(acc, acc + nh * D, 0.f);
  if (start0 >= ctx) return;  // an empty range (start0 is then ctx, maybe mid-block)
  BlockArgs a{0, slot_stride, 2 * hkv, group, D, cs, 0};
  // Block blk of the context: its first slot, keys, and the next block's offset.
  auto block = [&](int64_t blk) {
    const int64_t start = blk * block_size;
    a.n = std::min(block_size, ctx - start);
    const int64_t base = static_cast<int64_t>(table[blk]) * block_size;
    a.next_offset = start + block_size < ctx
                        ? (static_cast<int64_t>(table[blk + 1]) * block_size - base) * slot_stride
                        : 0;
    return base;
  };
  for (int64_t blk0 = start0 / block_size; blk0 * block_size < ctx; blk0 += chunk_blocks) {
    const int64_t blk1 = std::min(blk0 + chunk_blocks, (ctx + block_size - 1) / block_size);
    for (int64_t blk = blk0; blk < blk1; blk++) {
      const int64_t base = block(blk), col = (blk - blk0) * block_size;
      for (int64_t kvh = kv0; kvh < kv1; kvh++) {
        const int64_t h0 = (kvh - kv0) * group;
        kern.qk(q + h0 * q_head_stride, q_head_stride, cache + base * slot_stride + kvh * D,
                kv_scale ? kv_scale + base * 2 * hkv + kvh : nullptr, a, scale,
                sc + h0 * cs + col);
      }
    }
    const int64_t n = std::min(ctx, blk1 * block_size) - blk0 * block_size;
    // A range that starts mid-block (a sliding window's) masks the block's
    // keys before it: their probabilities come out ~1e-38 (exp_approx's
    // floor) and are zeroed before PV.
    const int64_t skip = std::max<int64_t>(0, start0 - blk0 * block_size);
    for (int64_t h = 0; h < nh; h++) {
      if (softcap > 0.f) softcap_scores(sc + h * cs, n, softcap);
      std::fill(sc + h * cs, sc + h * cs + skip, -INFINITY);
      const float alpha = softmax_block(sc + h * cs, n, m[h], l[h]);
      std::fill(sc + h * cs, sc + h * cs + skip, 0.f);
      if (alpha != 1.f) {
        float* ah = acc + h * D;
#pragma omp simd
        for (int64_t i = 0; i < D; i++) ah[i] *= alpha;
      }
    }
    for (int64_t blk = blk0; blk < blk1; blk++) {
      const int64_t base = block(blk), col = (blk - blk0) * block_size;
      for (int64_t kvh = kv0; kvh < kv1; kvh++) {
        const int64_t h0 = (kvh - kv0) * group;
        kern.pv(sc + h0 * cs + col, cache + base * slot_stride + (hkv + kvh) * D,
                kv_scale ? kv_scale + base * 2 * hkv + hkv + kvh : nullptr, a, acc + h0 * D);
      }
    }
  }
}

// Combines the softmax partials of one head over `splits` context ranges (the
// range s partials are s * stride floats after the first) into its output.
void merge_partials(const float* m, const float* l, const float* acc, int64_t splits,
                    int64_t stride, int64_t D, float* out) {
  float mx = -INFINITY;
  for (int64_t s = 0; s < splits; s++) mx = std::max(mx, m[s * stride]);
  float total = 0.f;
  std::fill(out, out + D, 0.f);
  for (int64_t s = 0; s < splits; s++) {
    if (l[s * stride] == 0.f) continue;  // an empty range (past this sequence's end)
    const float w = exp_approx(m[s * stride] - mx);
    total += w * l[s * stride];
    const float* a = acc + s * stride;
#pragma omp simd
    for (int64_t i = 0; i < D; i++) out[i] += w * a[i];
  }
  const float inv = 1.f / total;
#pragma omp simd
  for (int64_t i = 0; i < D; i++) out[i] *= inv;
}

// Decode attention for a batch of sequences (one query each) against one
// layer's cache, as work items a thread team shares: plan() picks the items
// from the context lengths, run_item() attends one, merge() writes a
// (sequence, KV head group)'s output from its items' partials.
//
// Items cover every KV head of a sequence (a block's slots, all heads' K and
// V, are one 2 x heads x head-size run of memory, read block by block) when
// there are enough sequences, or enough context to split, to share out: a
// few sequences' long contexts are split into ranges of whole blocks
// (flash-decoding). Only short contexts of a sequence or two are split by KV
// head instead, each item then striding through every slot for its head's
// part (a head-by-head sweep of such a cache reads it well below a sequential
// read's speed).
struct DecodeAttention {
  const float* q;  // [B, H, D] with strides qs0, qs1
  int64_t qs0, qs1;
  const int32_t* tables;  // [B, nb] block ids
  int64_t nb;
  const int32_t* lens;  // [B] context lengths
  int64_t B, hkv, group, D, block_size;
  float scale;
  // A sliding window: each query attends to its last `window` keys (itself
  // included, HF's q - k < W); 0: to its whole context.
  int64_t window = 0;
  float softcap = 0.f;  // scores soft-capped at this (Gemma 2), or 0
  // The plan.
  int64_t heads_per_item = 1, kv_items = 1, splits = 1, split_tokens = 0, nh = 1, items = 0;
  int64_t total_ctx = 0;
  BlockKernels<float> kf;
  BlockKernels<at::Half> kh;
  BlockKernels<at::BFloat16> kb;
  BlockKernels<int8_t> k8;

  // min_split_tokens: the shortest context range worth its own item (and its
  // merge); a team already awake can afford shorter ones than a pool woken
  // per call.
  void plan(int64_t threads, int64_t min_split_tokens = 256) {
    kf = pick_kernels<float>(group, D);
    kh = pick_kernels<at::Half>(group, D);
    kb = pick_kernels<at::BFloat16>(group, D);
    k8 = pick_kernels<int8_t>(group, D);
    int64_t max_ctx = 1;
    total_ctx = 0;
    for (int64_t b = 0; b < B; b++) {
      const int64_t keys = lens[b] - first_key(b);
      total_ctx += keys;
      max_ctx = std::max<int64_t>(max_ctx, keys);
    }
    // Ranges of a context the split may make (at least min_split_tokens each).
    const int64_t most = std::max<int64_t>(1, max_ctx / min_split_tokens);
    // Per KV head only when whole-head items would leave a thread under two:
    // a few long contexts read from DRAM go faster in ranges of every head.
    heads_per_item = B * most >= 2 * threads ? hkv : 1;
    kv_items = hkv / heads_per_item;
    splits = 1;
    if (B < 2 * threads) {  // about 4 items per thread, a multiple of the threads
      splits = std::min(most, (4 * threads + B * kv_items - 1) / (B * kv_items));
      while (splits < most && (B * kv_items * splits) % threads) splits++;
    }
    // Tokens per split: whole blocks (a split starts mid-block only in a window).
    const int64_t span = (max_ctx + splits - 1) / splits;
    split_tokens = (span + block_size - 1) / block_size * block_size;
    nh = heads_per_item * group;
    items = B * kv_items * splits;
  }

  // Floats of partials: per item m [nh], l [nh], acc [nh, D].
  int64_t partial_floats() const { return items * nh * (D + 2); }

  // Sequence b's first key in its window.
  int64_t first_key(int64_t b) const {
    return window > 0 && lens[b] > window ? lens[b] - window : 0;
  }

  // Item w against the cache [S, 2, Hkv, D] of this kind (int8 with kv_scale).
  void run_item(int64_t w, KVKind kind, const void* cache, const float* kv_scale, float* part,
                std::vector<float>& buf) const {
    const int64_t split = w % splits, seq_item = w / splits;
    const int64_t b = seq_item / kv_items, kv0 = (seq_item % kv_items) * heads_per_item;
    const int64_t lo = std::min<int64_t>(first_key(b) + split * split_tokens, lens[b]);
    const int64_t hi = std::min<int64_t>(lo + split_tokens, lens[b]);
    float* m = part + w * nh * (D + 2);
    float* l = m + nh;
    float* acc = l + nh;
    const float* qb = q + b * qs0 + kv0 * group * qs1;
    auto attend = [&](const auto& kern, const auto* kv, const float* sc) {
      attend_range(kern, qb, qs1, kv, sc, tables + b * nb, lo, hi, block_size, hkv, kv0,
                   kv0 + heads_per_item, group, D, scale, softcap, m, l, acc, buf);
    };
    switch (kind) {
      case KVKind::kFloat:
        return attend(kf, static_cast<const float*>(cache), nullptr);
      case KVKind::kHalf:
        return attend(kh, static_cast<const at::Half*>(cache), nullptr);
      case KVKind::kBf16:
        return attend(kb, static_cast<const at::BFloat16*>(cache), nullptr);
      case KVKind::kInt8:
        return attend(k8, static_cast<const int8_t*>(cache), kv_scale);
    }
  }

  // Output heads of (sequence, KV head group) seq_item < B * kv_items into
  // out [B, H * D] (a plain normalization when there is one split).
  void merge(int64_t seq_item, const float* part, float* out) const {
    const int64_t stride = nh * (D + 2);
    const int64_t b = seq_item / kv_items, kv0 = (seq_item % kv_items) * heads_per_item;
    const float* first = part + seq_item * splits * stride;
    for (int64_t h = 0; h < nh; h++)
      merge_partials(first + h, first + nh + h, first + 2 * nh + h * D, splits, stride, D,
                     out + b * hkv * group * D + (kv0 * group + h) * D);
  }
};

// Checks the step's block tables and context lengths and sets up the batch.
inline DecodeAttention decode_attention(const float* q, int64_t qs0, int64_t qs1, int64_t B,
                                        int64_t H, int64_t hkv, int64_t D,
                                        const at::Tensor& block_tables,
                                        const at::Tensor& context_lens, int64_t block_size,
                                        double scale, int64_t window, double softcap) {
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(),
              "block_tables and context_lens must be contiguous int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && context_lens.numel() == B,
              "block_tables and context_lens must have a row per sequence");
  TORCH_CHECK(H % hkv == 0, "q and cache heads do not match");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none)");
  return DecodeAttention{q, qs0, qs1, block_tables.data_ptr<int32_t>(), block_tables.size(1),
                         context_lens.data_ptr<int32_t>(), B, hkv, H / hkv, D, block_size,
                         static_cast<float>(scale), window, static_cast<float>(softcap)};
}

at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& cache,
                                  const std::optional<at::Tensor>& cache_scale,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  int64_t block_size, double scale, int64_t window,
                                  double softcap) {
  check_float_rows(q, "q");
  TORCH_CHECK(q.dim() == 3, "q must be [B, H, D]");
  const KVKind kind = kv_kind(cache, cache_scale);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), hkv = cache.size(2);
  TORCH_CHECK(cache.size(3) == D, "q and cache head sizes do not match");
  auto att = decode_attention(q.data_ptr<float>(), q.stride(0), q.stride(1), B, H, hkv, D,
                              block_tables, context_lens, block_size, scale, window, softcap);
  att.plan(at::get_num_threads());
  auto out = at::empty({B, H * D}, q.options());
  std::vector<float> part(att.partial_floats());
  const float* sp = kind == KVKind::kInt8 ? cache_scale->data_ptr<float>() : nullptr;
  // Stay on this thread unless the work pays for waking the others.
  const int64_t grain = att.total_ctx * hkv * D * 2 < 32768 ? att.items : 1;
  at::parallel_for(0, att.items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t w = begin; w < end; w++)
      att.run_item(w, kind, cache.data_ptr(), sp, part.data(), buf);
  });
  float* op = out.data_ptr<float>();
  for (int64_t s = 0; s < B * att.kv_items; s++) att.merge(s, part.data(), op);
  return out;
}

}  // namespace tandem
