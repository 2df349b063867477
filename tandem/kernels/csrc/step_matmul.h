// One matmul of the decode step, in any of tandem's CPU weight formats:
// dense fp32 (tandem::matvec), or int8 / int4 tiles (quant_linear.h).
// A thread computes a range of outputs from its own copy of the input rows,
// prepared once per input (quantized for the tile kernel).
#pragma once

#include "matvec.h"
#include "quant_linear.h"

namespace tandem {

// Python's tandem.model.linear.WeightKind (the same numbers).
enum class WeightKind : int64_t { kDense = 0, kInt8 = 1, kInt4 = 2 };

// A thread's input rows, prepared for the weight format.
struct StepInput {
  const float* x = nullptr;
  int64_t xs = 0, M = 0;
  QuantizedRows rows;  // int8 / int4: x quantized per group of 32
};

struct StepMatmul {
  WeightKind kind;
  // dense: w [N, K] (a, b unused); int8: packed, w_scale, group scales (b, empty when
  // none); int4: packed, with its scales and lo or none (a, b empty).
  at::Tensor w, a, b;
  int64_t N, K;

  // Outputs of a thread's share come in whole units of this many (a tile).
  static int64_t unit(WeightKind kind) { return kind == WeightKind::kDense ? 4 : 16; }

  // Checks the tensors against an [N, K] matmul of this kind.
  void check(const char* name) const {
    if (kind != WeightKind::kDense) return check_tiles(kind == WeightKind::kInt4, w, a, b, N, K, name);
    TORCH_CHECK(w.device().is_cpu() && w.is_contiguous() && w.scalar_type() == at::kFloat &&
                    w.dim() == 2 && w.size(0) == N && w.size(1) == K,
                "DecodeStep: ", name, " does not hold a dense float32 ", N, " x ", K, " matmul");
  }

  // Prepares rows x [M, K] (stride xs) for this format into in.
  void prepare(const float* x, int64_t xs, int64_t M, StepInput& in) const {
    in.x = x;
    in.xs = xs;
    in.M = M;
    if (kind != WeightKind::kDense) in.rows.quantize(x, xs, M, K, false);
  }

  // out[m, n] = in[m] . W[n] (+ bias[n]) (+ out[m, n] when accumulate) for n
  // in [n0, n1), which start on a unit (n1 too unless it is N).
  void apply(const StepInput& in, int64_t n0, int64_t n1, const float* bias, bool accumulate,
             float* out, int64_t os) const {
    if (n0 >= n1) return;
    if (kind == WeightKind::kDense) {
      matvec(w.data_ptr<float>(), K, in.x, in.xs, in.M, n0, n1, bias, accumulate, out, os);
      return;
    }
    in.rows.apply(tile_weight(kind == WeightKind::kInt4, w, a, b, N), n0 / 16, (n1 + 15) / 16,
                  bias, accumulate, out, os);
  }
};

}  // namespace tandem
