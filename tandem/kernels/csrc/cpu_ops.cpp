// tandem's CPU kernels: the per-layer glue of a decode step fused, and the
// quantized matmuls torch has no fast CPU kernel for at decode sizes.
//
// A decode step at batch 1 spent much of its time in ~25 small aten ops per
// layer (norms, RoPE, the KV write, the KV gather, SDPA). These kernels do the
// same math in one pass each, and the decode attention reads K/V straight from
// the paged cache through the block table instead of gathering a padded copy
// (at batch 32 that copy moved ~12 MB per layer per step). The int8 (VNNI) and
// int4 matmuls stream quantized weights at memory speed at batch 1, where
// fbgemm's and torch's int4 kernels do not, and quantize activations in groups
// of 32 (llama.cpp's Q8_0 way), which fbgemm cannot. token_bitmask.h writes a
// grammar's packed token mask into the logits (structured outputs), sampling.h
// turns logits into the sampler's unnormalised probabilities in one pass,
// tile_pack.h packs quantized weights into the matmuls' tiles as they load,
// block_formats.h turns a GGUF's K-quant blocks into tandem's groups.
//
// decode_step.h runs a whole decode step (every layer and the LM head) in one
// OpenMP team, with these kernels and matvec.h's row-streaming fp32 matmul;
// it is registered as the class torch.classes.tandem.DecodeStep.
//
// AVX-512 (and VNNI) paths are chosen at compile time (-march=native); every
// kernel has a portable loop beside it.
//
// Numerics follow the torch reference paths in tandem/model/*.py: fp32
// accumulation everywhere, RoPE computed as x*cos - y*sin without contraction
// (built with -ffp-contract=off) like HF's, int8 KV quantized per token and
// head with round-half-even exactly as Int8KVCache.write does.
//
// Built by tandem/kernels/custom_ops.py with the host's g++ against torch's headers,
// as one translation unit (one compile, once per machine); registered here as
// torch.ops.tandem.*. The kernels live in the headers beside this file.

#include <torch/library.h>

#include "attention.h"
#include "block_formats.h"
#include "decode_step.h"
#include "layer_ops.h"
#include "prefill_attention.h"
#include "quant_linear.h"
#include "sampling.h"
#include "tile_pack.h"
#include "token_bitmask.h"

TORCH_LIBRARY(tandem, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("act_and_mul(Tensor x, int activation=0) -> Tensor");
  m.def(
      "rotary_embedding_and_cache(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, "
      "int num_heads, int num_kv_heads, Tensor(b!) cache, Tensor(c!)? cache_scale, "
      "Tensor slots) -> ()");
  m.def(
      "paged_attention_decode(Tensor q, Tensor cache, Tensor? cache_scale, Tensor block_tables, "
      "Tensor context_lens, int block_size, float scale, int window=0, float softcap=0.) "
      "-> Tensor");
  m.def(
      "paged_attention_prefill(Tensor q, Tensor cache, Tensor? cache_scale, Tensor block_tables, "
      "Tensor context_lens, Tensor query_starts, int block_size, float scale, int window=0, "
      "float softcap=0.) -> Tensor");
  m.def("matvec(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, int N) -> Tensor");
  m.class_<tandem::DecodeStep>("DecodeStep")
      .def(torch::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, int64_t,
                       int64_t, double>())
      .def("set_lm_head", &tandem::DecodeStep::set_lm_head)
      .def("set_variant", &tandem::DecodeStep::set_variant)
      .def("add_layer", &tandem::DecodeStep::add_layer)
      .def("forward", &tandem::DecodeStep::forward);
  m.def("int8_linear(Tensor x, Tensor packed, Tensor w_scale, Tensor g_scale, int N) -> Tensor");
  m.def("pack_tile_bytes(Tensor(a!) dest, Tensor src, int row0, int flip) -> ()");
  m.def("pack_tile_halves(Tensor(a!) dest, Tensor src, int row0, int offset) -> ()");
  m.def("q4_k_to_int4(Tensor raw) -> Tensor[]");
  m.def("q5_0_to_int8(Tensor raw) -> Tensor[]");
  m.def("q5_k_to_int8(Tensor raw) -> Tensor[]");
  m.def("q6_k_to_int8(Tensor raw) -> Tensor[]");
  m.def("exp_weights(Tensor logits, Tensor temperature) -> (Tensor, Tensor)");
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor rows, Tensor bitmask, float value) -> ()");
  m.def("simd_features", &tandem::simd_features);
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("rms_norm", &tandem::rms_norm);
  m.impl("act_and_mul", &tandem::act_and_mul);
  m.impl("rotary_embedding_and_cache", &tandem::rotary_embedding_and_cache);
  m.impl("paged_attention_decode", &tandem::paged_attention_decode);
  m.impl("paged_attention_prefill", &tandem::paged_attention_prefill);
  m.impl("matvec", &tandem::matvec_op);
  m.impl("int4_linear", &tandem::int4_linear);
  m.impl("int8_linear", &tandem::int8_linear);
  m.impl("pack_tile_bytes", &tandem::pack_tile_bytes);
  m.impl("pack_tile_halves", &tandem::pack_tile_halves);
  m.impl("q4_k_to_int4", &tandem::q4_k_to_int4);
  m.impl("q5_0_to_int8", &tandem::q5_0_to_int8);
  m.impl("q5_k_to_int8", &tandem::q5_k_to_int8);
  m.impl("q6_k_to_int8", &tandem::q6_k_to_int8);
  m.impl("exp_weights", &tandem::exp_weights);
  m.impl("apply_token_bitmask_", &tandem::apply_token_bitmask_);
}
