// GGUF's K-quant blocks as tandem's groups of 32, at load time: Q4_K as int4
// groups (exact up to the fp16 rounding of each group's scale and lo), Q5_K
// and Q6_K requantized to int8 groups (Q8_0's rule: scale absmax / 127 in
// fp16); and Q5_0 as int8 groups exactly. The reference is
// tandem/model/gguf.py (_decode_q4_k, _decode_q5_0, and gguf's dequantize then
// quantize_int8_groups for the others): same float operations in the same
// order, so the same bits. Q4_K_M and Q5_K_M files are mostly
// these formats; numpy decoded them slowly and held an fp32 copy of
// each requantized tensor (2.1 GB for an 8B model's LM head).
#pragma once

#include "common.h"

namespace tandem {

namespace {

constexpr int64_t kSuperBlock = 256;  // values per K-quant super-block
constexpr int64_t kQ4KBytes = 144, kQ5KBytes = 176, kQ6KBytes = 210, kQ5_0Bytes = 22;

// Contiguous rows of whole super-blocks: [rows, blocks * size] uint8.
int64_t check_blocks(const at::Tensor& raw, int64_t size, const char* what) {
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.dim() == 2 &&
                  raw.stride(1) == 1 && raw.size(1) % size == 0,
              what, ": raw must be uint8 [rows, whole ", size, "-byte blocks] with contiguous rows");
  return raw.size(1) / size;
}

uint16_t to_half(float v) { return c10::Half(v).x; }

// Q4_K's and Q5_K's 6-bit scale and min of sub-block j from their 12 bytes
// (4 bytes low scales, 4 low mins, 4 holding both's high bits).
int k_scale(const uint8_t* sc, int j) {
  return j < 4 ? sc[j] & 63 : (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
}
int k_min(const uint8_t* sc, int j) {
  return j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
}

// What a decoder to int8 groups fills: int8 [rows, G, 32] and fp16 scales [rows, G].
struct Int8Groups {
  at::Tensor data, scale;
  int8_t* q;
  uint16_t* d;

  Int8Groups(const at::Tensor& raw, int64_t rows, int64_t G)
      : data(at::empty({rows, G, 32}, raw.options().dtype(at::kChar))),
        scale(at::empty({rows, G}, raw.options().dtype(at::kHalf))),
        q(data.data_ptr<int8_t>()),
        d(reinterpret_cast<uint16_t*>(scale.data_ptr<at::Half>())) {}
};

}  // namespace

// Q4_K super-blocks (fp16 d, dmin; 12 bytes of 6-bit scales and mins for 8
// sub-blocks of 32; 128 bytes of nibbles, sub-block 2c in chunk c's low
// nibbles, 2c + 1 in its high ones) -> int4 data [rows, G, 16] (byte i: value
// i low, 16 + i high), fp16 scale d * sc and lo -dmin * m [rows, G].
std::vector<at::Tensor> q4_k_to_int4(const at::Tensor& raw) {
  const int64_t nsb = check_blocks(raw, kQ4KBytes, "q4_k_to_int4"), rows = raw.size(0);
  const int64_t G = nsb * 8;
  auto data = at::empty({rows, G, 16}, raw.options());
  auto scale = at::empty({rows, G}, raw.options().dtype(at::kHalf));
  auto lo = at::empty({rows, G}, raw.options().dtype(at::kHalf));
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dq = data.data_ptr<uint8_t>();
  auto* ds = reinterpret_cast<uint16_t*>(scale.data_ptr<at::Half>());
  auto* dl = reinterpret_cast<uint16_t*>(lo.data_ptr<at::Half>());
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
      for (int64_t b = 0; b < nsb; b++) {
        const uint8_t* blk = src + r * raw.stride(0) + b * kQ4KBytes;
        uint16_t dh, mh;
        std::memcpy(&dh, blk, 2);
        std::memcpy(&mh, blk + 2, 2);
        const float d = half_to_float(dh), dmin = half_to_float(mh);
        const uint8_t* sc = blk + 4;  // 4 bytes low, 4 high, 4 mixed
        const uint8_t* qs = blk + 16;
        const int64_t g0 = r * G + b * 8;
        for (int j = 0; j < 8; j++) {
          ds[g0 + j] = to_half(d * static_cast<float>(k_scale(sc, j)));
          dl[g0 + j] = to_half(-(dmin * static_cast<float>(k_min(sc, j))));
          const uint8_t* chunk = qs + 32 * (j / 2);
          uint8_t* out = dq + (g0 + j) * 16;
          for (int i = 0; i < 16; i++)
            out[i] = j % 2 == 0 ? (chunk[i] & 15) | ((chunk[16 + i] & 15) << 4)
                                : (chunk[i] >> 4) | (chunk[16 + i] & 0xF0);
        }
      }
  });
  return {data, scale, lo};
}

