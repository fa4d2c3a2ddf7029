// The Hopper forward (sm_90a) as its host code sees it, without CuTe: the kernel's shape
// (tiles, threads, register budgets, the shared-memory layout and the mask / bias stages of a
// call: Sm90FwdShape) and the declaration of its launcher. The dispatcher (flash_fwd_sm90.cu)
// includes this header only; the kernel sources' host pass (the launcher and the kernel's
// launch stub) needs nothing else, so fwd_sm90_kernel.cuh includes CuTe and the kernel's device
// code in the device pass only. The device-side configuration (CuTe layouts, warpgroup MMAs,
// mask / bias tiles) is Sm90FwdConfig in fwd_sm90_config.cuh, which extends this shape.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cuda_runtime.h>

#include "params.h"
#include "spec.h"

namespace flash_dmattn {

template <int kHD>
struct Sm90FwdShape {
  static constexpr int kHeadDim = kHD;
  static constexpr int kConsumerWGs = 2;
  static constexpr int kBlockM = 64 * kConsumerWGs;
  // S (kBlockN) and O (kHeadDim) accumulators share the registers: 128 + 128 fp32 values of a
  // 64-row warpgroup tile is 128 registers a thread, the most that leaves room for the rest.
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = 128 * kConsumerWGs;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  // Two stages of K and of V: with Q, 160 KB of the 227 KB at d128; a third would not leave
  // room for a per-query mask / bias tile.
  static constexpr int kStages = 2;
  // setmaxnreg budgets. They move registers within what the CTA got at launch (168 a thread
  // for 384 threads: 64512), so 128 x producer + 256 x consumer must not exceed that -- a
  // request the pool cannot meet never returns. The consumers hold O, S and P of 64 rows and
  // fit 224 without spilling; the producer only computes addresses.
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 224;

  // A mask / bias tile (BcastTile<uint8_t / Elem, kBlockM, kBlockN, kProducerThreads>, which
  // Sm90FwdConfig checks against these): kBlockM rows of kPitch bytes.
  static constexpr int kMaskPitch = kBlockN * 1 + 16;
  static constexpr int kBiasPitch = kBlockN * kElemBytes + 16;
  static constexpr int kMaskTileBytes = kBlockM * kMaskPitch;
  static constexpr int kBiasTileBytes = kBlockM * kBiasPitch;
  static constexpr bool kHasAux = kHasMask || kHasBias;
  // The swizzle pattern repeats every 1024 bytes and is applied to address bits: every GMMA
  // operand starts on a 1024-byte boundary (the stage sizes are multiples of 1024).
  static constexpr int align1k(int x) { return (x + 1023) / 1024 * 1024; }
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kStageBytes = kBlockN * kHeadDim * 2;
  static constexpr int kKOff = align1k(kQBytes);
  static constexpr int kVOff = kKOff + kStages * kStageBytes;
  // mbarriers: Q full / empty; full / empty of each K and V stage; full / empty of each
  // mask-bias stage.
  // At most this many mask / bias stages (as many as fit, for the call's mask and bias
  // shapes): 4 keep a per-key bias two tiles ahead of the consumers with room to spare.
  static constexpr int kMaxAuxStages = 4;
  static constexpr int kBarriers = 2 + 4 * kStages + 2 * kMaxAuxStages;
  static constexpr int kBarOff = kVOff + kStages * kStageBytes;
  static constexpr int kAuxOff = kBarOff + (8 * kBarriers + 15) / 16 * 16;
  static constexpr int kSmemLimit = 227 * 1024;
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;  // per thread, at launch
  static_assert(kProducerThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <=
                    kThreads * kLaunchRegs,
                "setmaxnreg requests beyond the CTA's registers never complete");
  static_assert(kStageBytes % 1024 == 0, "stage alignment");
  static_assert(kBlockN % 64 == 0, "a gathered tile's bits are whole words");
  static_assert(kAuxOff + (kHasMask ? kMaskTileBytes : 0) + (kHasBias ? kBiasTileBytes : 0) <=
                    kSmemLimit,
                "shared memory over the sm_90 limit");

  // The mask / bias stages are sized by the call: a mask or bias broadcast over queries is one
  // row of the tile, so its stages are small and more of them fit (a per-key bias: 3 stages
  // of mask + bias instead of 1). Same on host and device.
  struct AuxLayout {
    int mask_bytes;  // offset of the bias tile within a stage
    int stride;      // bytes per stage
    int stages;      // 1 .. kMaxAuxStages
    int smem;        // dynamic shared memory of the launch
  };
  // Gathered keys: a stage is the tile's mask bits (kBlockN / 64 words a row) and its row of
  // the gathered bias.
  static constexpr int kBitWords = kBlockN / 64;
  static constexpr int kBitsBytes = kBlockM * kBitWords * 8;
  static constexpr int kGBiasBytes = kBlockN * 2;
  // Key intervals: a stage is the listed keys' query ranges (an int2 a key) and their bias as
  // fp32 log2-unit logits (bias * log2 e), so a score takes one FMA to become a logit.
  static constexpr int kRangeBytes = kBlockN * 8;
  static constexpr int kIBiasBytes = kBlockN * 4;
  __host__ __device__ static AuxLayout aux_layout(const FwdParams& p) {
    const bool g = p.gather, iv = p.intervals;
    const int mask_bytes =
        !kHasMask ? 0
        : iv      ? kRangeBytes
                  : (g ? kBitsBytes : (p.mask.sq == 0 ? 1 : kBlockM) * kMaskPitch);
    const int bias_bytes =
        !kHasBias ? 0
        : iv      ? kIBiasBytes
        : g       ? kGBiasBytes
                  : (p.bias.sq == 0 ? 1 : kBlockM) * kBiasPitch;
    const int stride = mask_bytes + bias_bytes;  // pitches are multiples of 16
    int stages = 1;
    if (stride > 0) {
      stages = (kSmemLimit - kAuxOff) / stride;
      stages = stages < 1 ? 1 : (stages > kMaxAuxStages ? kMaxAuxStages : stages);
    }
    return {mask_bytes, stride, stages, kAuxOff + stages * stride};
  }
};

// Launch the forward kernel of one walk (kGather, kIntervals: see fwd_kernel_sm90), with or
// without a soft cap and dropout. Defined in fwd_sm90_kernel.cuh; each instance is compiled by
// exactly one flash_fwd_sm90_<walk>[_dropout][_softcap].cu, so that a build compiles the
// kernels in parallel translation units, and the dispatcher sees this declaration only.
template <bool kSoftcap, bool kGather, bool kIntervals, bool kDropout>
cudaError_t launch_fwd_sm90(const FwdParams& p, cudaStream_t stream);

// Streaming multiprocessors of the current device (grids of one CTA per SM).
inline int sm_count() {
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  return n > 0 ? n : 1;
}

}  // namespace flash_dmattn
