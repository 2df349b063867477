// A whole decode step of a Llama-family model on CPU in one call: embedding
// rows, every layer, the final norm and the LM head; fp32 activations, layer
// weights dense fp32, int8 (VNNI) or int4 (tandem/kernels/csrc/step_matmul.h).
//
// Decode at small batch is bound by reading the weights (~538 MB per token for
// the default model in fp32), but a step driven from Python, one aten op after
// another, also leaves memory idle: ~10 op dispatches per layer, a thread-team
// wake-up per op, and MKL's ramp-up at the start of each small matmul (a
// sizeable share of a batch-1 step). Here one OpenMP team runs the whole
// step: each matmul's outputs are split across the threads (for fp32,
// tandem::matvec, which streams W at the machine's read bandwidth), the glue
// in between is short, and the threads meet at a barrier only
// where the next stage needs every thread's outputs.
//
// The math is the torch reference path's (tandem/model/llama.py): the same
// RMSNorm, RoPE, cache write, decode attention, SiLU and quantized-matmul code
// as tandem's per-op kernels; only fp32 matmuls sum in another order than MKL.
#pragma once

#include <omp.h>
#include <torch/custom_class.h>

#include "attention.h"
#include "layer_ops.h"
#include "step_matmul.h"

namespace tandem {

// One layer's weights and KV cache, as the step reads them. Optional parts
// (Qwen2's Q/K/V bias, Qwen3's per-head Q/K norms, an int8 cache's scales) are
// undefined tensors when the model has none.
struct StepLayer {
  at::Tensor input_norm, post_norm;
  at::Tensor attn_out_norm, mlp_out_norm;  // Gemma's norms on each block's output, or undefined
  StepMatmul qkv, o, gate_up, down;
  at::Tensor qkv_bias, q_norm, k_norm;
  at::Tensor cache, cache_scale;  // held: rope points into them
  KVKind kv;
  RopeAndCache rope;  // bound to this layer's cache (and int8's scales)
  int64_t window = 0;  // a sliding window's keys, or 0
  int64_t group = 0;  // its KV cache group: the block table and slot it reads and writes
};

struct DecodeStep : torch::CustomClassHolder {
  // Attention splits a context into ranges of at least this many tokens
  // (the team is awake: a short range costs only its merge).
  static constexpr int64_t kMinSplitTokens = 64;

  std::vector<StepLayer> layers;
  StepMatmul lm_head{WeightKind::kDense, {}, {}, {}, 0, 0};
  at::Tensor embed, norm, cos, sin;  // embed: float32, or float16 in quantized models
  at::Tensor cos_local, sin_local;  // Gemma 3's windowed layers' RoPE tables (set_variant)
  Activation act = Activation::kSilu;
  float embed_scale = 1.f;
  float attn_softcap = 0.f;  // Gemma 2's attention logit soft-capping, or 0
  bool sandwich_ = false;  // some layer has output norms
  int64_t H, hkv = 0, D, hidden, inter, vocab = 0, block_size;
  int64_t window_ = 0;  // the windowed layers' window (0: none has one)
  // Per KV cache group (add_layer's group): bit 0 set if a full-attention layer
  // is in it, bit 1 if a windowed one is; each needs its attention plan (none:
  // a group without layers, which the engine's grouping never makes).
  std::vector<int> group_kinds_;
  // Threads' shares of every layer matmul's outputs start on multiples of
  // this: the largest unit of any layer's weight format.
  int64_t unit = 1;
  float eps, scale;

  // Built in three calls from Python (tandem/worker/decode_step.py): the
  // shared tensors here, then set_lm_head and one add_layer per layer. Each
  // checks what it is given against the model's shape and refuses what the
  // step does not implement (another RoPE width, a cache of other heads, a
  // weight kind it has no kernel for): the caller then keeps the per-op path.
  DecodeStep(at::Tensor embed_, at::Tensor norm_, at::Tensor cos_, at::Tensor sin_,
             int64_t num_heads, int64_t head_dim, int64_t intermediate_size,
             int64_t block_size_, double eps_)
      : embed(std::move(embed_)), norm(std::move(norm_)), cos(std::move(cos_)),
        sin(std::move(sin_)), H(num_heads), D(head_dim), inter(intermediate_size),
        block_size(block_size_), eps(static_cast<float>(eps_)) {
    TORCH_CHECK(embed.device().is_cpu() && embed.is_contiguous() && embed.dim() == 2 &&
                    (embed.scalar_type() == at::kFloat || embed.scalar_type() == at::kHalf),
                "DecodeStep: embed must be a contiguous float32 or float16 CPU matrix");
    hidden = embed.size(1);
    scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
    dense(norm, hidden, 0, "norm");
    // RoPE rotates every head's whole width (no partial rotary).
    dense(cos, cos.size(0), D, "cos");
    dense(sin, cos.size(0), D, "sin");
    TORCH_CHECK(D % 2 == 0 && block_size > 0, "DecodeStep: odd head size or empty blocks");
  }

