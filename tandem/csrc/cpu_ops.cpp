// tandem's CPU kernels: the per-layer glue of a decode step fused, and the
// quantized matmuls torch has no fast CPU kernel for at decode sizes.
//
// A decode step at batch 1 spent ~6 ms of its ~25 in ~25 small aten ops per
// layer (norms, RoPE, the KV write, the KV gather, SDPA). These kernels do the
// same math in one pass each, and the decode attention reads K/V straight from
// the paged cache through the block table instead of gathering a padded copy
// (at batch 32 that copy moved ~12 MB per layer per step). The int8 (VNNI) and
// int4 GEMVs stream quantized weights at memory speed where fbgemm's and
// torch's int4 kernels do not.
//
// AVX-512 paths are chosen at compile time (-march=native); every kernel has
// a portable loop beside it, so other CPUs build and run the same ops.
//
// Numerics follow the torch reference paths in tandem/model/*.py: fp32
// accumulation everywhere, RoPE computed as x*cos - y*sin without contraction
// (built with -ffp-contract=off) like HF's, int8 KV quantized per token and
// head with round-half-even exactly as Int8KVCache.write does.
//
// Built by tandem/_custom_ops.py with the host's g++ against torch's headers;
// registered as torch.ops.tandem.*.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

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

void check_float_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name,
              " must be a float32 CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, " must have contiguous rows");
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
    for (int64_t t = b; t < e; t++) {
      const float* r = xp + t * xs;
      float* o = op + t * n;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; i++) ss += r[i] * r[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + feps);
#pragma omp simd
      for (int64_t i = 0; i < n; i++) o[i] = wp[i] * (r[i] * inv);
    }
  });
  return out;
}

// x: [T, 2N] (gate | up) -> silu(gate) * up: [T, N]
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_float_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [T, 2N]");
  const int64_t rows = x.size(0), n = x.size(1) / 2, xs = x.stride(0);
  auto out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; t++) {
      const float* g = xp + t * xs;
      const float* u = g + n;
      float* o = op + t * n;
#pragma omp simd
      for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
    }
  });
  return out;
}

