// Warpgroup-MMA (wgmma, sm_90a) helpers shared by the Hopper forward and backward kernels:
// issuing / waiting for batches of GMMAs through CuTe, the async-proxy fence cp.async writes need
// before a GMMA reads them, and reading an accumulator as the register A operand of the next
// product.
#pragma once
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include "kernel_common.cuh"

namespace flash_dmattn {

// Shared-memory writes by this thread (cp.async data, zero fill) become visible to the
// tensor cores' async proxy; pair with a barrier.
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Barrier `id` (1..15; 0 is __syncthreads) over `threads` threads, e.g. one warpgroup.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Arrive on barrier `id` without waiting (the threads that named_barrier_sync it wait).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// dst[0, bytes / 4) += src[...] (fp32) as one bulk asynchronous reduction from shared to global
// memory (sm_90; 16-byte aligned, bytes a multiple of 16), committed as its own bulk group.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, int bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(src));
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
      "cp.async.bulk.commit_group;\n" ::"l"(dst),
      "r"(s), "r"(bytes)
      : "memory");
}
// Wait until at most kPending of this thread's bulk groups still read their shared source...
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// ...or are still incomplete (their global writes included).
template <int kPending>
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Issue acc (+)= A * B over the K mode as one batch of warpgroup MMAs (no wait). `zero` starts
// from zero instead of accumulating; kRegA: A is a register fragment (else smem descriptors),
// whose registers must stay untouched until the batch is waited for.
template <bool kRegA, typename TiledMma, typename TA, typename TB, typename TC>
__device__ __forceinline__ void wgmma_issue(TiledMma& mma, TA& a, TB const& b, TC& c, bool zero) {
  if constexpr (kRegA) warpgroup_fence_operand(a);
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = zero ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// Wait until at most kPending of this warpgroup's batches are in flight; `c` (the accumulator
// of a finished batch) is then safe to read.
template <int kPending, typename TC>
__device__ __forceinline__ void wgmma_wait(TC& c) {
  warpgroup_wait<kPending>();
  warpgroup_fence_operand(c);
}

template <bool kRegA, typename TiledMma, typename TA, typename TB, typename TC>
__device__ __forceinline__ void wgmma_gemm(TiledMma& mma, TA& a, TB const& b, TC& c, bool zero) {
  wgmma_issue<kRegA>(mma, a, b, c, zero);
  wgmma_wait<0>(c);
  if constexpr (kRegA) warpgroup_fence_operand(a);
}

// An m64nN accumulator ((2, 2, N/8), M, 1) read as the A operand ((2, 2, 2), M, N/16) of the
// next product: value (c, r, 2 k + j) of the accumulator is value (c, r, j) of k-block k.
template <typename Layout>
__device__ __forceinline__ auto acc_as_gmma_a_layout(Layout acc) {
  auto groups = logical_divide(get<0, 2>(acc), Int<2>{});
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0>(groups)), get<1>(acc),
                     get<1>(groups));
}

// Swizzled GMMA tile layouts for operands of kHeadDim columns: the widest swizzle whose 8-row
// atom tiles the head dim (128-byte rows for 64, 128, 192, 256; 64-byte rows for 32 and 96).
template <int kHeadDim>
struct GmmaTiles {
  using Atom = std::conditional_t<kHeadDim % 64 == 0, GMMA::Layout_K_SW128_Atom<Elem>,
                                  GMMA::Layout_K_SW64_Atom<Elem>>;
  static constexpr int kAtomK = kHeadDim % 64 == 0 ? 64 : 32;
  // R rows x kHeadDim, K-major (the layout load_tile_swizzled writes).
  template <int R>
  using Rows = decltype(tile_to_shape(Atom{}, Shape<Int<R>, Int<kHeadDim>>{}));
  // The same tile read as its transpose (kHeadDim x R): an MN-major B operand.
  template <int R>
  using RowsT = decltype(composition(
      Rows<R>{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<R>>{}, Step<_2, _1>{})));
};

