// Packing quantized weights into quant_linear.h's tiles, in place.
//
// The sources are strided views: a GGUF's blocks as they lie in the file
// (Q8_0's 34-byte blocks are a view of 32 quants and a view of one fp16 scale
// over the same bytes), or tandem's own quantizers' arrays. Each call packs
// the rows of one part at a row offset of the tile buffer, so a fused matmul
// (Q/K/V, gate/up) is packed part by part, straight from the file's pages:
// no decoded copy, no concatenated copy, no transposed copy: the three numpy /
// torch passes that dominated an 8B Q8_0 load.
#pragma once

#include "quant_linear.h"

namespace tandem {

namespace {

// Checks that a part of n rows at row0, writing `bytes` at `offset` of each
// group, fits the tiles dest [tiles, G, GB].
void check_part(const at::Tensor& dest, int64_t n, int64_t groups, int64_t row0,
                int64_t bytes, int64_t offset, const char* what) {
  TORCH_CHECK(dest.device().is_cpu() && dest.scalar_type() == at::kByte && dest.dim() == 3 &&
                  dest.is_contiguous(),
              what, ": dest must be contiguous uint8 tiles [tiles, G, group bytes]");
  TORCH_CHECK(groups == dest.size(1), what, ": the source has ", groups,
              " groups a row, the tiles ", dest.size(1));
  TORCH_CHECK(row0 >= 0 && row0 + n <= dest.size(0) * 16, what, ": rows ", row0, "..",
              row0 + n, " are outside the tiles' ", dest.size(0) * 16);
  TORCH_CHECK(offset >= 0 && offset + bytes <= dest.size(2), what, ": ", bytes,
              " bytes at offset ", offset, " do not fit a group's ", dest.size(2));
}

// Runs f(tile, first row, end row) over the tiles rows [row0, row0 + n) touch
// (rows in tile coordinates); each tile is one thread's, so writes never race.
template <typename F>
void for_part_tiles(int64_t row0, int64_t n, const F& f) {
  if (n == 0) return;
  const int64_t t0 = row0 / 16, t1 = (row0 + n + 15) / 16;
  at::parallel_for(t0, t1, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; t++)
      f(t, std::max(row0, t * 16), std::min(row0 + n, t * 16 + 16));
  });
}

}  // namespace

// src [n, G, B] uint8 (bytes of a group contiguous, B a multiple of 4; any
// other strides) -> rows row0 .. row0 + n - 1 of dest [tiles, G, GB]: bytes
// 4c .. 4c + 3 of row r's group g, XORed with flip, land at byte 64 c +
// 4 (r % 16) of tile r / 16's group g (int8: dest is packed [tiles, kp / 4,
// 16, 4] seen as [tiles, G, 512]; int4: the nibble bytes of [tiles, G, GB]).
void pack_tile_bytes(at::Tensor dest, const at::Tensor& src, int64_t row0, int64_t flip) {
  TORCH_CHECK(src.device().is_cpu() && (src.scalar_type() == at::kByte ||
                                        src.scalar_type() == at::kChar) &&
                  src.dim() == 3 && src.stride(2) == 1 && src.size(2) % 4 == 0,
              "pack_tile_bytes: src must be int8 / uint8 [rows, groups, bytes] with "
              "contiguous groups of a multiple of 4 bytes");
  TORCH_CHECK(flip >= 0 && flip < 256, "pack_tile_bytes: flip is a byte");
  const int64_t n = src.size(0), G = src.size(1), chunks = src.size(2) / 4;
  check_part(dest, n, G, row0, chunks * 64, 0, "pack_tile_bytes");
  const int64_t s0 = src.stride(0), s1 = src.stride(1), GB = dest.size(2);
  const auto* s = static_cast<const uint8_t*>(src.data_ptr());
  uint8_t* d = dest.data_ptr<uint8_t>();
  const uint32_t f = static_cast<uint32_t>(flip) * 0x01010101u;
  for_part_tiles(row0, n, [&](int64_t t, int64_t r0, int64_t r1) {
    for (int64_t g = 0; g < G; g++) {
      uint8_t* dg = d + (t * G + g) * GB;
      for (int64_t c = 0; c < chunks; c++)
        for (int64_t r = r0; r < r1; r++) {
          uint32_t v;
          std::memcpy(&v, s + (r - row0) * s0 + g * s1 + 4 * c, 4);
          v ^= f;
          std::memcpy(dg + 64 * c + 4 * (r % 16), &v, 4);
        }
    }
  });
}

// src fp16 [n, G] (any strides) -> rows row0 .. row0 + n - 1 of dest [tiles,
// G, GB] uint8: row r's value of group g at byte offset + 2 (r % 16) of tile
// r / 16's group g (int8's group scales: [tiles, G, 16] fp16 seen as bytes,
// offset 0; int4's scales and lo: offsets 256 and 288).
void pack_tile_halves(at::Tensor dest, const at::Tensor& src, int64_t row0, int64_t offset) {
  TORCH_CHECK(src.device().is_cpu() && src.scalar_type() == at::kHalf && src.dim() == 2,
              "pack_tile_halves: src must be float16 [rows, groups]");
  TORCH_CHECK(offset % 2 == 0, "pack_tile_halves: offset must be even");
  const int64_t n = src.size(0), G = src.size(1);
  check_part(dest, n, G, row0, 32, offset, "pack_tile_halves");
  const int64_t s0 = src.stride(0), s1 = src.stride(1), GB = dest.size(2);
  const uint16_t* s = half_ptr(src);
  uint8_t* d = dest.data_ptr<uint8_t>();
  for_part_tiles(row0, n, [&](int64_t t, int64_t r0, int64_t r1) {
    for (int64_t g = 0; g < G; g++) {
      uint8_t* dg = d + (t * G + g) * GB + offset;
      for (int64_t r = r0; r < r1; r++)
        std::memcpy(dg + 2 * (r % 16), s + (r - row0) * s0 + g * s1, 2);
    }
  });
}

}  // namespace tandem
