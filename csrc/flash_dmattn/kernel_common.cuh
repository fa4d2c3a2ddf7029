// Building blocks shared by the forward and backward kernels: tile shapes and CuTe layouts,
// predicated global->shared copies, the mask / bias tile loader, and small fragment helpers.
//
// Design (sm80 instructions, so it runs on Ampere, Ada and Hopper): each CTA owns one tile of
// rows (queries in the forward and dQ kernels, keys in the dK/dV kernel) and walks the live
// tiles of the other side. Q/K/V tiles are staged in swizzled shared memory with cp.async, the
// products use mma.sync m16n8k16 through a CuTe TiledMMA with warps stacked along the rows, and
// the mask / bias tile of a live, partial tile is copied asynchronously next to the K or V tile
// so its latency hides behind the first matrix product. The Hopper forward (flash_fwd_sm90.cu)
// keeps this structure and these loaders but runs its products on warpgroup MMAs.
#pragma once

#include <climits>
#include <cuda_runtime.h>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>
#include <cutlass/numeric_conversion.h>

#include "params.h"

namespace flash_dmattn {

using namespace cute;

constexpr int kHeadDimBucket = FLASH_DMATTN_HEADDIM;
constexpr bool kHasMask = FLASH_DMATTN_HAS_MASK;
constexpr bool kHasBias = FLASH_DMATTN_HAS_BIAS;
constexpr bool kPacked = FLASH_DMATTN_PACKED;
#if FLASH_DMATTN_IS_BF16
using Elem = cutlass::bfloat16_t;
#else
using Elem = cutlass::half_t;
#endif

constexpr float kLog2e = 1.4426950408889634f;

// Shared-memory layouts and copies for a tile of `Rows` x `kHeadDim` elements and the MMA
// with `WarpsM` x `WarpsN` warps.
template <int kHeadDim_, int kRows_, int kCols_, int kWarpsM_, int kWarpsN_>
struct Traits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kRows = kRows_;  // rows owned by the CTA (MMA M)
  static constexpr int kCols = kCols_;  // columns walked per step (MMA N of the score tile)
  static constexpr int kWarpsM = kWarpsM_;
  static constexpr int kWarpsN = kWarpsN_;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;

  using MmaAtom = std::conditional_t<std::is_same_v<Elem, cutlass::half_t>,
                                     MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>,
                                     MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;
  using TiledMma = TiledMMA<MmaAtom, Layout<Shape<Int<kWarpsM>, Int<kWarpsN>, _1>>,
                            Tile<Int<16 * kWarpsM>, Int<16 * kWarpsN>, _16>>;

  // 64-element (128-byte) rows of the swizzle atom when the head dim allows, else 32.
  static constexpr int kSmemK = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzle = kSmemK == 32 ? 2 : 3;
  using SmemAtom = decltype(composition(
      Swizzle<kSwizzle, 3, 3>{}, Layout<Shape<_8, Int<kSmemK>>, Stride<Int<kSmemK>, _1>>{}));
  template <int R>
  using SmemTile = decltype(tile_to_shape(SmemAtom{}, Shape<Int<R>, Int<kHeadDim>>{}));
  // The same tile read as its transpose (kHeadDim x R): the B operand of P.V, dS.K, dS^T.Q.
  template <int R>
  using SmemTileT = decltype(composition(
      SmemTile<R>{}, make_layout(Shape<Int<kHeadDim>, Int<R>>{}, GenRowMajor{})));
  template <int R>
  using SmemTileTNoSwizzle = decltype(get_nonswizzle_portion(SmemTileT<R>{}));

  using LdsmA = Copy_Atom<SM75_U32x4_LDSM_N, Elem>;
  using LdsmB = Copy_Atom<SM75_U32x4_LDSM_N, Elem>;
  using LdsmBT = Copy_Atom<SM75_U16x8_LDSM_T, Elem>;
};

// ---------------------------------------------------------------------------------------------
// Global -> shared copies
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_bytes));
}