  // A model that differs from the Llama layout (Gemma 2 / 3): the MLP's
  // activation, the embedding's scale, the query scale, the RoPE tables of
  // windowed layers (add_layer's local_rope; Gemma 2: the global ones) and
  // the attention logits' soft-cap (0: none). Before the first add_layer.
  void set_variant(int64_t activation, double embed_scale_, double attn_scale,
                   at::Tensor cos_local_, at::Tensor sin_local_, double attn_softcap_) {
    TORCH_CHECK(layers.empty(), "DecodeStep: set_variant before add_layer");
    TORCH_CHECK(activation == 0 || activation == 1, "DecodeStep: unknown activation");
    TORCH_CHECK(attn_scale > 0 && embed_scale_ > 0 && attn_softcap_ >= 0,
                "DecodeStep: scales must be positive");
    dense(cos_local_, cos.size(0), D, "cos_local");
    dense(sin_local_, cos.size(0), D, "sin_local");
    act = static_cast<Activation>(activation);
    embed_scale = static_cast<float>(embed_scale_);
    scale = static_cast<float>(attn_scale);
    cos_local = std::move(cos_local_);
    sin_local = std::move(sin_local_);
    attn_softcap = static_cast<float>(attn_softcap_);
  }

  static void dense(const at::Tensor& t, int64_t rows, int64_t cols, const char* name) {
    TORCH_CHECK(t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat &&
                    t.is_contiguous() && t.dim() == (cols ? 2 : 1) && t.size(0) == rows &&
                    (!cols || t.size(1) == cols),
                "DecodeStep: ", name, " must be a contiguous float32 CPU tensor of the "
                "model's shape");
  }

  // Optional norm weights of n values that come as a pair (both or neither)
  // into da, db; returns whether they came.
  static bool norm_pair(const std::optional<at::Tensor>& a, const std::optional<at::Tensor>& b,
                        int64_t n, const char* what, const char* a_name, const char* b_name,
                        at::Tensor& da, at::Tensor& db) {
    TORCH_CHECK(a.has_value() == b.has_value(), "DecodeStep: ", what, " go together");
    if (!a) return false;
    dense(*a, n, 0, a_name);
    dense(*b, n, 0, b_name);
    da = *a;
    db = *b;
    return true;
  }

  static StepMatmul matmul(int64_t kind, at::Tensor w, at::Tensor a, at::Tensor b, int64_t N,
                           int64_t K, const char* name) {
    TORCH_CHECK(kind >= 0 && kind <= 2, "DecodeStep: ", name, " has an unknown weight kind");
    StepMatmul m{static_cast<WeightKind>(kind), std::move(w), std::move(a), std::move(b), N, K};
    m.check(name);
    return m;
  }

  // The LM head's weight of `kind` (its tensors as for add_layer's matmuls).
  void set_lm_head(int64_t kind, at::Tensor w, at::Tensor a, at::Tensor b, int64_t vocab_size) {
    vocab = vocab_size;
    lm_head = matmul(kind, std::move(w), std::move(a), std::move(b), vocab, hidden, "lm_head");
  }