// Launch order of the Hopper kernels with one CTA per (query tile, b, h). The heaviest query
// tiles (the last ones, under causal masking) go first, so the final wave is made of short
// CTAs. With GQA the query heads of one tile are launched next to each other, so the heads of
// a group read their shared K / V and mask / bias tiles while these are in L2; without GQA,
// query tiles vary fastest (both a few percent faster than the head-major order).
struct QTileCoord {
  int m_block, b, h;
};
inline dim3 q_tile_grid(int m_blocks, int B, int H, int Hkv) {
  return H > Hkv ? dim3(m_blocks * H, B) : dim3(m_blocks, B * H);
}
__device__ __forceinline__ QTileCoord q_tile_coord(int H, int Hkv) {
  if (H > Hkv) {
    const int m_blocks = gridDim.x / H;
    return {m_blocks - 1 - int(blockIdx.x) / H, int(blockIdx.y), int(blockIdx.x) % H};
  }
  return {int(gridDim.x - 1 - blockIdx.x), int(blockIdx.y) / H, int(blockIdx.y) % H};
}

// Item t of a forward's (query tile, batch, head) items, in q_tile_grid's block order: the
// query heads of a kv head next to each other when H > Hkv, else the tiles of one head; query
// tiles last to first.
__device__ __forceinline__ QTileCoord q_tile_coord_at(int t, int m_blocks, int H, int Hkv) {
  if (H > Hkv) {
    const int per_b = m_blocks * H;
    const int b = t / per_b, r = t - b * per_b;
    return {m_blocks - 1 - r / H, b, r % H};
  }
  const int bh = t / m_blocks;
  return {m_blocks - 1 - (t - bh * m_blocks), bh / H, bh % H};
}

// Store a warpgroup's m64 fp32 accumulator (its value (c, r, g) is row 8 r + lane / 4 (+ 16 per
// warp), column 8 g + 2 (lane % 4) + c, as `coord` gives them) times `mul` into rows row0 + row of
// `base` (row stride in elements), rows < `rows` and columns < D only. A thread's columns come in
// even pairs and D is a multiple of 8, so each pair is stored as one 4-byte word.
template <typename Acc, typename Coord>
__device__ __forceinline__ void store_wg_rows(Elem* base, int64_t row_stride, int row0, int rows,
                                              int D, float mul, Acc const& acc, Coord const& coord) {
  constexpr int kGroups = decltype(size<0, 2>(acc))::value;
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + get<0>(coord(make_coord(0, r, 0), 0, 0));
    if (row >= rows) continue;
    Elem* drow = base + int64_t(row) * row_stride;
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      const int col = get<1>(coord(make_coord(0, r, g), 0, 0));
      if (col < D) {
        __align__(4) Elem pair[2] = {Elem(acc(make_coord(0, r, g), 0, 0) * mul),
                                     Elem(acc(make_coord(1, r, g), 0, 0) * mul)};
        *reinterpret_cast<uint32_t*>(drow + col) = *reinterpret_cast<uint32_t*>(pair);
      }
    }
  }
}

// lse and delta of a thread's two accumulator rows (row0 + the row of value (0, r, 0)) for a
// backward's P = exp(S - lse), dS = P (dP - delta): rows past Lq and fully masked rows (lse
// -inf) get lse = +inf, so P = 0 without a NaN.
template <typename Coord>
__device__ __forceinline__ void load_row_stats(const float* lse, const float* delta, int row0,
                                               int Lq, Coord const& coord, float (&row_lse)[2],
                                               float (&row_delta)[2]) {
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int qi = row0 + get<0>(coord(make_coord(make_coord(0, r, 0), 0, 0)));
    const float l = qi < Lq ? lse[qi] : INFINITY;
    row_lse[r] = l == -INFINITY ? INFINITY : l;
    row_delta[r] = qi < Lq ? delta[qi] : 0.f;
  }
}

}  // namespace flash_dmattn
