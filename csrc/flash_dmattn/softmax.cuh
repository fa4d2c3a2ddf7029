// Scores and the online softmax of the sm80 forward and decode kernels: scaling and softcap of a
// raw product, quad (4-lane) reductions, and one step of the running max / sum update.
#pragma once

#include "params.h"
#include "spec.cuh"

namespace flash_dmattn {

// Scores of one tile, in natural-log units, for element (row r, col c) of the MMA tile whose
// query is qi and key kj. Returns -inf where invisible; `dtanh` gets 1 - tanh^2 (softcap).
template <bool kSoftcap>
__device__ __forceinline__ float score(float acc, const FwdParams& p, float& dtanh) {
  if constexpr (kSoftcap) {
    const float t = tanhf(acc * (p.scale / p.softcap));
    dtanh = 1.f - t * t;
    return p.softcap * t;
  } else {
    dtanh = 1.f;
    return acc * p.scale;
  }
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// The running softmax state of a thread's rows before the first key: max -inf, sum 0.
template <int kRows>
__device__ __forceinline__ void init_row_state(float (&row_max)[kRows], float (&row_sum)[kRows]) {
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.f;
  }
}

// One online-softmax step of the sm80 forward and decode kernels over a score tile acc_s
// ((2, 2), M, N fragments, natural-log units, invisible scores -inf): per thread row slot
// r = mi * 2 + v / 2, update the running max and (thread-partial, quad-reduced by the caller at
// the end) sum, rescale the output accumulator and replace the scores by exp(s - max). A row
// with nothing visible yet keeps max -inf and gets p = 0 (base 0 avoids inf - inf).
template <typename AccS, typename AccO, int kRows>
__device__ __forceinline__ void online_softmax_step(AccS& acc_s, AccO& acc_o,
                                                    float (&row_max)[kRows],
                                                    float (&row_sum)[kRows]) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<1>(acc_s); ++mi) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int r = mi * 2 + half;
      float mx = row_max[r];
      CUTE_UNROLL
      for (int ni = 0; ni < size<2>(acc_s); ++ni) {
        mx = fmaxf(mx, fmaxf(acc_s(half * 2, mi, ni), acc_s(half * 2 + 1, mi, ni)));
      }
      mx = quad_max(mx);
      const float base = mx == -INFINITY ? 0.f : mx * kLog2e;
      const float alpha = exp2f(row_max[r] * kLog2e - base);
      row_max[r] = mx;
      float sum = 0.f;
      CUTE_UNROLL
      for (int ni = 0; ni < size<2>(acc_s); ++ni) {
        CUTE_UNROLL
        for (int j = 0; j < 2; ++j) {
          const float pv = exp2f(acc_s(half * 2 + j, mi, ni) * kLog2e - base);
          acc_s(half * 2 + j, mi, ni) = pv;
          sum += pv;
        }
      }
      row_sum[r] = row_sum[r] * alpha + sum;
      CUTE_UNROLL
      for (int ni = 0; ni < size<2>(acc_o); ++ni) {
        acc_o(half * 2, mi, ni) *= alpha;
        acc_o(half * 2 + 1, mi, ni) *= alpha;
      }
    }
  }
}

}  // namespace flash_dmattn
