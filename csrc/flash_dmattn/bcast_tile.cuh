// Mask and bias tiles: one tile of a broadcastable (B, H, Lq, Lk) operand copied to shared memory
// (asynchronously where its rows allow 16-byte copies) and read back per element or per pair,
// and the base pointer of an operand's (batch, head) slice.
#pragma once

#include "copies.cuh"
#include "params.h"

namespace flash_dmattn {

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

}  // namespace flash_dmattn
