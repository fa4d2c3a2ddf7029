// Configuration of the Hopper forward kernel (fwd_sm90_kernel.cuh) on the device: its shape
// (tiles, threads, register budgets, the shared-memory layout and the mask / bias stages of a
// call; Sm90FwdShape in fwd_sm90_launch.h, which the host code sees) plus the CuTe layouts of
// the shared-memory operands, the warpgroup MMAs and the mask / bias tiles. Included by
// fwd_sm90_kernel.cuh in the device pass only (sm_90a).
#pragma once
#include "fwd_sm90_launch.h"
#include "kernel_common.cuh"
#include "wgmma.cuh"

namespace flash_dmattn {

template <int kHD>
struct Sm90FwdConfig : Sm90FwdShape<kHD> {
  using Base = Sm90FwdShape<kHD>;
  using Base::kHeadDim;
  using Base::kBlockM;
  using Base::kBlockN;
  using Base::kStages;
  using Base::kProducerThreads;

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
      Layout<Shape<Int<Base::kConsumerWGs>, _1, _1>>{}));
  using MmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Elem, Elem, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<Base::kConsumerWGs>, _1, _1>>{}));

  using MaskTile = BcastTile<uint8_t, kBlockM, kBlockN, kProducerThreads>;
  using BiasTile = BcastTile<Elem, kBlockM, kBlockN, kProducerThreads>;
  static_assert(MaskTile::kPitch == Base::kMaskPitch &&
                    MaskTile::kBytes == Base::kMaskTileBytes &&
                    BiasTile::kPitch == Base::kBiasPitch &&
                    BiasTile::kBytes == Base::kBiasTileBytes,
                "Sm90FwdShape's mask / bias tiles");
};

}  // namespace flash_dmattn