  // One layer. kinds: the weight kind of qkv, o, gate_up, down (a GGUF mixes
  // formats, e.g. Q4_K_M's Q6_K down_proj); matmuls: their tensors, three
  // each (dense: the [out, in] weight, the other two unused; int8: packed,
  // w_scale, group scales or empty; int4: packed, then two empty tensors).
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::vector<int64_t> kinds,
                 std::vector<at::Tensor> matmuls, std::optional<at::Tensor> qkv_bias,
                 std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                 at::Tensor cache, std::optional<at::Tensor> cache_scale, int64_t window,
                 std::optional<at::Tensor> attn_out_norm, std::optional<at::Tensor> mlp_out_norm,
                 bool local_rope, int64_t group) {
    TORCH_CHECK(kinds.size() == 4 && matmuls.size() == 12,
                "DecodeStep: a layer has four matmuls (qkv, o, gate_up, down), three tensors "
                "each");
    TORCH_CHECK(cache.dim() == 4 && cache.size(1) == 2 && cache.size(3) == D &&
                    (layers.empty() || cache.size(2) == hkv),
                "DecodeStep: every layer's cache must be [slots, 2, kv heads, head size] with "
                "the same heads");
    hkv = cache.size(2);
    TORCH_CHECK(hkv > 0 && H % hkv == 0, "DecodeStep: query heads must be a multiple of KV "
                "heads");
    const int64_t qkv_n = (H + 2 * hkv) * D;
    // Every windowed layer has the same window (one attention plan serves them).
    TORCH_CHECK(window >= 0 && (window == 0 || window_ == 0 || window == window_),
                "DecodeStep: windowed layers must share one window");
    TORCH_CHECK(group >= 0 && group < 64, "DecodeStep: a KV cache group is 0-63");
    if (group >= static_cast<int64_t>(group_kinds_.size())) group_kinds_.resize(group + 1, 0);
    group_kinds_[group] |= window ? 2 : 1;
    StepLayer l;
    l.window = window;
    l.group = group;
    if (window) window_ = window;
    l.input_norm = std::move(input_norm);
    l.post_norm = std::move(post_norm);
    dense(l.input_norm, hidden, 0, "input_norm");
    dense(l.post_norm, hidden, 0, "post_norm");
    const at::Tensor* m = matmuls.data();
    l.qkv = matmul(kinds[0], m[0], m[1], m[2], qkv_n, hidden, "qkv");
    l.o = matmul(kinds[1], m[3], m[4], m[5], hidden, H * D, "o");
    l.gate_up = matmul(kinds[2], m[6], m[7], m[8], 2 * inter, hidden, "gate_up");
    l.down = matmul(kinds[3], m[9], m[10], m[11], hidden, inter, "down");
    for (const auto* mm : {&l.qkv, &l.o, &l.gate_up, &l.down})
      unit = std::max(unit, StepMatmul::unit(mm->kind));
    // Threads split Q/K/V by heads and gate/up by matching rows: both must
    // fall on whole units of the weight formats.
    TORCH_CHECK(D % unit == 0 && inter % unit == 0,
                "DecodeStep: head size and intermediate size must be multiples of ", unit);
    if (qkv_bias) {
      dense(*qkv_bias, qkv_n, 0, "qkv_bias");
      l.qkv_bias = *qkv_bias;
    }
    norm_pair(q_norm, k_norm, D, "Q and K norms", "q_norm", "k_norm", l.q_norm, l.k_norm);
    sandwich_ |= norm_pair(attn_out_norm, mlp_out_norm, hidden, "output norms", "attn_out_norm",
                           "mlp_out_norm", l.attn_out_norm, l.mlp_out_norm);
    TORCH_CHECK(!local_rope || cos_local.defined(), "DecodeStep: local RoPE needs set_variant");
    l.kv = kv_kind(cache, cache_scale);
    TORCH_CHECK(layers.empty() || l.kv == layers[0].kv,
                "DecodeStep: every layer's cache must be of one kind");
    const at::Tensor& c = local_rope ? cos_local : cos;
    const at::Tensor& sn = local_rope ? sin_local : sin;
    l.rope = RopeAndCache{c.data_ptr<float>(), sn.data_ptr<float>(), H, hkv, D};
    bind_cache(l.rope, cache, cache_scale);
    l.cache = std::move(cache);
    if (cache_scale) l.cache_scale = *cache_scale;
    layers.push_back(std::move(l));
  }

