// One matmul of the decode step, in any of tandem's CPU weight formats:
// dense fp32 (tandem::matvec), int8 W8A8 (VNNI tiles) or int4 (groups of 32).
// A thread computes a range of outputs from its own copy of the input rows,
// prepared once per input (int8: the quantized rows; int4: group sums).
#pragma once

#include "matvec.h"
#include "quant_linear.h"

namespace tandem {

enum class WeightKind : int64_t { kDense = 0, kInt8 = 1, kInt4 = 2 };

// A thread's input rows, prepared for the weight format.
struct StepInput {
  const float* x = nullptr;
  int64_t xs = 0, M = 0, kp = 0;
  std::vector<int8_t> q;      // int8: quantized rows [M, kp]
  std::vector<int32_t> qsum;  // int8: sums of each group of q [M, kp / 32]
  std::vector<float> aux;     // int8: group scales [M, kp / 32]; int4: group sums [M, K / 32]
};

struct StepMatmul {
  WeightKind kind;
  // dense: w [N, K] (a, b unused); int8: packed, w_scale, group scales (b, empty when
  // none); int4: packed, scale, lo.
  at::Tensor w, a, b;
  int64_t N, K;

  // Outputs of a thread's share come in whole units of this many.
  static int64_t unit(WeightKind kind) { return kind == WeightKind::kInt8 ? 16 : 4; }

  // Checks the tensors against an [N, K] matmul of this kind.
  void check(const char* name) const {
    bool ok = w.device().is_cpu() && w.is_contiguous();
    switch (kind) {
      case WeightKind::kDense:
        ok = ok && w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(0) == N &&
             w.size(1) == K;
        break;
      case WeightKind::kInt8: {
        const int64_t tiles = (N + 15) / 16, kp = (K + kInt8Group - 1) / kInt8Group * kInt8Group;
        ok = ok && w.scalar_type() == at::kByte && w.dim() == 4 && w.size(0) == tiles &&
             w.size(1) * 4 == kp && a.scalar_type() == at::kFloat && a.numel() == tiles * 16;
        if (ok) check_int8_group_scales(b, tiles, kp);
        break;
      }
      case WeightKind::kInt4:
        ok = ok && K % 32 == 0 && w.scalar_type() == at::kByte && w.dim() == 2 &&
             w.size(0) == N && w.size(1) == K / 2 && a.scalar_type() == at::kHalf &&
             b.scalar_type() == at::kHalf && a.numel() == N * K / 32 && b.numel() == N * K / 32 &&
             a.is_contiguous() && b.is_contiguous();
        break;
    }
    TORCH_CHECK(ok, "DecodeStep: ", name, " does not hold a ", N, " x ", K, " matmul of kind ",
                static_cast<int64_t>(kind));
  }

  // Prepares rows x [M, K] (stride xs) for this format into in.
  void prepare(const float* x, int64_t xs, int64_t M, StepInput& in) const {
    in.x = x;
    in.xs = xs;
    in.M = M;
    if (kind == WeightKind::kInt8) {
      in.kp = (K + kInt8Group - 1) / kInt8Group * kInt8Group;
      const int64_t G = in.kp / kInt8Group;
      in.q.assign(M * in.kp, 0);
      in.qsum.resize(M * G);
      in.aux.resize(M * G);
      for (int64_t m = 0; m < M; m++)
        int8_quantize_row(x + m * xs, K, in.q.data() + m * in.kp, in.aux.data() + m * G,
                          in.qsum.data() + m * G);
    } else if (kind == WeightKind::kInt4) {
      in.aux.resize(M * K / 32);
      for (int64_t m = 0; m < M; m++) int4_group_sums(x + m * xs, K, in.aux.data() + m * K / 32);
    }
  }

  // out[m, n] = in[m] . W[n] (+ bias[n]) (+ out[m, n] when accumulate) for n
  // in [n0, n1), which start on a unit (n1 too unless it is N). tmp: scratch.
  void apply(const StepInput& in, int64_t n0, int64_t n1, const float* bias, bool accumulate,
             float* out, int64_t os, std::vector<float>& tmp) const {
    if (n0 >= n1) return;
    switch (kind) {
      case WeightKind::kDense:
        matvec(w.data_ptr<float>(), K, in.x, in.xs, in.M, n0, n1, bias, accumulate, out, os);
        return;
      case WeightKind::kInt8:
        int8_tiles(in.q.data(), in.aux.data(), in.qsum.data(), in.kp, in.M, w.data_ptr<uint8_t>(),
                   a.data_ptr<float>(), b.numel() ? half_ptr(b) : nullptr, N, n0 / 16, (n1 + 15) / 16, bias, accumulate, out, os);
        return;
      case WeightKind::kInt4:
        tmp.resize(n1);
        for (int64_t m = 0; m < in.M; m++) {
          int4_gemv_rows(w.data_ptr<uint8_t>(), half_ptr(a), half_ptr(b), n0, n1, K,
                         in.x + m * in.xs, in.aux.data() + m * K / 32, tmp.data());
          float* o = out + m * os;
          for (int64_t n = n0; n < n1; n++) {
            const float v = tmp[n] + (bias ? bias[n] : 0.f);
            o[n] = accumulate ? o[n] + v : v;
          }
        }
        return;
    }
  }
};

}  // namespace tandem