// Copy a (R x kHeadDim) tile whose rows start at `gptr` (row stride in elements) into shared
// memory laid out as tile_to_shape(8 x kAtomK swizzled atom, (R, kHeadDim)) -- the sm80
// SmemTile of Traits and the GMMA K-major layouts of the Hopper kernel alike -- zero-filling
// rows >= rows_valid and columns >= cols_valid (a multiple of 8).
//
// The layout is written out here rather than through CuTe's partitioned copies, which
// recompute the address and swizzle of every 16-byte chunk (about 20 instructions each, plus a
// separate zero-fill path): a thread's chunks lie at one per-thread offset plus compile-time
// strides, and the swizzle only depends on the row within the 8-row atom, the same for all of
// them. Byte offset of (row r, 16-byte chunk c of column block b):
//   b * R * kRowBytes + (r / 8) * 8 * kRowBytes + (r % 8) * kRowBytes + ((c ^ f(r % 8)) * 16)
// with kRowBytes = 128, f = identity (128-byte swizzle) or 64, f = r % 8 / 2 (64-byte).
// kRolled: one chunk at a time with a running source pointer, for the producer warpgroups of
// the warp-specialised kernels, which run on 24 registers: unrolled, the compiler keeps every
// chunk's 64-bit address live (hoisted out of the step loop) and spills them -- and with almost
// all of L1 given to shared memory the spills go to L2, on the producer's critical path.
template <int kHeadDim, int kAtomK, int kThreads, int R, bool kRolled = false>
__device__ __forceinline__ void load_tile_swizzled(const Elem* gptr, int64_t row_stride,
                                                   int rows_valid, int cols_valid, char* smem,
                                                   int tid) {
  constexpr int kRowBytes = kAtomK * 2;
  constexpr int kChunksPerRow = kRowBytes / 16;  // per column block
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  constexpr int kPasses = R / kRowsPerPass;
  constexpr int kBlocks = kHeadDim / kAtomK;
  static_assert(kAtomK == 64 || kAtomK == 32, "128- or 64-byte swizzle rows");
  static_assert(R % kRowsPerPass == 0 && kRowsPerPass % 8 == 0, "tile rows");
  const int r0 = tid / kChunksPerRow, c = tid % kChunksPerRow;
  const int swz = kRowBytes == 128 ? (r0 % 8) : ((r0 % 8) >> 1);
  char* s0 = smem + (r0 / 8) * 8 * kRowBytes + (r0 % 8) * kRowBytes + ((c ^ swz) * 16);
  const Elem* g0 = gptr + int64_t(r0) * row_stride + c * 8;
  if constexpr (kRolled) {
    const int64_t pass_stride = int64_t(kRowsPerPass) * row_stride;
#pragma unroll 1
    for (int j = 0; j < kPasses; ++j) {
      const bool row_ok = r0 + j * kRowsPerPass < rows_valid;
      CUTE_UNROLL
      for (int b = 0; b < kBlocks; ++b) {
        const bool ok = row_ok && b * kAtomK + c * 8 < cols_valid;
        cp_async_16(s0 + b * R * kRowBytes, ok ? g0 + b * kAtomK : gptr, ok ? 16 : 0);
      }
      s0 += kRowsPerPass * kRowBytes;
      g0 += pass_stride;
    }
    return;
  }
  CUTE_UNROLL
  for (int b = 0; b < kBlocks; ++b) {
    const bool col_ok = b * kAtomK + c * 8 < cols_valid;
    CUTE_UNROLL
    for (int j = 0; j < kPasses; ++j) {
      const bool ok = col_ok && r0 + j * kRowsPerPass < rows_valid;
      const Elem* src = g0 + int64_t(j * kRowsPerPass) * row_stride + b * kAtomK;
      cp_async_16(s0 + b * R * kRowBytes + j * kRowsPerPass * kRowBytes, ok ? src : gptr,
                  ok ? 16 : 0);
    }
  }
}

