// Global -> shared copies: cp.async of 16 / 8 / 4 bytes, a (rows x head dim) tile into the
// swizzled layouts of Traits and of the Hopper kernels, the same with rows taken by index (gathered
// keys), and short fp32 row vectors (lse, delta).
#pragma once

#include "spec.cuh"

namespace flash_dmattn {

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

}  // namespace flash_dmattn
