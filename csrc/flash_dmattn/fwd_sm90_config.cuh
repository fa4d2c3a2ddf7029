// Configuration of the Hopper forward kernel (fwd_sm90_kernel.cuh): tile shapes, warpgroup
// MMAs, the shared-memory layout, register budgets and the mask / bias stages of a call; and
// the declaration of the kernel's launcher, which the dispatcher (flash_fwd_sm90.cu) calls and
// the flash_fwd_sm90_<walk>[_dropout].cu sources instantiate. Included by those sources only,
// inside their guards (sm_90a).
#pragma once
#include "kernel_common.cuh"
#include "wgmma.cuh"

namespace flash_dmattn {

template <int kHD>
struct Sm90FwdConfig {
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

  using SmemAtom = typename GmmaTiles<kHD>::Atom;
  static constexpr int kAtomK = GmmaTiles<kHD>::kAtomK;
  using SmemQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemK =
      decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V (keys x head dim, K-major) read as its transpose: the MN-major B operand of P V.
  using SmemVt = decltype(composition(
      SmemK{},
      make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{})));

  using MmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
      Layout<Shape<Int<kConsumerWGs>, _1, _1>>{}));
  using MmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Elem, Elem, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<kConsumerWGs>, _1, _1>>{}));

  using MaskTile = BcastTile<uint8_t, kBlockM, kBlockN, kProducerThreads>;
  using BiasTile = BcastTile<Elem, kBlockM, kBlockN, kProducerThreads>;
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
  static_assert(kAuxOff + (kHasMask ? MaskTile::kBytes : 0) + (kHasBias ? BiasTile::kBytes : 0) <=
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
                  : (g ? kBitsBytes : (p.mask.sq == 0 ? 1 : kBlockM) * MaskTile::kPitch);
    const int bias_bytes =
        !kHasBias ? 0
        : iv      ? kIBiasBytes
        : g       ? kGBiasBytes
                  : (p.bias.sq == 0 ? 1 : kBlockM) * BiasTile::kPitch;
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
// exactly one flash_fwd_sm90_<walk>[_dropout].cu, so that a build compiles the kernels in
// parallel translation units, and the dispatcher sees this declaration only.
template <bool kSoftcap, bool kGather, bool kIntervals, bool kDropout>
cudaError_t launch_fwd_sm90(const FwdParams& p, cudaStream_t stream);

}  // namespace flash_dmattn