// The key indices of the rows a thread copies in load_rows_by_index (kPasses of them, -1 past
// the list). The producers read them a step ahead of the copies that use them, so the global
// loads' latency is off their critical path (they are synchronous loads: an address needs them).
template <int kAtomK, int kThreads, int R>
struct RowIndices {
  static constexpr int kChunksPerRow = kAtomK * 2 / 16;
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static constexpr int kPasses = R / kRowsPerPass;
  static_assert(R % kRowsPerPass == 0 && kRowsPerPass % 8 == 0, "tile rows");
  int idx[kPasses];

  // Rows r >= rows_valid of the tile get -1 (zero-filled, their index not read).
  __device__ __forceinline__ void fetch(const int32_t* keys, int rows_valid, int tid) {
    const int r0 = tid / kChunksPerRow;
    CUTE_UNROLL
    for (int j = 0; j < kPasses; ++j) {
      const int r = r0 + j * kRowsPerPass;
      idx[j] = r < rows_valid ? keys[r] : -1;
    }
  }
};

// load_tile_swizzled with the tile's rows taken by index: tile row r is row rows.idx of `base`
// (row stride in elements), fetched beforehand (RowIndices::fetch); rows with index -1 are
// zero-filled. (The decode kernel's load_tile_rows reads each row's index just before its
// copies; with that order the gathered forward was about 10 % slower.)
template <int kHeadDim, int kAtomK, int kThreads, int R>
__device__ __forceinline__ void load_rows_by_index(const Elem* base, int64_t row_stride,
                                                   const RowIndices<kAtomK, kThreads, R>& rows,
                                                   int cols_valid, char* smem, int tid) {
  using Ri = RowIndices<kAtomK, kThreads, R>;
  constexpr int kRowBytes = kAtomK * 2;
  constexpr int kBlocks = kHeadDim / kAtomK;
  const int r0 = tid / Ri::kChunksPerRow, c = tid % Ri::kChunksPerRow;
  const int swz = kRowBytes == 128 ? (r0 % 8) : ((r0 % 8) >> 1);
  char* s0 = smem + (r0 / 8) * 8 * kRowBytes + (r0 % 8) * kRowBytes + ((c ^ swz) * 16);
  CUTE_UNROLL
  for (int j = 0; j < Ri::kPasses; ++j) {
    const bool row_ok = rows.idx[j] >= 0;
    const Elem* src = base + int64_t(row_ok ? rows.idx[j] : 0) * row_stride + c * 8;
    CUTE_UNROLL
    for (int b = 0; b < kBlocks; ++b) {
      const bool ok = row_ok && b * kAtomK + c * 8 < cols_valid;
      cp_async_16(s0 + b * R * kRowBytes + j * Ri::kRowsPerPass * kRowBytes,
                  ok ? src + b * kAtomK : base, ok ? 16 : 0);
    }
  }
}

// load_tile_swizzled into a Traits SmemTile<R> tensor.
template <typename Tr, int R, typename SmemTensor>
__device__ __forceinline__ void load_rows(const Elem* gptr, int64_t row_stride, int rows_valid,
                                          int cols_valid, SmemTensor& s, int tid) {
  load_tile_swizzled<Tr::kHeadDim, Tr::kSmemK, Tr::kThreads, R>(
      gptr, row_stride, rows_valid, cols_valid,
      reinterpret_cast<char*>(raw_pointer_cast(s.data())), tid);
}

__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, int src_bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_8(void* smem, const void* gmem, int src_bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_bytes));
}

// kN floats of a row vector (lse, delta) at [i0, i0 + kN), zero beyond `valid`.
template <int kN>
__device__ __forceinline__ void load_floats(float* smem, const float* g, int valid, int tid,
                                            int nthreads) {
  for (int i = tid; i < kN; i += nthreads) {
    cp_async_4(smem + i, i < valid ? g + i : g, i < valid ? 4 : 0);
  }
}

// One tile of a broadcastable (B, H, Lq, Lk) operand: kTileQ x kTileK elements of `T` at
// (q0, k0), stored row-major in shared memory with a padded row (kPitch bytes) so that the
// eight rows an MMA fragment touches fall in different banks. A tensor broadcast over queries
// (sq == 0) is loaded as a single row and read back with row index 0. Out-of-range elements
// read as 0 (mask False / bias 0); callers bound-check the key range separately.
template <typename T, int kTileQ, int kTileK, int kThreads>
struct BcastTile {
  static constexpr int kPitch = kTileK * int(sizeof(T)) + 16;
  static constexpr int kBytes = kTileQ * kPitch;

