// Register fragments of the sm80 MMA: an accumulator read as the next product's A operand, type
// conversion, products with operands staged from shared memory through ldmatrix, and storing
// an fp32 accumulator tile to global memory.
#pragma once

#include "spec.cuh"

namespace flash_dmattn {

// Reinterpret an accumulator ((2,2), M, N) as the A operand ((2,2,2), M, N/2) of the next
// m16n8k16 product: two neighbouring n8 accumulator tiles hold exactly one k16 A fragment.
template <typename Layout>
__device__ __forceinline__ auto acc_as_a_layout(Layout acc) {
  auto n = logical_divide(get<2>(acc), Int<2>{});
  return make_layout(make_layout(get<0>(acc), get<0>(n)), get<1>(acc), get<1>(n));
}

template <typename To, typename TensorIn>
__device__ __forceinline__ auto to_type(TensorIn const& t) {
  auto out = make_tensor_like<To>(t);
  CUTE_UNROLL
  for (int i = 0; i < size(t); ++i) out(i) = To(t(i));
  return out;
}

// acc += A (smem) * B (smem)^T over the K dim, staging fragments through ldmatrix.
template <typename TiledMma, typename Acc, typename RA, typename RB, typename SA, typename SB,
          typename CopyA, typename CopyB>
__device__ __forceinline__ void gemm_ss(TiledMma& mma, Acc& acc, RA& rA, RB& rB, SA const& sA,
                                        SB const& sB, CopyA& copyA, CopyB& copyB, int tid) {
  auto thrA = copyA.get_thread_slice(tid);
  auto thrB = copyB.get_thread_slice(tid);
  Tensor tsA = thrA.partition_S(sA);
  Tensor trA = thrA.retile_D(rA);
  Tensor tsB = thrB.partition_S(sB);
  Tensor trB = thrB.retile_D(rB);
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    copy(copyA, tsA(_, _, k), trA(_, _, k));
    copy(copyB, tsB(_, _, k), trB(_, _, k));
    gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// acc += A (registers) * B (smem)^T.
template <typename TiledMma, typename Acc, typename RA, typename RB, typename SB, typename CopyB>
__device__ __forceinline__ void gemm_rs(TiledMma& mma, Acc& acc, RA const& rA, RB& rB,
                                        SB const& sB, CopyB& copyB, int tid) {
  auto thrB = copyB.get_thread_slice(tid);
  Tensor tsB = thrB.partition_S(sB);
  Tensor trB = thrB.retile_D(rB);
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    copy(copyB, tsB(_, _, k), trB(_, _, k));
    gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// Store an fp32 accumulator tile (rows from row0, `rows` valid, D valid columns) times `mul`
// into rows of `base` (row stride in elements). Columns come in even pairs and D is a multiple
// of 8, so each pair is in range and stored as one 4-byte word.
template <typename Acc, typename Coord>
__device__ __forceinline__ void store_rows(Elem* base, int64_t row_stride, int row0, int rows,
                                           int D, float mul, Acc const& acc, Coord const& c) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<1>(acc); ++mi) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + get<0>(c(half * 2, mi, 0));
      if (row >= rows) continue;
      Elem* drow = base + int64_t(row) * row_stride;
      CUTE_UNROLL
      for (int ni = 0; ni < size<2>(acc); ++ni) {
        const int col = get<1>(c(half * 2, mi, ni));
        if (col < D) {
          __align__(4) Elem pair[2] = {Elem(acc(half * 2, mi, ni) * mul),
                                       Elem(acc(half * 2 + 1, mi, ni) * mul)};
          *reinterpret_cast<uint32_t*>(drow + col) = *reinterpret_cast<uint32_t*>(pair);
        }
      }
    }
  }
}

}  // namespace flash_dmattn