  // tokens [B, 2 + G] int64: each sequence's new token id, its position and
  // its cache slot in each of the G KV cache groups; block_tables [G, B, nb]
  // int32, each group's, covering position + 1 tokens (a windowed group's
  // entries before the window are not read).
  // Writes the new K/V to the caches; returns the logits [B, vocab] and each
  // row's argmax [B] (int64, the first index on ties): greedy sampling with
  // no torch op after the step, whose first ops run on caches the weights
  // have just swept.
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& tokens,
                                             const at::Tensor& block_tables) {
    TORCH_CHECK(!layers.empty() && vocab > 0, "DecodeStep: add the layers and the LM head "
                "before the first step");
    const int64_t G = static_cast<int64_t>(group_kinds_.size()), B = tokens.size(0);
    TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 2 &&
                    tokens.size(1) == 2 + G && B > 0 && tokens.is_contiguous(),
                "tokens must be a contiguous int64 [B, 2 + KV cache groups]: token id, "
                "position, a slot per group");
    TORCH_CHECK(block_tables.dim() == 3 && block_tables.size(0) == G &&
                    block_tables.size(1) == B && block_tables.scalar_type() == at::kInt &&
                    block_tables.is_contiguous(),
                "block_tables must be a contiguous int32 [KV cache groups, B, blocks]");
    const int64_t num_slots = layers[0].cache.size(0);
    const int64_t* tk = tokens.data_ptr<int64_t>();
    std::vector<int64_t> ids(B), pos(B), slot(G * B);  // slot[g * B + b]
    auto context_lens = at::empty({B}, tokens.options().dtype(at::kInt));
    for (int64_t b = 0; b < B; b++) {
      const int64_t* row = tk + (2 + G) * b;
      ids[b] = row[0];
      pos[b] = row[1];
      bool slots_ok = true;
      for (int64_t g = 0; g < G; g++) {
        slot[g * B + b] = row[2 + g];
        slots_ok &= row[2 + g] >= 0 && row[2 + g] < num_slots;
      }
      TORCH_CHECK(ids[b] >= 0 && ids[b] < embed.size(0) && pos[b] >= 0 && pos[b] < cos.size(0) &&
                      slots_ok,
                  "token id, position or slot out of range");
      context_lens.data_ptr<int32_t>()[b] = static_cast<int32_t>(pos[b] + 1);
    }
    const int64_t qkv_n = (H + 2 * hkv) * D, threads = at::get_num_threads();
    std::vector<float> x(B * hidden), xn(threads * B * hidden), qkv_out(B * qkv_n),
        attn(threads * B * H * D), gu(B * 2 * inter), mlp_act(B * inter),
        out_rows(sandwich_ ? B * hidden : 0);
    // Per KV cache group, its full-context layers' attention plan (plans[2g])
    // and its windowed layers' (plans[2g + 1]: items cover each sequence's
    // last window_ keys), each made where the group has such layers.
    const int64_t max_blocks = num_slots / block_size;
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    for (int64_t i = 0; i < block_tables.numel(); i++)
      TORCH_CHECK(tables[i] >= 0 && tables[i] < max_blocks, "block id out of range");
    for (int64_t b = 0; b < B; b++)
      TORCH_CHECK(pos[b] + 1 <= block_tables.size(2) * block_size,
                  "context length out of range of its block table");
    std::vector<DecodeAttention> plans;
    plans.reserve(2 * G);  // push_back(plans.back()) must not reallocate
    size_t part_floats = 0;
    for (int64_t g = 0; g < G; g++) {
      plans.push_back(decode_attention(qkv_out.data(), qkv_n, D, B, H, hkv, D, block_tables[g],
                                       context_lens, block_size, scale, 0, attn_softcap));
      plans.push_back(plans.back());
      plans.back().window = window_;
      for (int kind = 0; kind < 2; kind++)
        if (group_kinds_[g] & (1 << kind)) {
          DecodeAttention& p = plans[2 * g + kind];
          p.plan(threads, kMinSplitTokens);
          part_floats = std::max<size_t>(part_floats, p.partial_floats());
        }
    }
    std::vector<float> part(part_floats);
    std::vector<float> best_v(threads * B, -INFINITY);
    std::vector<int64_t> best_i(threads * B, -1);
    auto logits = at::empty({B, vocab}, norm.options());
    float* out = logits.data_ptr<float>();
    for (int64_t b = 0; b < B; b++)
      if (embed.scalar_type() == at::kFloat) {
        std::memcpy(x.data() + b * hidden, embed.data_ptr<float>() + ids[b] * hidden,
                    hidden * sizeof(float));
      } else {
        const uint16_t* row = half_ptr(embed) + ids[b] * hidden;
        for (int64_t i = 0; i < hidden; i++) x[b * hidden + i] = half_to_float(row[i]);
      }
    if (embed_scale != 1.f)
      for (float& v : x) v *= embed_scale;

    // Five barriers per layer, each where a stage needs every thread's
    // outputs: after Q/K/V (attention reads all heads), after attention,
    // after o_proj and after gate/up (their matmuls read the whole hidden
    // and intermediate rows), after down_proj.