  // kRolled: no unrolling (the 24-register producer warpgroups; see load_tile_swizzled).
  template <bool kRolled = false>
  __device__ static void load(char* smem, const Bcast& p, const char* base, int q0, int k0,
                              int Lq, int Lk, int tid) {
    const int rows = p.sq == 0 ? 1 : min(kTileQ, Lq - q0);
    const int cols = min(kTileK, Lk - k0);
    const char* g = base + (int64_t(q0) * p.sq + int64_t(k0) * p.sk) * int64_t(sizeof(T));
    if (p.vec) {
      constexpr int kChunks = kTileK * int(sizeof(T)) / 16;
      const int total = rows * kChunks;
#pragma unroll(kRolled ? 1 : 4)
      for (int c = tid; c < total; c += kThreads) {
        const int r = c / kChunks, ch = c % kChunks;
        const int valid = max(0, min(16, (cols * int(sizeof(T))) - ch * 16));
        const char* src = g + int64_t(r) * p.sq * int64_t(sizeof(T)) + ch * 16;
        cp_async_16(smem + r * kPitch + ch * 16, valid > 0 ? src : base, valid);
      }
    } else {
      const T* gt = reinterpret_cast<const T*>(g);
#pragma unroll(kRolled ? 1 : 4)
      for (int e = tid; e < rows * kTileK; e += kThreads) {
        const int r = e / kTileK, c = e % kTileK;
        T val = T(0);
        if (c < cols) val = gt[int64_t(r) * p.sq + int64_t(c) * p.sk];
        *reinterpret_cast<T*>(smem + r * kPitch + c * int(sizeof(T))) = val;
      }
    }
  }

  __device__ static T read(const char* smem, bool per_query, int r, int c) {
    return *reinterpret_cast<const T*>(smem + (per_query ? r : 0) * kPitch + c * int(sizeof(T)));
  }

  // Elements (r, c) and (r, c + 1), c even (rows start 16-byte aligned, so the pair is aligned):
  // the raw 2 x sizeof(T) bytes as an integer (masks) or as two floats (biases).
  __device__ static auto read_pair(const char* smem, int r, int c) {
    const char* at = smem + r * kPitch + c * int(sizeof(T));
    if constexpr (sizeof(T) == 1) {
      return uint32_t(*reinterpret_cast<const uint16_t*>(at));
    } else {
      __align__(4) T two[2];
      *reinterpret_cast<uint32_t*>(two) = *reinterpret_cast<const uint32_t*>(at);
      return make_float2(float(two[0]), float(two[1]));
    }
  }
};

// Base pointer (as bytes) of the (b, h) slice of a broadcastable operand whose keys start at
// packed key row k_row0 (0 for dense calls).
template <typename T>
__device__ __forceinline__ const char* bcast_base(const Bcast& p, int b, int h,
                                                  int64_t k_row0) {
  return reinterpret_cast<const char*>(p.ptr) +
         (int64_t(b) * p.sb + int64_t(h / p.hdiv) * p.sh + k_row0 * p.sk) * int64_t(sizeof(T));
}

// Where batch entry b's rows are. Dense calls index batches by their strides: no row offset,
// the call's lengths. Packed (varlen) calls have batch strides 0 and take sequence b's first
// rows and lengths from cu_q / cu_k.
struct SeqRows {
  int64_t q_row0, k_row0;
  int64_t aux_row0;  // first key in the mask / bias
  int Lq, Lk;
};

__device__ __forceinline__ SeqRows seq_rows(const FwdParams& p, int b) {
  if constexpr (!kPacked) return {0, 0, 0, p.Lq, p.Lk};
  const int qs = p.cu_q[b], ks = p.cu_k[b];
  return {qs, ks, p.cu_aux != nullptr ? p.cu_aux[b] : ks, p.cu_q[b + 1] - qs, p.cu_k[b + 1] - ks};
}

