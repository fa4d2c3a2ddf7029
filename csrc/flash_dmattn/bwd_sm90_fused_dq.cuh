// Fused dQ of the Hopper dK/dV kernel (flash_bwd_sm90.cu; p.dq_accum set): each step's dS^T
// is staged in shared memory (1), dQ_partial = dS K is issued from it (2) and added to an fp32
// accumulator by bulk asynchronous reductions (3); a last kernel converts the accumulator to
// dQ (4). The accumulator is laid out (B, H, query tile, kHD / 32 column blocks, 64, 32), each
// 64 x 32 block swizzled (3 writes it, 4 undoes it). Included by flash_bwd_sm90.cu only, in
// its FLASH_DMATTN_SM90_BWD block (sm_90a).
#pragma once
#include "bwd_sm90_config.cuh"

namespace flash_dmattn {

// 1. Stage this warpgroup's dS^T as a 64 x 64 K-major tile with the 128-byte swizzle
// (GmmaTiles<64>::Rows<64>) and make it visible to the MMAs of the warpgroups that read it.
// Thread (warp w, lane) holds keys 16 w + 8 r + lane / 4 and queries 8 g + 2 (lane % 4) +
// {0, 1}: byte offset (2 w + r) * 1024 + (lane / 4) * 128 + ((g ^ lane / 4) * 16) +
// (lane % 4) * 4, each pair one 4-byte store. Written out rather than through the layout so no
// per-value addresses stay live across the loop (through the layout they did, and spilled).
template <typename Cfg, typename Frag>
__device__ __forceinline__ void stage_ds_t(char* smem, int wg, int tid, Frag const& rdS) {
  constexpr int kGroups = decltype(size<0, 2>(rdS))::value;
  const int lane = tid % 32, wq = (tid % 128) / 32, row8 = lane / 4;
  char* ds_base = smem + Cfg::kKvDsOff + wg * Cfg::kDsT + wq * 2048 + row8 * 128 + (lane % 4) * 4;
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      __align__(4) Elem pair[2] = {rdS(make_coord(make_coord(0, r, g), 0, 0)),
                                   rdS(make_coord(make_coord(1, r, g), 0, 0))};
      *reinterpret_cast<uint32_t*>(ds_base + r * 1024 + ((g ^ row8) * 16)) =
          *reinterpret_cast<uint32_t*>(pair);
    }
  }
  fence_async_shared();
  if constexpr (Cfg::kSplitD) {
    named_barrier_sync(kBarDsExchange, 256);  // both halves of dS feed each warpgroup's dQ columns
  } else {
    named_barrier_sync(1 + wg, 128);  // this warpgroup's four warps wrote its dS
  }
}

// 2. Issue dQ_partial = dS K from shared memory (no wait): kHD = 128, this warpgroup's 64
// columns over both 64-key chunks; otherwise all columns over its own keys.
template <typename Cfg, typename Mma, typename Thr, typename Acc>
__device__ __forceinline__ void issue_fused_dq(Mma& mma_q, Thr& thr_q, char* smem, int wg,
                                               Acc& acc_dq) {
  auto at = [&](int off) { return make_smem_ptr(reinterpret_cast<Elem*>(smem + off)); };
  if constexpr (Cfg::kSplitD) {
    CUTE_UNROLL
    for (int c = 0; c < 2; ++c) {  // key chunk c: warpgroup c's dS^T and K rows
      Tensor tArdS = thr_q.partition_fragment_A(
          make_tensor(at(Cfg::kKvDsOff + c * Cfg::kDsT), typename Cfg::DsTileT{}));
      Tensor tBrK = thr_q.partition_fragment_B(
          make_tensor(at(c * Cfg::kT + wg * Cfg::kDsT), typename Cfg::KtTile{}));
      wgmma_issue<false>(mma_q, tArdS, tBrK, acc_dq, /*zero=*/c == 0);
    }
  } else {
    Tensor tArdS = thr_q.partition_fragment_A(
        make_tensor(at(Cfg::kKvDsOff + wg * Cfg::kDsT), typename Cfg::DsTileT{}));
    Tensor tBrK = thr_q.partition_fragment_B(make_tensor(at(wg * Cfg::kT), typename Cfg::KtTile{}));
    wgmma_issue<false>(mma_q, tArdS, tBrK, acc_dq, /*zero=*/true);
  }
}

