// Structured outputs: write a grammar's token bitmask into the logits.
#pragma once

#include "common.h"

namespace tandem {

// logits[rows[r], t] = value for every token t whose bit in bitmask[r] is 0.
//
// The bitmask is the grammar engine's own (llguidance's): int32 words, bit t % 32
// of word t / 32 set when token t is allowed. Tokens past the mask's last word are
// banned too (no grammar can accept an id it does not know). Reading the packed
// words directly replaces an unpack to one byte per token, a float bias and an
// index_add_ with stores to banned entries
// only, skipping the all-allowed words.
void apply_token_bitmask_(at::Tensor logits, const at::Tensor& rows, const at::Tensor& bitmask,
                          double value) {
  check_float_rows(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "logits must be [batch, vocab]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "rows must be int64 [R]");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 &&
                  bitmask.size(0) == rows.size(0) && bitmask.stride(1) == 1,
              "bitmask must be int32 [R, words] with contiguous rows");
  const int64_t batch = logits.size(0), vocab = logits.size(1);
  const int64_t words = std::min(bitmask.size(1), (vocab + 31) / 32);
  const float v = static_cast<float>(value);
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows.size(0); r++) {
    TORCH_CHECK(row[r] >= 0 && row[r] < batch, "row ", row[r], " out of range");
    float* out = logits.data_ptr<float>() + row[r] * logits.stride(0);
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>()) +
                           r * bitmask.stride(0);
    const int64_t full = std::min(words, vocab / 32);  // words with 32 tokens in the row
    int64_t w = 0;
#if defined(__AVX512F__)
    const __m512 vv = _mm512_set1_ps(v);
    for (; w < full; w++) {
      const uint32_t banned = ~bits[w];
      if (banned == 0) continue;
      _mm512_mask_storeu_ps(out + 32 * w, static_cast<__mmask16>(banned), vv);
      _mm512_mask_storeu_ps(out + 32 * w + 16, static_cast<__mmask16>(banned >> 16), vv);
    }
#endif
    for (; w < words; w++) {
      const uint32_t banned = ~bits[w];
      const int64_t end = std::min<int64_t>(32, vocab - 32 * w);
      for (int64_t b = 0; b < end; b++)
        if (banned >> b & 1u) out[32 * w + b] = v;
    }
    for (int64_t t = 32 * words; t < vocab; t++) out[t] = v;
  }
}

}  // namespace tandem