#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      // This thread's copies of the normed rows and the attention output:
      // every thread computes them in full (a few hundred floats a row)
      // rather than wait at a barrier for one thread to share them.
      float* xt = xn.data() + t * B * hidden;
      float* attn_t = attn.data() + t * B * H * D;
      std::vector<float> buf;
      auto normed = [&](const at::Tensor& w) {
        for (int64_t b = 0; b < B; b++)
          rms_norm_row(x.data() + b * hidden, w.data_ptr<float>(), hidden, eps, xt + b * hidden);
      };
      // Q/K/V by whole heads, so this thread also norms (Qwen3), rotates and
      // caches the heads it computed.
      const auto [head0, head1] = share(H + 2 * hkv, t, nt, 1);
      const auto [h0, h1] = share(hidden, t, nt, unit);
      const auto [i0, i1] = share(inter, t, nt, unit);  // gate rows [i0, i1) and their up rows
      const auto [v0, v1] = share(vocab, t, nt, StepMatmul::unit(lm_head.kind));
      StepInput in;
      // Gemma: x += RMSNorm(a block's output out), each thread its columns [h0,
      // h1) of every row, once all of out is there (barriers either side).
      auto add_normed = [&](const at::Tensor& w) {
#pragma omp barrier
        const float* wp = w.data_ptr<float>();
        for (int64_t b = 0; b < B; b++) {
          const float* o = out_rows.data() + b * hidden;
          const float inv = inv_rms(o, hidden, eps);
          float* xb = x.data() + b * hidden;
#pragma omp simd
          for (int64_t i = h0; i < h1; i++) xb[i] += wp[i] * (o[i] * inv);
        }
      };
      for (const StepLayer& L : layers) {
        const RopeAndCache& rope = L.rope;
        normed(L.input_norm);
        L.qkv.prepare(xt, hidden, B, in);
        L.qkv.apply(in, head0 * D, head1 * D,
                    L.qkv_bias.defined() ? L.qkv_bias.data_ptr<float>() : nullptr, false,
                    qkv_out.data(), qkv_n);
        for (int64_t b = 0; b < B; b++) {
          float* row = qkv_out.data() + b * qkv_n;
          for (int64_t h = head0; h < head1; h++) {
            float* head = row + h * D;
            if (h < H + hkv) {
              if (L.q_norm.defined())  // Qwen3: RMSNorm per query and key head before RoPE
                rms_norm_row(head, (h < H ? L.q_norm : L.k_norm).data_ptr<float>(), D, eps, head);
              rope.rotate(head, pos[b]);
            }
            if (h >= H) rope.store(head, slot[L.group * B + b], h - H);
          }
        }
#pragma omp barrier
        const DecodeAttention& la = plans[2 * L.group + (L.window ? 1 : 0)];
#pragma omp for schedule(static)
        for (int64_t w = 0; w < la.items; w++)
          la.run_item(w, L.kv, L.cache.data_ptr(), rope.cache_s, part.data(), buf);
        for (int64_t s = 0; s < B * la.kv_items; s++) la.merge(s, part.data(), attn_t);
        const bool sandwich = L.attn_out_norm.defined();
        L.o.prepare(attn_t, H * D, B, in);
        L.o.apply(in, h0, h1, nullptr, !sandwich, sandwich ? out_rows.data() : x.data(), hidden);
        if (sandwich) add_normed(L.attn_out_norm);
#pragma omp barrier
        normed(L.post_norm);
        L.gate_up.prepare(xt, hidden, B, in);
        L.gate_up.apply(in, i0, i1, nullptr, false, gu.data(), 2 * inter);
        L.gate_up.apply(in, inter + i0, inter + i1, nullptr, false, gu.data(), 2 * inter);
        for (int64_t b = 0; b < B; b++)
          act_and_mul_row(act, gu.data() + b * 2 * inter + i0,
                          gu.data() + b * 2 * inter + inter + i0, i1 - i0,
                          mlp_act.data() + b * inter + i0);
#pragma omp barrier
        L.down.prepare(mlp_act.data(), inter, B, in);
        L.down.apply(in, h0, h1, nullptr, !sandwich, sandwich ? out_rows.data() : x.data(),
                     hidden);
        if (sandwich) add_normed(L.mlp_out_norm);
#pragma omp barrier
      }
      normed(norm);
      lm_head.prepare(xt, hidden, B, in);
      lm_head.apply(in, v0, v1, nullptr, false, out, vocab);
      for (int64_t b = 0; b < B; b++) {  // this thread's share of each row's argmax
        const float* row = out + b * vocab;
        for (int64_t v = v0; v < v1; v++)
          if (row[v] > best_v[t * B + b]) {
            best_v[t * B + b] = row[v];
            best_i[t * B + b] = v;
          }
      }
    }
    auto argmax = at::empty({B}, tokens.options());
    int64_t* am = argmax.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; b++) {  // shares in vocabulary order: ties keep the first
      int64_t pick = -1;
      float pv = -INFINITY;
      for (int64_t t = 0; t < threads; t++)
        if (best_i[t * B + b] >= 0 && (pick < 0 || best_v[t * B + b] > pv)) {
          pick = best_i[t * B + b];
          pv = best_v[t * B + b];
        }
      am[b] = pick < 0 ? 0 : pick;  // every logit -inf (or NaN): token 0
    }
    return {logits, argmax};
  }
};

}  // namespace tandem