// 3. Add the finished partial to its block `dst` of the fp32 accumulator: staged 32 columns at
// a time, each piece one bulk reduction (the last runs while the next step computes). The
// leader first waits until the previous reduction has read the stage. Within a piece,
// (row, col) sits at row * 32 + (col ^ 4 (row % 8)): the swizzle spreads a warp's 8-byte
// stores over the banks (dq_accum_to_dq_kernel undoes it).
template <typename Cfg, typename Acc>
__device__ __forceinline__ void reduce_dq_partial(char* smem, float* dst, int wg, int tid,
                                                  Acc const& acc_dq) {
  float* stage = reinterpret_cast<float*>(smem + Cfg::kKvDqOff + wg * Cfg::kDqStage);
  const int lane = tid % 32;
  const bool leader = tid % 128 == 0;
  const int row0 = ((tid % 128) / 32) * 16 + lane / 4;
  const int col0 = (2 * (lane % 4)) ^ (4 * (lane / 4));  // row0 % 8 == lane / 4
  CUTE_UNROLL
  for (int cb = 0; cb < Cfg::kDqN / Cfg::kDqCols; ++cb) {
    if (leader) bulk_wait_read<0>();
    named_barrier_sync(1 + wg, 128);
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      CUTE_UNROLL
      for (int g4 = 0; g4 < 4; ++g4) {
        const int g = cb * 4 + g4;
        *reinterpret_cast<float2*>(stage + (row0 + 8 * r) * 32 + (col0 ^ (8 * g4))) =
            make_float2(acc_dq(make_coord(make_coord(0, r, g), 0, 0)),
                        acc_dq(make_coord(make_coord(1, r, g), 0, 0)));
      }
    }
    fence_async_shared();
    named_barrier_sync(1 + wg, 128);
    if (leader) bulk_reduce_add_f32(dst + cb * (64 * 32), stage, Cfg::kDqStage);
  }
}

// 4. Once every step has added its partial: the fp32 accumulator -> dQ * scale in the input
// dtype, (B, Lq, H, D).
template <int kHD>
__global__ void dq_accum_to_dq_kernel(const BwdParams p) {
  const int half_d = p.D / 2;  // D is even (a multiple of 8): pairs of columns
  constexpr int kBM = Sm90BwdConfig<kHD>::kBlockM;
  const int m_tiles = (p.Lq + kBM - 1) / kBM;
  const int64_t n = int64_t(p.B) * p.Lq * p.H * half_d;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(i % half_d) * 2;
    int64_t rest = i / half_d;
    const int h = int(rest % p.H);
    rest /= p.H;
    const int l = int(rest % p.Lq);
    const int b = int(rest / p.Lq);
    // (B, H, query tile, kHD / 32 column blocks, 64, 32), swizzled within a block.
    const int row = l % kBM;
    const float2 v = *reinterpret_cast<const float2*>(
        p.dq_accum + ((int64_t(b) * p.H + h) * m_tiles + l / kBM) * (kBM * kHD) +
        (c / 32) * (kBM * 32) + row * 32 + ((c % 32) ^ (4 * (row % 8))));
    __align__(4) Elem pair[2] = {Elem(v.x * p.scale), Elem(v.y * p.scale)};
    Elem* dst = reinterpret_cast<Elem*>(p.dq) + int64_t(b) * p.dq_sb + int64_t(l) * p.dq_sl +
                int64_t(h) * p.dq_sh + c;
    *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<uint32_t*>(pair);
  }
}

}  // namespace flash_dmattn
