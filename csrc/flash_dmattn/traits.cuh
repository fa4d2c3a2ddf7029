// Tile shapes of the sm80 kernels: the MMA (mma.sync m16n8k16 through a CuTe TiledMMA, warps
// stacked along the rows) and the swizzled shared-memory layouts of the Q / K / V / dO tiles.
#pragma once

#include "spec.cuh"

namespace flash_dmattn {

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

}  // namespace flash_dmattn
