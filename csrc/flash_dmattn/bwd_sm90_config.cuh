// Configuration of the Hopper backward kernels (flash_bwd_sm90.cu): tile shapes, warpgroup
// MMAs, shared-memory layouts and register budgets of the dK/dV and dQ kernels, the dK/dV
// kernel's named barriers, and the 64-row tile copy of the dQ kernel. Included by
// flash_bwd_sm90.cu only, in its FLASH_DMATTN_SM90_BWD block (sm_90a).
#pragma once
#include "kernel_common.cuh"
#include "wgmma.cuh"

namespace flash_dmattn {

// The dK/dV kernel's plain path for whole visible tiles (see its use) is compiled into the
// modules without a bias, where most steps of block-sparse and per-key masks are whole tiles.
// Modules with a bias go without it: in the per-query mask + bias module few tiles are whole,
// and it ran slower with the path.
constexpr bool kPlainPath = !kHasBias;

template <int kHD>
struct Sm90BwdConfig {
  static constexpr int kBlockM = 64;   // queries per tile
  static constexpr int kBlockN = 128;  // keys per tile: 64 per warpgroup
  static constexpr int kThreads = 256;
  using Tiles = GmmaTiles<kHD>;
  static constexpr int kAtomK = Tiles::kAtomK;
  // Every operand is a 64-row tile (Q, dO, or one warpgroup's half of K, V); 64 * kHD * 2
  // bytes is a multiple of 1024, so consecutive tiles keep the swizzle's 1024-byte alignment.
  using Tile = typename Tiles::template Rows<64>;
  using TileT = typename Tiles::template RowsT<64>;
  static constexpr int kT = 64 * kHD * 2;
  using One = Layout<Shape<_1, _1, _1>>;
  // (64 x 64) = (64 x kHD) (64 x kHD)^T: S, dP and their transposes.
  using MmaScores = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, _64, Int<kHD>>>(), One{}));
  // (64 x kHD) += (64 x 64, registers) (64 x kHD): dV, dK, dQ.
  using MmaGrad = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Elem, Elem, float, Shape<_64, Int<kHD>, _64>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      One{}));
  using MaskTile = BcastTile<uint8_t, kBlockM, kBlockN, kThreads>;
  using BiasTile = BcastTile<Elem, kBlockM, kBlockN, kThreads>;

  // Warp-specialised dK/dV kernel: a producer warpgroup and two consumer warpgroups (64 keys
  // each). setmaxnreg moves registers within the 168 a thread the CTA got at launch: the
  // producer only computes addresses and copies, so it drops to 24 (the least setmaxnreg
  // takes), and the consumers, which hold dK and dV (64 x kHD fp32 each) beside S^T, dP^T and
  // the fused dQ partial, take the rest: 128 x 24 + 256 x 240 = 384 x 168.
  static constexpr int kKvProducerThreads = 128;
  static constexpr int kKvThreads = kKvProducerThreads + kThreads;
  static constexpr int kKvProducerRegs = 24;
  static constexpr int kKvConsumerRegs = 240;
  static_assert(kKvProducerThreads * kKvProducerRegs + kThreads * kKvConsumerRegs <=
                    kKvThreads * (65536 / kKvThreads / 8 * 8),
                "setmaxnreg requests beyond the CTA's registers never complete");
  using MaskTileP = BcastTile<uint8_t, kBlockM, kBlockN, kKvProducerThreads>;
  using BiasTileP = BcastTile<Elem, kBlockM, kBlockN, kKvProducerThreads>;

  // Fused dQ. Each warpgroup stages its dS^T (64 keys x 64 queries, K-major over queries) as a
  // 64-column GMMA tile and reads it back as an MN-major A operand (64 queries x 64 keys).
  // kHD = 128: warpgroup w computes dQ columns [64 w, 64 w + 64) over all 128 keys of the tile
  // (K's column block w is itself a 64-column tile, 8 KB into the K tile); an m64n64
  // accumulator keeps the register budget of the kernel. Other head dims: each warpgroup
  // computes all kHD columns over its own 64 keys.
  static constexpr bool kSplitD = kHD == 128;
  static constexpr int kDqN = kSplitD ? 64 : kHD;
  using DsTiles = GmmaTiles<64>;
  using DsTile = typename DsTiles::template Rows<64>;
  using DsTileT = typename DsTiles::template RowsT<64>;
  static constexpr int kDsT = 64 * 64 * 2;
  using KtTile = std::conditional_t<kSplitD, DsTileT, TileT>;  // (kDqN x 64 keys) of K^T
  using MmaDq = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, Int<kDqN>, _64>, GMMA::Major::MN,
                           GMMA::Major::MN>(),
      One{}));

  // dK/dV: [K0][K1][V0][V1] [Q][dO] x 2 stages, dS^T x 2 warpgroups, lse / delta x 2 stages,
  // mask / bias x 2 stages.
  static constexpr int kKvDsOff = 8 * kT;
  static constexpr int kKvLseOff = kKvDsOff + 2 * kDsT;
  static constexpr int kKvMaskOff = kKvLseOff + 4 * kBlockM * 4;
  static constexpr int kKvBiasOff = kKvMaskOff + (kHasMask ? 2 * MaskTile::kBytes : 0);
  static constexpr int kKvSmemBase = kKvBiasOff + (kHasBias ? 2 * BiasTile::kBytes : 0);
  // Fused dQ: each warpgroup's fp32 partial (64 x kDqN) is staged here 32 columns at a time
  // (8 KB: a 64 x kDqN stage does not fit next to d128's mask and bias tiles) and each piece is
  // added to the accumulator by one bulk asynchronous reduction (cp.reduce.async.bulk).
  static constexpr int kDqCols = 32;
  static constexpr int kDqStage = 64 * kDqCols * 4;
  static constexpr int kKvDqOff = (kKvSmemBase + 127) / 128 * 128;
  // mbarriers: K/V landed; full / empty of each of the two Q / dO / lse / delta / aux stages;
  // then each stage's step entry (query tile << 1 | partial), written by the producer.
  static constexpr int kKvBarOff = kKvDqOff + 2 * kDqStage;
  static constexpr int kKvInfoOff = kKvBarOff + 5 * 8;
  static constexpr int kKvSmem = kKvInfoOff + 2 * 4;
  // A per-element mask tile reaches the consumers as bits, one 64-bit word of query bits per
  // key (kKeyBitsBytes a stage, in the second mask tile's space); the producer lands the raw
  // bytes in the first tile's space and transposes them. One word per producer thread. A
  // consumer then tests an element with a shift of a word it holds instead of a shared-memory
  // byte read, and the transpose runs on the producer, off the consumers' path.
  static constexpr int kKeyBitsBytes = kBlockN * 8;
  static_assert(kBlockN == kKvProducerThreads && kBlockM == 64, "one key's query bits per producer thread");
  static_assert(2 * kKeyBitsBytes <= MaskTile::kBytes, "key bits fit the second mask tile");
  // dQ: [Q][dO] [K0][K1][V0][V1] x 2 stages, mask / bias x 2 stages.
  static constexpr int kQMaskOff = 10 * kT;
  static constexpr int kQBiasOff = kQMaskOff + (kHasMask ? 2 * MaskTile::kBytes : 0);
  static constexpr int kQSmem = kQBiasOff + (kHasBias ? 2 * BiasTile::kBytes : 0);
  static_assert(kKvSmem <= 227 * 1024 && kQSmem <= 227 * 1024, "shared memory over the sm_90 limit");
};

// Named barriers of the dK/dV kernel (0 is __syncthreads): 1 + wg for one consumer warpgroup,
// kBarDsExchange for both (their dS^T halves), and kBarDsFree + wg: warpgroup wg is done
// reading the other's dS^T buffer (it arrives, the other syncs before overwriting it).
constexpr int kBarDsExchange = 3;
constexpr int kBarDsFree = 4;
constexpr int kBarProducer = 6;  // the producer warpgroup alone

// Copy a 64-row tile (rows from `g`, `rows_valid` of them) into the GMMA layout at `dst`.
template <typename Cfg>
__device__ __forceinline__ void load_tile64(const Elem* g, int64_t row_stride, int rows_valid,
                                            int cols_valid, char* dst, int tid) {
  load_tile_swizzled<kHeadDimBucket, Cfg::kAtomK, Cfg::kThreads, 64>(g, row_stride, rows_valid,
                                                                     cols_valid, dst, tid);
}

}  // namespace flash_dmattn