// In place on qkv [T, H + 2*Hkv, D] (rows contiguous): rotate the H query and
// Hkv key heads by their position (HF's rotate_half convention; cos/sin are
// tandem's [P, D] tables, cos = [c, c], sin = [-s, s]); then write each
// token's K and V to its cache slot: dense cache [S, 2, Hkv, D] of the qkv
// dtype, or int8 [S, 2, Hkv, D] plus fp32 scale [S, 2, Hkv, 1].
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
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 4, "cache must be a contiguous [S, 2, Hkv, D]");
  const int64_t T = qkv.size(0), D = qkv.size(2), half = D / 2, hkv = num_kv_heads;
  const int64_t rot_heads = num_heads + num_kv_heads;
  const bool int8 = cache_scale.has_value();
  TORCH_CHECK(int8 ? cache.scalar_type() == at::kChar : cache.scalar_type() == at::kFloat,
              "cache dtype does not match its kind");
  float* qp = qkv.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t row = (num_heads + 2 * hkv) * D;
  at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; t++) {
      float* x = qp + t * row;
      const float* c = cp + pos[t] * D;
      const float* s = sp + pos[t] * D + half;  // +sin
      for (int64_t h = 0; h < rot_heads; h++) {
        float* a = x + h * D;
        float* y = a + half;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
          const float x1 = a[i], x2 = y[i];
          a[i] = x1 * c[i] - x2 * s[i];
          y[i] = x2 * c[i] + x1 * s[i];
        }
      }
      const float* kv = x + num_heads * D;  // K heads then V heads: [2, Hkv, D]
      if (!int8) {
        std::memcpy(cache.data_ptr<float>() + slot[t] * 2 * hkv * D, kv, 2 * hkv * D * sizeof(float));
        continue;
      }
      int8_t* qd = cache.data_ptr<int8_t>() + slot[t] * 2 * hkv * D;
      float* sd = cache_scale->data_ptr<float>() + slot[t] * 2 * hkv;
      for (int64_t h = 0; h < 2 * hkv; h++) {
        const float* src = kv + h * D;
        float amax = 0.f;
#pragma omp simd reduction(max : amax)
        for (int64_t i = 0; i < D; i++) amax = std::max(amax, std::fabs(src[i]));
        const float scale = std::max(amax, 1e-8f) / 127.0f;
        sd[h] = scale;
        for (int64_t i = 0; i < D; i++)
          qd[h * D + i] = static_cast<int8_t>(std::nearbyint(src[i] / scale));
      }
    }
  });
}

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
// fetch row r of the next one (spread out, so the fill buffers never choke).
template <typename KV>
inline void prefetch_row(const KV* row, const BlockArgs& a) {
  if (!a.next_offset) return;
  const char* p = reinterpret_cast<const char*>(row + a.next_offset);
  for (int64_t b = 0; b < a.D * static_cast<int64_t>(sizeof(KV)); b += 64) __builtin_prefetch(p + b);
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
      for (int64_t i = 0; i < a.D; i++) dot += q[g * qs + i] * static_cast<float>(k[i]);
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

// G query heads x NC 16-float chunks held in registers across the block.
template <typename KV, int G, int NC>
void qk_avx512(const float* q, int64_t qs, const KV* rows, const float* sc, const BlockArgs& a,
               float scale, float* scores) {
  __m512 qv[G][NC];
  for (int g = 0; g < G; g++)
    for (int c = 0; c < NC; c++) qv[g][c] = _mm512_loadu_ps(q + g * qs + c * 16);
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

template <typename KV, int G, int NC>
void pv_avx512(const float* probs, const KV* rows, const float* sc, const BlockArgs& a,
               float* acc) {
  __m512 av[G][NC];
  for (int g = 0; g < G; g++)
    for (int c = 0; c < NC; c++) av[g][c] = _mm512_loadu_ps(acc + g * NC * 16 + c * 16);
  for (int64_t o = 0; o < a.n; o++) {
    const KV* v = rows + o * a.row_stride;
    prefetch_row(v, a);
    const float vs = sc ? sc[o * a.sc_stride] : 1.f;
    __m512 p[G];
    for (int g = 0; g < G; g++) p[g] = _mm512_set1_ps(probs[g * a.bs + o] * vs);
    for (int c = 0; c < NC; c++) {
      const __m512 vc = load16(v + c * 16);
      for (int g = 0; g < G; g++) av[g][c] = _mm512_fmadd_ps(p[g], vc, av[g][c]);
    }
  }
  for (int g = 0; g < G; g++)
    for (int c = 0; c < NC; c++) _mm512_storeu_ps(acc + g * NC * 16 + c * 16, av[g][c]);
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
#define TANDEM_GROUP(G)          \
  case G:                        \
    k.qk = qk_avx512<KV, G, NC>; \
    k.pv = pv_avx512<KV, G, NC>; \
    return;
    TANDEM_GROUP(1) TANDEM_GROUP(2) TANDEM_GROUP(3) TANDEM_GROUP(4)
    TANDEM_GROUP(5) TANDEM_GROUP(6) TANDEM_GROUP(7) TANDEM_GROUP(8)
#undef TANDEM_GROUP
    default:
      return;
  }
}
#endif

// Register-blocked kernels for the common shapes (head size 64 or 128, up to
// 8 query heads per KV head), the generic loops otherwise.
template <typename KV>
BlockKernels<KV> pick_kernels(int64_t group, int64_t D) {
  BlockKernels<KV> k;
#ifdef __AVX512F__
  if (D == 64) pick_group<KV, 4>(group, k);
  if (D == 128) pick_group<KV, 8>(group, k);
#endif
  return k;
}

// One decode query per sequence against part of its paged context: the query
// heads of KV heads [kv0, kv1) over tokens [start, end) (whole blocks but the
// last). A single pass, block by block, with an online softmax: each cache row
// (a slot's K and V heads, contiguous) is read from memory once, and the heads
// sharing a KV head reuse it from L1. Leaves the running max m, sum l and
// un-normalized numerator acc [nh, D] of each head for merge_partials.
template <typename KV>
void attend_range(const BlockKernels<KV>& kern, const float* q, int64_t q_head_stride,
                  const KV* cache, const float* kv_scale, const int32_t* table, int64_t start0,
                  int64_t end, int64_t block_size, int64_t hkv, int64_t kv0, int64_t kv1,
                  int64_t group, int64_t D, float scale, float* m, float* l, float* acc,
                  std::vector<float>& buf) {
  const int64_t nh = (kv1 - kv0) * group, slot_stride = 2 * hkv * D;
  buf.resize(nh * block_size);
  float* sc = buf.data();  // [nh, block_size] scores, then probabilities
  std::fill(m, m + nh, -INFINITY);
  std::fill(l, l + nh, 0.f);
  std::fill(acc, acc + nh * D, 0.f);
  const int64_t ctx = end;
  BlockArgs a{0, slot_stride, 2 * hkv, group, D, block_size, 0};
  for (int64_t start = start0, blk = start0 / block_size; start < ctx;
       start += block_size, blk++) {
    a.n = std::min(block_size, ctx - start);
    const int64_t base = static_cast<int64_t>(table[blk]) * block_size;
    a.next_offset = start + block_size < ctx
                        ? (static_cast<int64_t>(table[blk + 1]) * block_size - base) * slot_stride
                        : 0;
    for (int64_t kvh = kv0; kvh < kv1; kvh++) {
      const int64_t h0 = (kvh - kv0) * group;
      kern.qk(q + h0 * q_head_stride, q_head_stride, cache + base * slot_stride + kvh * D,
              kv_scale ? kv_scale + base * 2 * hkv + kvh : nullptr, a, scale,
              sc + h0 * block_size);
    }
    for (int64_t h = 0; h < nh; h++) {
      float* s = sc + h * block_size;
      float bm = m[h];
      for (int64_t o = 0; o < a.n; o++) bm = s[o] > bm ? s[o] : bm;
      const float alpha = exp_approx(m[h] - bm);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t o = 0; o < a.n; o++) {
        s[o] = exp_approx(s[o] - bm);
        sum += s[o];
      }
      l[h] = l[h] * alpha + sum;
      m[h] = bm;
      if (alpha != 1.f) {
        float* ah = acc + h * D;
#pragma omp simd
        for (int64_t i = 0; i < D; i++) ah[i] *= alpha;
      }
    }
    for (int64_t kvh = kv0; kvh < kv1; kvh++) {
      const int64_t h0 = (kvh - kv0) * group;
      kern.pv(sc + h0 * block_size, cache + base * slot_stride + (hkv + kvh) * D,
              kv_scale ? kv_scale + base * 2 * hkv + hkv + kvh : nullptr, a, acc + h0 * D);
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

at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& cache,
                                  const std::optional<at::Tensor>& cache_scale,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  int64_t block_size, double scale) {
  check_float_rows(q, "q");
  TORCH_CHECK(q.dim() == 3, "q must be [B, H, D]");
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 4, "cache must be a contiguous [S, 2, Hkv, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(),
              "block_tables and context_lens must be contiguous int32");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), hkv = cache.size(2);
  TORCH_CHECK(cache.size(3) == D && H % hkv == 0, "q and cache heads do not match");
  const int64_t group = H / hkv, nb = block_tables.size(1);
  const bool int8 = cache_scale.has_value();
  TORCH_CHECK(int8 ? cache.scalar_type() == at::kChar : cache.scalar_type() == at::kFloat,
              "cache dtype does not match its kind");
  auto out = at::empty({B, H * D}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  const int32_t* lp = context_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float* sp = int8 ? cache_scale->data_ptr<float>() : nullptr;
  const void* cp = cache.data_ptr();
  // Work items: whole sequences when there are enough of them to share out
  // (each cache row then streams from memory once); else (sequence, KV head),
  // and a long context split into ranges of whole blocks, so that one or two
  // sequences still keep every thread streaming (flash-decoding).
  const int64_t threads = at::get_num_threads();
  const int64_t heads_per_item = B >= 2 * threads ? hkv : 1;
  const int64_t kv_items = hkv / heads_per_item;
  int64_t total_ctx = 0, max_ctx = 1;
  for (int64_t b = 0; b < B; b++) {
    total_ctx += lp[b];
    max_ctx = std::max<int64_t>(max_ctx, lp[b]);
  }
  constexpr int64_t kMinSplitTokens = 256;
  int64_t splits = 1;
  if (heads_per_item == 1) {  // about 4 items per thread, a multiple of the threads
    const int64_t most = std::max<int64_t>(1, max_ctx / kMinSplitTokens);
    splits = std::min(most, (4 * threads + B * kv_items - 1) / (B * kv_items));
    while (splits < most && (B * kv_items * splits) % threads) splits++;
  }
  // Tokens per split: whole blocks, so a split never starts mid-block.
  const int64_t span = (max_ctx + splits - 1) / splits;
  const int64_t split_tokens = (span + block_size - 1) / block_size * block_size;
  const int64_t nh = heads_per_item * group, items = B * kv_items * splits;
  std::vector<float> part(items * nh * (D + 2));  // per item: m [nh], l [nh], acc [nh, D]
  // Stay on this thread unless the work pays for waking the others.
  const int64_t grain = total_ctx * hkv * D * 2 < 32768 ? items : 1;
  const float fscale = static_cast<float>(scale);
  const auto kf = pick_kernels<float>(group, D);
  const auto k8 = pick_kernels<int8_t>(group, D);
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t w = begin; w < end; w++) {
      const int64_t split = w % splits, seq_item = w / splits;
      const int64_t b = seq_item / kv_items, kv0 = (seq_item % kv_items) * heads_per_item;
      const int64_t lo = std::min<int64_t>(split * split_tokens, lp[b]);
      const int64_t hi = std::min<int64_t>(lo + split_tokens, lp[b]);
      float* m = part.data() + w * nh * (D + 2);
      float* l = m + nh;
      float* acc = l + nh;
      const float* qb = qp + b * qs0 + kv0 * group * qs1;
      if (int8)
        attend_range<int8_t>(k8, qb, qs1, static_cast<const int8_t*>(cp), sp, tp + b * nb, lo, hi,
                             block_size, hkv, kv0, kv0 + heads_per_item, group, D, fscale, m, l,
                             acc, buf);
      else
        attend_range<float>(kf, qb, qs1, static_cast<const float*>(cp), nullptr, tp + b * nb, lo,
                            hi, block_size, hkv, kv0, kv0 + heads_per_item, group, D, fscale, m,
                            l, acc, buf);
    }
  });
  // Merge each head's splits (a plain normalization when there is one).
  const int64_t stride = nh * (D + 2);
  for (int64_t seq_item = 0; seq_item < B * kv_items; seq_item++) {
    const int64_t b = seq_item / kv_items, kv0 = (seq_item % kv_items) * heads_per_item;
    const float* first = part.data() + seq_item * splits * stride;
    for (int64_t h = 0; h < nh; h++)
      merge_partials(first + h, first + nh + h, first + 2 * nh + h * D, splits, stride, D,
                     op + b * H * D + (kv0 * group + h) * D);
  }
  return out;
}

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
  std::vector<float> xsum(M * G);
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < G; g++) {
      float t = 0.f;
      for (int64_t i = 0; i < 32; i++) t += x.data_ptr<float>()[m * x.stride(0) + g * 32 + i];
      xsum[m * G + g] = t;
    }
  at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
    for (int64_t m = 0; m < M; m++)
      int4_gemv_rows(pp, sp, lp, b, e, K, x.data_ptr<float>() + m * x.stride(0),
                     xsum.data() + m * G, out.data_ptr<float>() + m * N);
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
  const float a_inv = 1.0f / (2.0f / 255.0f);
  at::parallel_for(0, M, 64, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; m++) {
      const float* r = x.data_ptr<float>() + m * x.stride(0);
      float amax = 0.f;
#pragma omp simd reduction(max : amax)
      for (int64_t k = 0; k < K; k++) amax = std::fabs(r[k]) > amax ? std::fabs(r[k]) : amax;
      const float sx = amax > 1e-12f ? amax : 1e-12f;
      sxs[m] = sx;
      uint8_t* q = qa.data() + m * kp;
#pragma omp simd
      for (int64_t k = 0; k < K; k++) {
        const float v = std::nearbyint((r[k] / sx) * a_inv) + 128.0f;
        q[k] = static_cast<uint8_t>(v < 0.f ? 0.f : (v > 255.f ? 255.f : v));
      }
    }
  });
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int32_t* ws = w_sum.data_ptr<int32_t>();
  const float* mp = mult.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const __m512i zp = _mm512_set1_epi32(128);
  at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t b, int64_t e) {
    for (int64_t pair = b; pair < e; pair++) {
      const int64_t t0 = pair * 2, nt = std::min<int64_t>(2, tiles - t0);
      const int8_t* w0 = wp + t0 * kq * 64;
      const int8_t* w1 = w0 + (nt > 1 ? kq * 64 : 0);
      for (int64_t m0 = 0; m0 < M; m0 += kInt8RowBlock) {
        const int64_t mr = std::min<int64_t>(kInt8RowBlock, M - m0);
        __m512i acc[kInt8RowBlock][2];
        for (int i = 0; i < kInt8RowBlock; i++) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
        const uint8_t* a = qa.data() + m0 * kp;
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
          for (int64_t i = 0; i < mr; i++) {
            const __m512 v = _mm512_mul_ps(
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][j], corr)), mv),
                _mm512_set1_ps(sxs[m0 + i]));
            _mm512_mask_storeu_ps(op + (m0 + i) * N + n0, keep, v);
          }
        }
      }
    }
  });
  return out;
}
#endif

}  // namespace

TORCH_LIBRARY(tandem, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def(
      "rotary_embedding_and_cache(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, "
      "int num_heads, int num_kv_heads, Tensor(b!) cache, Tensor(c!)? cache_scale, "
      "Tensor slots) -> ()");
  m.def(
      "paged_attention_decode(Tensor q, Tensor cache, Tensor? cache_scale, Tensor block_tables, "
      "Tensor context_lens, int block_size, float scale) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scale, Tensor lo) -> Tensor");
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  m.def("int8_linear(Tensor x, Tensor packed, Tensor w_sum, Tensor mult, int N) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding_and_cache", &rotary_embedding_and_cache);
  m.impl("paged_attention_decode", &paged_attention_decode);
  m.impl("int4_linear", &int4_linear);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  m.impl("int8_linear", &int8_linear);
#endif
}