// Q5_0 blocks (fp16 d; 4 bytes whose bit i is value i's fifth bit; 16 bytes
// of nibbles, value i low and 16 + i high in byte i): w = d (q - 16) -> int8
// groups [rows, G, 32] of q - 16, fp16 scale d [rows, G]: the same values.
std::vector<at::Tensor> q5_0_to_int8(const at::Tensor& raw) {
  const int64_t G = check_blocks(raw, kQ5_0Bytes, "q5_0_to_int8"), rows = raw.size(0);
  Int8Groups out(raw, rows, G);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  int8_t* dq = out.q;
  uint16_t* ds = out.d;
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
      for (int64_t g = 0; g < G; g++) {
        const uint8_t* blk = src + r * raw.stride(0) + g * kQ5_0Bytes;
        uint32_t qh;
        std::memcpy(&ds[r * G + g], blk, 2);
        std::memcpy(&qh, blk + 2, 4);
        const uint8_t* qs = blk + 6;
        int8_t* o = dq + (r * G + g) * 32;
        for (int i = 0; i < 16; i++) {
          o[i] = static_cast<int8_t>(((qs[i] & 15) | (((qh >> i) & 1) << 4)) - 16);
          o[16 + i] = static_cast<int8_t>(((qs[i] >> 4) | (((qh >> (16 + i)) & 1) << 4)) - 16);
        }
      }
  });
  return {out.data, out.scale};
}

// Super-blocks of `size` bytes -> int8 groups of 32 [rows, G, 32] with fp16
// scale absmax / 127 [rows, G] (quantize_int8_groups' rule, rounded half to
// even as torch.round), each super-block dequantized by dequant(block, y[256])
// first, in gguf's float operations and order.
template <typename Dequant>
std::vector<at::Tensor> k_quant_to_int8(const at::Tensor& raw, int64_t size, const char* what,
                                        const Dequant& dequant) {
  const int64_t nsb = check_blocks(raw, size, what), rows = raw.size(0);
  const int64_t G = nsb * 8;
  Int8Groups out(raw, rows, G);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  int8_t* dq = out.q;
  uint16_t* ds = out.d;
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    float y[kSuperBlock];
    for (int64_t r = r0; r < r1; r++)
      for (int64_t b = 0; b < nsb; b++) {
        dequant(src + r * raw.stride(0) + b * size, y);
        for (int g = 0; g < 8; g++) {
          const float* v = y + 32 * g;
          float amax = 0.f;
          for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(v[i]));
          const uint16_t h = to_half(amax / 127.0f);
          const float sg = std::max(half_to_float(h), 1e-30f);
          const int64_t gi = r * G + b * 8 + g;
          ds[gi] = h;
          for (int i = 0; i < 32; i++)
            dq[gi * 32 + i] = static_cast<int8_t>(
                std::min(127.f, std::max(-127.f, std::nearbyint(v[i] / sg))));
        }
      }
  });
  return {out.data, out.scale};
}

// Q6_K super-blocks (128 bytes of low nibbles, 64 of high 2-bit pairs, 16
// int8 scales of 16 values each, fp16 d): w = (d sc) (q - 32).
std::vector<at::Tensor> q6_k_to_int8(const at::Tensor& raw) {
  return k_quant_to_int8(raw, kQ6KBytes, "q6_k_to_int8", [](const uint8_t* blk, float* y) {
    const auto* sc = reinterpret_cast<const int8_t*>(blk + 192);
    uint16_t dh;
    std::memcpy(&dh, blk + 208, 2);
    const float d = half_to_float(dh);
    for (int half = 0; half < 2; half++) {  // 128 values each
      const uint8_t* l = blk + 64 * half;
      const uint8_t* h = blk + 128 + 32 * half;
      const int8_t* s = sc + 8 * half;
      float* o = y + 128 * half;
      for (int i = 0; i < 32; i++) {
        const int is = i / 16;
        const int q1 = ((l[i] & 15) | ((h[i] & 3) << 4)) - 32;
        const int q2 = ((l[i + 32] & 15) | (((h[i] >> 2) & 3) << 4)) - 32;
        const int q3 = ((l[i] >> 4) | (((h[i] >> 4) & 3) << 4)) - 32;
        const int q4 = ((l[i + 32] >> 4) | (((h[i] >> 6) & 3) << 4)) - 32;
        o[i] = d * static_cast<float>(s[is]) * static_cast<float>(q1);
        o[i + 32] = d * static_cast<float>(s[is + 2]) * static_cast<float>(q2);
        o[i + 64] = d * static_cast<float>(s[is + 4]) * static_cast<float>(q3);
        o[i + 96] = d * static_cast<float>(s[is + 6]) * static_cast<float>(q4);
      }
    }
  });
}

// Q5_K super-blocks (fp16 d, dmin; Q4_K's 12 bytes of scales and mins; 32
// bytes whose bit j is sub-block j's fifth bit; 128 bytes of nibbles as
// Q4_K's): w = (d sc) q - dmin m per sub-block of 32.
std::vector<at::Tensor> q5_k_to_int8(const at::Tensor& raw) {
  return k_quant_to_int8(raw, kQ5KBytes, "q5_k_to_int8", [](const uint8_t* blk, float* y) {
    uint16_t dh, mh;
    std::memcpy(&dh, blk, 2);
    std::memcpy(&mh, blk + 2, 2);
    const float d = half_to_float(dh), dmin = half_to_float(mh);
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + 48;
    for (int j = 0; j < 8; j++) {
      const float ds = d * static_cast<float>(k_scale(blk + 4, j));
      const float dm = dmin * static_cast<float>(k_min(blk + 4, j));
      const uint8_t* chunk = qs + 32 * (j / 2);
      for (int i = 0; i < 32; i++) {
        const int lo = j % 2 == 0 ? chunk[i] & 15 : chunk[i] >> 4;
        y[32 * j + i] = ds * static_cast<float>(lo | (((qh[i] >> j) & 1) << 4)) - dm;
      }
    }
  });
}

}  // namespace tandem