// The sequence's lengths. Kernels call these where the length is used rather than copying it
// into a local: a dense call then reads the kernel parameter in place, which ptxas keeps in
// uniform registers; a local copy made it per-thread (a slower forward and Hopper dK/dV).
__device__ __forceinline__ int seq_lq(const FwdParams& p, const SeqRows& s) {
  if constexpr (kPacked) return s.Lq;
  return p.Lq;
}
__device__ __forceinline__ int seq_lk(const FwdParams& p, const SeqRows& s) {
  if constexpr (kPacked) return s.Lk;
  return p.Lk;
}

// lse (or delta, same layout) of (b, h) from the sequence's first row.
__device__ __forceinline__ int64_t lse_offset(const FwdParams& p, const SeqRows& s, int b, int h) {
  if constexpr (!kPacked) return (int64_t(b) * p.H + h) * p.Lq;
  return int64_t(b) * p.lse_sb + int64_t(h) * p.lse_sh + s.q_row0;
}

// What the backward reads of query head h of batch entry b (sequence b of a packed call): Q and
// dO from the sequence's first query row, its lse / delta rows, and the (b, h) slices of the
// mask and bias (nullptr where the module has none).
struct BwdHeadOperands {
  const Elem* q;
  const Elem* dout;
  const float* lse;
  const float* delta;
  const char* mask;
  const char* bias;
};

__device__ __forceinline__ BwdHeadOperands bwd_head_operands(const BwdParams& p, const SeqRows& sr,
                                                             int b, int h) {
  return {reinterpret_cast<const Elem*>(p.q) + int64_t(b) * p.q_sb + sr.q_row0 * p.q_sl +
              int64_t(h) * p.q_sh,
          reinterpret_cast<const Elem*>(p.dout) + int64_t(b) * p.do_sb + sr.q_row0 * p.do_sl +
              int64_t(h) * p.do_sh,
          p.lse + lse_offset(p, sr, b, h),
          p.delta + lse_offset(p, sr, b, h),
          kHasMask ? bcast_base<uint8_t>(p.mask, b, h, sr.aux_row0) : nullptr,
          kHasBias ? bcast_base<Elem>(p.bias, b, h, sr.aux_row0) : nullptr};
}

// Per-key dbias partials of (b, h) from the sequence's first key: dense (B, H, Lk), packed
// (H, total_k).
__device__ __forceinline__ int64_t dbias_key_offset(const BwdParams& p, const SeqRows& s, int b,
                                                    int h) {
  if constexpr (!kPacked) return (int64_t(b) * p.H + h) * p.Lk;
  return int64_t(b) * p.dbk_sb + int64_t(h) * p.dbk_sh + s.k_row0;
}

// ---------------------------------------------------------------------------------------------
// Fragments
// ---------------------------------------------------------------------------------------------

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

// (key tile, (batch, kv head) slot) of a dK/dV block. Causal key tile n is seen by fewer query
// tiles as n grows, so a causal call launches every slot's tile 0, then every tile 1, ...:
// heaviest blocks first. With GQA the grid is small (64 key tiles x 4 kv heads for an 8K
// sequence) and the plain order leaves the last slots' heavy tiles for the tail.
__device__ __forceinline__ void dkdv_block_of(bool causal, int& n_block, int& slot) {
  n_block = blockIdx.x;
  slot = blockIdx.y;
  if (causal) {
    const int lin = blockIdx.x + blockIdx.y * gridDim.x;
    n_block = lin / gridDim.y;
    slot = lin % gridDim.y;
  }
}

// Row of the live-tile list of (b, h, tile): pointer to its entries and the live count.
__device__ __forceinline__ const int32_t* list_row(const TileList& l, int b, int h, int t,
                                                   int& count) {
  const int hm = h / l.hdiv;
  count = l.cnt[int64_t(b) * l.cnt_sb + int64_t(hm) * l.cnt_sh + int64_t(t) * l.cnt_st];
  return l.idx + int64_t(b) * l.idx_sb + int64_t(hm) * l.idx_sh + int64_t(t) * l.idx_st;
}

