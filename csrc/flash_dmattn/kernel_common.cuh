// Building blocks shared by the forward, backward and decode kernels; each .cu includes this
// header, which includes one header per topic:
//
//   spec.cuh        the module's compile-time specialisation (head dim, dtype, mask / bias, packed)
//   traits.cuh      tile shapes, the MMA and the swizzled shared-memory layouts
//   copies.cuh      predicated global -> shared copies (tiles, rows by index, row vectors)
//   bcast_tile.cuh  mask / bias tiles of a broadcastable (B, H, Lq, Lk) operand
//   seq_rows.cuh    where a batch entry's or packed sequence's rows are
//   fragments.cuh   register fragments: operand reinterpretation, products, storing a tile
//   softmax.cuh     scores, quad reductions and the online-softmax step
//   tile_walk.cuh   which tiles a CTA owns and walks, and in which order
//
// Design (sm80 instructions, so it runs on Ampere, Ada and Hopper): each CTA owns one tile of
// rows (queries in the forward and dQ kernels, keys in the dK/dV kernel) and walks the live
// tiles of the other side. Q/K/V tiles are staged in swizzled shared memory with cp.async, the
// products use mma.sync m16n8k16 through a CuTe TiledMMA with warps stacked along the rows, and
// the mask / bias tile of a live, partial tile is copied asynchronously next to the K or V tile
// so its latency hides behind the first matrix product. The Hopper forward (fwd_sm90_kernel.cuh)
// keeps this structure and these loaders but runs its products on warpgroup MMAs.
#pragma once

#include "spec.cuh"
#include "traits.cuh"
#include "copies.cuh"
#include "bcast_tile.cuh"
#include "seq_rows.cuh"
#include "fragments.cuh"
#include "softmax.cuh"
#include "tile_walk.cuh"