// First of the `n` ascending entries of a live-tile list row whose tile is >= `tile`.
__device__ __forceinline__ int list_lower_bound(const int32_t* row, int n, int tile) {
  int lo = 0;
  while (n > 0) {
    const int half = n / 2;
    if ((row[lo + half] >> 1) < tile) {
      lo += half + 1;
      n -= half + 1;
    } else {
      n = half;
    }
  }
  return lo;
}

// The key tiles that query tile `m_block` (rows from q0) of sequence / batch entry `s` visits:
// the count, with `list` set to its row of the host's live-tile list, or (no list) every tile
// up to the causal limit. A packed call's list is shared by the sequence's query tiles, so it
// is cut at this tile's causal limit here.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ int key_tiles_of(const FwdParams& p, const SeqRows& s, int b, int h,
                                            int m_block, int q0, const int32_t*& list) {
  list = nullptr;
  // Packed calls size the grid by the longest sequence: tiles past this one's end do nothing.
  if (kPacked && q0 >= seq_lq(p, s)) return 0;
  const int n_tiles = (seq_lk(p, s) + kBlockN - 1) / kBlockN;
  int n_steps = n_tiles;
  if (!kPacked && p.use_list) {
    // A dense list row is this tile's own, already cut at its causal limit.
    list = list_row(p.list, b, h, m_block, n_steps);
    return n_steps;
  }
  if (p.causal) {
    // Last visible key of this tile's last row: q0 + kBlockM - 1 + (Lk - Lq).
    const int last_key =
        min(q0 + kBlockM - 1, seq_lq(p, s) - 1) + (seq_lk(p, s) - seq_lq(p, s));
    n_steps = last_key < 0 ? 0 : min(n_tiles, last_key / kBlockN + 1);
  }
  if (kPacked && p.use_list) {
    int n;
    list = list_row(p.list, b, h, m_block, n);
    return p.causal ? list_lower_bound(list, n, n_steps) : n;
  }
  return n_steps;
}

// The query tiles a dK/dV CTA of key tile n_block walks for query head h: a dense call's list
// row of live query tiles (m_steps entries), or nullptr and the tiles m_first ..
// m_first + m_steps - 1 (every tile up to the causal limit). A packed call's list is its
// sequence's per-key-mask key tiles: whether this key tile has a live key at all, and whether
// all of its keys are. key_partial: every walked tile needs element checks (dense: causal
// without a list; packed: some key of the tile is masked -- the causal part is per query tile,
// see dkdv_tile_partial).
template <int kBM, int kBN>
__device__ __forceinline__ const int32_t* dkdv_query_tiles(const BwdParams& p, const SeqRows& s,
                                                           int b, int h, int n_block, int m_tiles,
                                                           int& m_steps, int& m_first,
                                                           bool& key_partial) {
  m_first = 0;
  m_steps = m_tiles;
  key_partial = p.causal;
  // The dense branch is written out on its own: folded into the packed code below it compiles
  // the same operations to different Hopper dK/dV SASS (other registers), which no GPU run has
  // timed.
  if constexpr (!kPacked) {
    const int32_t* list = nullptr;
    if (p.use_list) {
      list = list_row(p.bwd_list, b, h, n_block, m_steps);
    } else if (p.causal) {
      m_first = max(0, n_block * kBN - (p.Lk - p.Lq)) / kBM;
      m_steps = max(0, m_tiles - m_first);
    }
    return list;
  }
  key_partial = false;
  if (p.causal) {
    // First query that sees key k0: k0 - (Lk - Lq).
    m_first = max(0, n_block * kBN - (s.Lk - s.Lq)) / kBM;
    m_steps = max(0, m_tiles - m_first);
  }
  if (p.use_list) {
    int n;
    const int32_t* row = list_row(p.list, b, h, 0, n);
    const int pos = list_lower_bound(row, n, n_block);
    const int entry = pos < n ? row[pos] : -1;
    if ((entry >> 1) != n_block) m_steps = 0;
    key_partial = (entry & 1) != 0;
  }
  return nullptr;
}

// Whether the dK/dV step over query tile q0 needs element checks. Packed calls: the key tile's
// mask flag, or the (key tile, query tile) pair crossing the causal diagonal -- key
// k0 + kBN - 1 visible to query q0 means every key of the tile is visible to every query of the
// tile. (Before, every causal tile was checked: the varlen suite's dK/dV did element work on
// the whole lower triangle.)
template <int kBM, int kBN>
__device__ __forceinline__ bool dkdv_tile_partial(const FwdParams& p, const SeqRows& s,
                                                  bool key_partial, int k0, int q0) {
  if constexpr (!kPacked) return key_partial;
  return key_partial || (p.causal && k0 + kBN - 1 > q0 + s.Lk - s.Lq);
}

// What a forward CTA of query tile q0 of (b, h) reads: Q / K / V at that tile's origin and the
// (b, h) slices of the mask and bias, and which key tiles it walks (`list` from key_tiles_of,
// or every tile in order) and which of those need element checks.
template <int kBlockN>
struct FwdTileWalk {
  const Elem* q;
  const Elem* k;
  const Elem* v;
  const char* mask;
  const char* bias;
  const int32_t* list;
  int q0;

  __device__ FwdTileWalk(const FwdParams& p, const SeqRows& s, int b, int h, int q0_,
                         const int32_t* list_)
      : list(list_), q0(q0_) {
    const int hkv = h / (p.H / p.Hkv);
    if constexpr (!kPacked) {
      q = reinterpret_cast<const Elem*>(p.q) + int64_t(b) * p.q_sb + int64_t(q0) * p.q_sl +
          int64_t(h) * p.q_sh;
      k = reinterpret_cast<const Elem*>(p.k) + int64_t(b) * p.k_sb + int64_t(hkv) * p.k_sh;
      v = reinterpret_cast<const Elem*>(p.v) + int64_t(b) * p.v_sb + int64_t(hkv) * p.v_sh;
      mask = kHasMask ? bcast_base<uint8_t>(p.mask, b, h, 0) : nullptr;
      bias = kHasBias ? bcast_base<Elem>(p.bias, b, h, 0) : nullptr;
      return;
    }
    q = reinterpret_cast<const Elem*>(p.q) + int64_t(b) * p.q_sb + (s.q_row0 + q0) * p.q_sl +
        int64_t(h) * p.q_sh;
    k = reinterpret_cast<const Elem*>(p.k) + int64_t(b) * p.k_sb + s.k_row0 * p.k_sl +
        int64_t(hkv) * p.k_sh;
    v = reinterpret_cast<const Elem*>(p.v) + int64_t(b) * p.v_sb + s.k_row0 * p.v_sl +
        int64_t(hkv) * p.v_sh;
    mask = kHasMask ? bcast_base<uint8_t>(p.mask, b, h, s.aux_row0) : nullptr;
    bias = kHasBias ? bcast_base<Elem>(p.bias, b, h, s.aux_row0) : nullptr;
  }

  // Key tile index of step i.
  __device__ int tile(int i) const { return list ? (list[i] >> 1) : i; }

  // Whether step i (key tile starting at k0) needs element checks: the list's flag, or (no list)
  // a tile crossing the causal diagonal -- key k0 + kBlockN - 1 is visible to every row of the
  // tile iff it is to the first row. A packed call's list is shared by the sequence's query
  // tiles, so its flag lacks the causal part and the crossing is added here.
  // (Lq, Lk: the sequence's lengths.)
  __device__ bool partial(const FwdParams& p, int i, int k0, int Lq, int Lk) const {
    if constexpr (!kPacked) {
      if (list) return (list[i] & 1) != 0;
      return p.causal && (k0 + kBlockN - 1 > q0 + p.Lk - p.Lq);
    }
    const bool crosses = p.causal && (k0 + kBlockN - 1 > q0 + Lk - Lq);
    return list ? ((list[i] & 1) != 0) || crosses : crosses;
  }
};

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
