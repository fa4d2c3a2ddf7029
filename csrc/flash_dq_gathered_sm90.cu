// Hopper dQ over gathered key lists (sm_90a, head dims up to 128): the backward's half of the
// gathered forward (fwd_sm90_kernel.cuh). A per-query mask whose query tiles share few keys (the
// Dynamic Mask Attention top-k) leaves every key tile partly live, so walking key tiles does
// all of the causal work; walking the union of the query tile's live keys (the planner's
// KeyGather, the same lists and bits the forward used) does a fraction of it.
//
// One CTA per (128-query tile, b * H + h), warp-specialised like the forward:
// * the producer warpgroup copies Q and dO once (two 64-row tiles each), then per step the K and
//   V rows of the next 64 listed keys by index, the 64 query bits of each row (one word) and the
//   gathered bias row, into kStages stages with full / empty mbarriers;
// * two consumer warpgroups of 64 query rows each run, per step,
//     S = Q K^T and dP = dO V^T      (one batch, both operands in shared memory)
//     P = exp(S - lse), dS = P (dP - delta)
//     dQ += dS K                     (dS from registers, K read as its transpose)
//   issuing step i's S / dP before step i - 1's dQ product, so the softmax-side element work of
//   step i runs while that product is on the tensor cores.
// dQ is a plain register accumulator written once (no atomics: deterministic). The key
// gradients and a per-key dbias come from the dK/dV kernel, which walks key tiles as before.
//
// kBits = false (no bits: p.g.bits == nullptr): the list of a per-key mask, one row of live keys
// shared by every query tile (the host's key_list_gather). Visibility is then the list's length
// and, for causal calls, the listed key index against the query row; the producer stages the
// step's 64 indices where the bits would go.
#include "flash_dmattn/kernel_common.cuh"

#if FLASH_DMATTN_SM90_BWD

#include "flash_dmattn/pipeline.cuh"
#include "flash_dmattn/wgmma.cuh"

namespace flash_dmattn {

template <int kHD>
struct Sm90DqGatherConfig {
  static constexpr int kBlockM = 128;  // queries: 64 per consumer warpgroup (the forward's tile)
  static constexpr int kBlockN = 64;   // listed keys per step: one word of bits per query row
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  // Stages of K / V rows in flight. Listed rows are copied by index, so the producer runs
  // steps ahead to hide their latency: four stages (32 KB each at kHD = 128) are the most
  // that fit next to Q, dO, the bits and the bias rows at kHD = 128.
  static constexpr int kStages = 4;
  // setmaxnreg budgets: the producer computes row addresses only; the consumers hold dQ
  // (64 x kHD fp32), S and dP (64 x 64 fp32 each) and dS (bf16). The forward's split of the
  // same 384 threads: 128 x 56 + 256 x 224 = 384 x 168.
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 224;
  static_assert(kProducerThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <=
                    kThreads * (65536 / kThreads / 8 * 8),
                "setmaxnreg requests beyond the CTA's registers never complete");

  using Tiles = GmmaTiles<kHD>;
  static constexpr int kAtomK = Tiles::kAtomK;
  using Tile = typename Tiles::template Rows<64>;
  using TileT = typename Tiles::template RowsT<64>;
  static constexpr int kT = 64 * kHD * 2;  // a multiple of 1024: tiles keep the swizzle aligned
  using One = Layout<Shape<_1, _1, _1>>;
  // (64 queries x 64 keys) = (64 x kHD) (64 x kHD)^T: S and dP.
  using MmaScores = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, _64, Int<kHD>>>(), One{}));
  // (64 x kHD) += (64 x 64, registers) (64 keys x kHD, read MN-major): dQ.
  using MmaGrad = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Elem, Elem, float, Shape<_64, Int<kHD>, _64>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      One{}));

  // [Q0][Q1][dO0][dO1], then per stage [K][V], the stages' bits and bias rows, the mbarriers.
  static constexpr int kKvOff = 4 * kT;
  static constexpr int kBitsOff = kKvOff + kStages * 2 * kT;
  static constexpr int kBitsBytes = kBlockM * 8;
  static constexpr int kBiasOff = kBitsOff + kStages * kBitsBytes;
  static constexpr int kBiasBytes = kBlockN * 2;
  static constexpr int kBarOff = kBiasOff + kStages * kBiasBytes;
  static constexpr int kSmem = kBarOff + (1 + 2 * kStages) * 8;
  static_assert(kSmem <= 227 * 1024, "shared memory over the sm_90 limit");
  static_assert(kProducerThreads == kBlockM, "one bits row per producer thread");
  static_assert(kBlockN * 4 <= kBitsBytes, "a step's key indices fit its bits stage");
};

template <bool kSoftcap, bool kBits>
__global__ void __launch_bounds__(Sm90DqGatherConfig<kHeadDimBucket>::kThreads, 1)
    dq_gathered_kernel_sm90(const BwdParams p) {
  using Cfg = Sm90DqGatherConfig<kHeadDimBucket>;
  constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kD = kHeadDimBucket, kT = Cfg::kT;
  constexpr int kStages = Cfg::kStages;
  extern __shared__ __align__(1024) char smem[];
  uint64_t* q_full = reinterpret_cast<uint64_t*>(smem + Cfg::kBarOff);
  uint64_t* full = q_full + 1;              // [kStages]
  uint64_t* empty = q_full + 1 + kStages;   // [kStages]

  const QTileCoord coord = q_tile_coord(p.H, p.Hkv);
  const int m_block = coord.m_block, b = coord.b, h = coord.h;
  const int q0 = m_block * kBM;
  const KeyGather& g = p.g;
  const int hl = h / g.hdiv;
  const int32_t* list = g.idx + b * g.idx_sb + hl * g.idx_sh + m_block * g.idx_sm;
  const int n_keys = g.cnt[b * g.cnt_sb + hl * g.cnt_sh + m_block * g.cnt_sm];
  const int n_steps = (n_keys + kBN - 1) / kBN;
  const SeqRows sr = seq_rows(p, b);  // dense calls only: rows start at 0

  if (threadIdx.x == 0) {
    ClusterBarrier::init(q_full, Cfg::kProducerThreads);
    for (int s = 0; s < kStages; ++s) {
      ClusterBarrier::init(full + s, Cfg::kProducerThreads);
      ClusterBarrier::init(empty + s, Cfg::kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  // ---- Producer warpgroup.
  if (threadIdx.x < Cfg::kProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    const int ptid = threadIdx.x;
    constexpr int kPT = Cfg::kProducerThreads;
    if (n_steps == 0) return;
    const FwdTileWalk<kBN> walk(p, sr, b, h, q0, nullptr);
    const Elem* dog = reinterpret_cast<const Elem*>(p.dout) + int64_t(b) * p.do_sb +
                      int64_t(q0) * p.do_sl + int64_t(h) * p.do_sh;
    CUTE_UNROLL
    for (int w = 0; w < 2; ++w) {
      load_tile_swizzled<kD, Cfg::kAtomK, kPT, 64, true>(walk.q + int64_t(64 * w) * p.q_sl, p.q_sl,
                                                    p.Lq - q0 - 64 * w, p.D, smem + w * kT, ptid);
      load_tile_swizzled<kD, Cfg::kAtomK, kPT, 64, true>(dog + int64_t(64 * w) * p.do_sl, p.do_sl,
                                                    p.Lq - q0 - 64 * w, p.D, smem + (2 + w) * kT,
                                                    ptid);
    }
    stage_filled(q_full);
    // The planner's bits have a row for every query of every tile (rows past Lq are 0).
    const uint64_t* bits_row =
        kBits ? g.bits + b * g.bits_sb + (h / g.bits_hdiv) * g.bits_sh +
                    int64_t(q0 + ptid) * g.bits_sq
              : nullptr;
    const Elem* bias_row = kHasBias ? reinterpret_cast<const Elem*>(g.bias) + b * g.bias_sb +
                                          (h / g.bias_hdiv) * g.bias_sh + m_block * g.bias_sm
                                    : nullptr;
    // Each step's row indices are read a step ahead (RowIndices).
    RowIndices<Cfg::kAtomK, kPT, kBN> rows, rows_next;
    rows_next.fetch(list, n_keys, ptid);
    for (int i = 0; i < n_steps; ++i) {
      const int s = i % kStages;
      const int k0 = i * kBN;
      rows = rows_next;
      if (i + 1 < n_steps) rows_next.fetch(list + k0 + kBN, n_keys - k0 - kBN, ptid);
      ClusterBarrier::wait(empty + s, ((i / kStages) & 1) ^ 1);
      char* kv = smem + Cfg::kKvOff + s * 2 * kT;
      load_rows_by_index<kD, Cfg::kAtomK, kPT, kBN>(walk.k, p.k_sl, rows, p.D, kv, ptid);
      load_rows_by_index<kD, Cfg::kAtomK, kPT, kBN>(walk.v, p.v_sl, rows, p.D, kv + kT, ptid);
      if constexpr (kBits) {
        cp_async_8(smem + Cfg::kBitsOff + s * Cfg::kBitsBytes + ptid * 8, bits_row + i, 8);
      } else if (ptid < kBN / 4) {  // the step's key indices, 4 a copy
        const int valid = max(0, min(16, (n_keys - k0 - ptid * 4) * 4));
        cp_async_16(smem + Cfg::kBitsOff + s * Cfg::kBitsBytes + ptid * 16,
                    valid > 0 ? list + k0 + ptid * 4 : list, valid);
      }
      if constexpr (kHasBias) {
        constexpr int kChunks = Cfg::kBiasBytes / 16;
        if (ptid < kChunks) {
          const int col = k0 + ptid * 8;
          const int valid = max(0, min(16, (g.bias_width - col) * 2));
          cp_async_16(smem + Cfg::kBiasOff + s * Cfg::kBiasBytes + ptid * 16,
                      valid > 0 ? bias_row + col : bias_row, valid);
        }
      }
      stage_filled(full + s);
    }
    // Copies still in flight must not outlive their thread.
    cp_async_wait<0>();
    return;
  }

  // ---- Consumer warpgroups: 64 query rows each.
  cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
  const int tid = threadIdx.x - Cfg::kProducerThreads, wg = tid / 128;
  const int qw = 64 * wg;  // this warpgroup's queries: q0 + qw + [0, 64)
  auto at = [&](int off) { return make_smem_ptr(reinterpret_cast<Elem*>(smem + off)); };

  typename Cfg::MmaScores mma_s;
  typename Cfg::MmaGrad mma_g;
  auto thr_s = mma_s.get_thread_slice(tid % 128);
  auto thr_g = mma_g.get_thread_slice(tid % 128);
  Tensor acc_dq = partition_fragment_C(mma_g, Shape<_64, Int<kD>>{});
  clear(acc_dq);
  // (query, key) of each S accumulator value within this warpgroup's 64 x 64 tile.
  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<_64, _64>{}));
  constexpr int kGroups = decltype(size<0, 2>(cS))::value;

  if (n_steps > 0) {
    // lse / delta of this thread's two rows (rows past Lq: lse = +inf, so P = 0).
    const float* lse_g = p.lse + lse_offset(p, sr, b, h);
    const float* delta_g = p.delta + lse_offset(p, sr, b, h);
    float row_lse[2], row_delta[2];
    load_row_stats(lse_g, delta_g, q0 + qw, p.Lq, cS, row_lse, row_delta);
    const float scale2 = p.scale * kLog2e;
    float row_lse2[2];  // +inf for fully masked and out-of-range rows: P = 0
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) row_lse2[r] = row_lse[r] * kLog2e;
    Tensor tSrQ = thr_s.partition_fragment_A(make_tensor(at(wg * kT), typename Cfg::Tile{}));
    Tensor tSrdO =
        thr_s.partition_fragment_A(make_tensor(at((2 + wg) * kT), typename Cfg::Tile{}));
    Tensor acc_s = partition_fragment_C(mma_s, Shape<_64, _64>{});
    Tensor acc_dp = partition_fragment_C(mma_s, Shape<_64, _64>{});
    // dS of the step whose dQ product is next, as the register A operand of that product.
    Tensor rdS = make_tensor_like<Elem>(acc_s);
    Tensor tOrdS = make_tensor(rdS.data(), acc_as_gmma_a_layout(rdS.layout()));
    const int lane_shift = 2 * (tid % 4);  // this thread's first key column within 8
    // No bits, causal: key j is visible to query row i iff j <= i + Lk - Lq.
    int last_key[2];
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      last_key[r] = p.causal ? q0 + qw + get<0>(cS(make_coord(make_coord(0, r, 0), 0, 0))) +
                                   p.Lk - p.Lq
                             : INT_MAX;
    }

    auto issue_scores = [&](int i) {
      const int s = i % kStages;
      ClusterBarrier::wait(full + s, (i / kStages) & 1);
      const int kv = Cfg::kKvOff + s * 2 * kT;
      Tensor tSrK = thr_s.partition_fragment_B(make_tensor(at(kv), typename Cfg::Tile{}));
      Tensor tSrV = thr_s.partition_fragment_B(make_tensor(at(kv + kT), typename Cfg::Tile{}));
      wgmma_issue<false>(mma_s, tSrQ, tSrK, acc_s, /*zero=*/true);
      wgmma_issue<false>(mma_s, tSrdO, tSrV, acc_dp, /*zero=*/true);
    };
    auto issue_dq = [&](int i) {
      const int kv = Cfg::kKvOff + (i % kStages) * 2 * kT;
      Tensor tBKt = thr_g.partition_fragment_B(make_tensor(at(kv), typename Cfg::TileT{}));
      wgmma_issue<true>(mma_g, tOrdS, tBKt, acc_dq, /*zero=*/false);
    };
    // Scores and dP of step i (waited for) -> dS in acc_s (fp32). The row's bits hold the mask,
    // the range and causality; columns past the list are invisible (their bits are not set
    // there either way, but the stage may hold an earlier step's word).
    auto to_ds = [&](int i) {
      const int s = i % kStages;
      const char* bits_smem = smem + Cfg::kBitsOff + s * Cfg::kBitsBytes;
      const char* bias_smem = smem + Cfg::kBiasOff + s * Cfg::kBiasBytes;
      const int limit = n_keys - i * kBN;
      // Columns outer: a column pair's bias, key indices and range test serve both rows.
      uint64_t words[2];
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int row = qw + get<0>(cS(make_coord(make_coord(0, r, 0), 0, 0)));
        words[r] = kBits ? reinterpret_cast<const uint64_t*>(bits_smem)[row] >> lane_shift : 0;
      }
      CUTE_UNROLL
      for (int gi = 0; gi < kGroups; ++gi) {
        const int c = get<1>(cS(make_coord(make_coord(0, 0, gi), 0, 0)));  // 8 gi + lane_shift
        float b0 = 0.f, b1 = 0.f;
        if constexpr (kHasBias) {
          __align__(4) Elem two[2];
          *reinterpret_cast<uint32_t*>(two) =
              *reinterpret_cast<const uint32_t*>(bias_smem + c * int(sizeof(Elem)));
          b0 = float(two[0]);
          b1 = float(two[1]);
        }
        int2 keys = make_int2(0, 0);
        if constexpr (!kBits) keys = *reinterpret_cast<const int2*>(bits_smem + c * 4);
        const uint32_t in_list = uint32_t(c < limit) | (uint32_t(c + 1 < limit) << 1);
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) {
          uint32_t pair;
          if constexpr (kBits) {
            pair = uint32_t(words[r] >> (8 * gi)) & in_list;
          } else {
            pair = (uint32_t(keys.x <= last_key[r]) | (uint32_t(keys.y <= last_key[r]) << 1)) &
                   in_list;
          }
          CUTE_UNROLL
          for (int c2 = 0; c2 < 2; ++c2) {
            const auto e = make_coord(make_coord(c2, r, gi), 0, 0);
            const bool live = ((pair >> c2) & 1u) != 0u;
            if constexpr (kSoftcap) {
              float dt;
              const float x = score<kSoftcap>(acc_s(e), p, dt) + (c2 == 0 ? b0 : b1);
              const float pr = live ? __expf(x - row_lse[r]) : 0.f;
              acc_s(e) = pr * (acc_dp(e) - row_delta[r]) * dt;
            } else {
              // Base 2: one FFMA and one EX2 (the scale, log2 e and lse folded in).
              const float b2 = kHasBias ? (c2 == 0 ? b0 : b1) * kLog2e - row_lse2[r] : -row_lse2[r];
              const float pr = live ? exp2f(fmaf(acc_s(e), scale2, b2)) : 0.f;
              acc_s(e) = pr * (acc_dp(e) - row_delta[r]);
            }
          }
        }
      }
    };
    auto to_operand = [&] {
      CUTE_UNROLL
      for (int e = 0; e < size(acc_s); ++e) rdS(e) = Elem(acc_s(e));
    };

    ClusterBarrier::wait(q_full, 0);
    issue_scores(0);
    wgmma_wait<0>(acc_s);
    warpgroup_fence_operand(acc_dp);
    to_ds(0);
    to_operand();
    for (int i = 1; i < n_steps; ++i) {
      issue_scores(i);
      issue_dq(i - 1);
      wgmma_wait<1>(acc_s);  // batches complete in order: S / dP of step i are ready
      warpgroup_fence_operand(acc_dp);
      to_ds(i);
      wgmma_wait<0>(acc_dq);
      warpgroup_fence_operand(rdS);
      stage_released(empty + (i - 1) % kStages);  // step i - 1's K was read by its dQ product
      to_operand();
    }
    issue_dq(n_steps - 1);
    wgmma_wait<0>(acc_dq);
    warpgroup_fence_operand(rdS);
    stage_released(empty + (n_steps - 1) % kStages);
  }

  // Rows of a tile with no listed key get dQ = 0.
  if (!p.need_dq) return;
  Tensor cQ = thr_g.partition_C(make_identity_tensor(Shape<_64, Int<kD>>{}));
  Elem* dq = reinterpret_cast<Elem*>(p.dq) + int64_t(b) * p.dq_sb + int64_t(h) * p.dq_sh;
  store_wg_rows(dq, p.dq_sl, q0 + qw, p.Lq, p.D, p.scale, acc_dq, cQ);
}

template <bool kSoftcap, bool kBits>
static cudaError_t launch_dq_gathered(const BwdParams& p, cudaStream_t stream) {
  using Cfg = Sm90DqGatherConfig<kHeadDimBucket>;
  auto kernel = &dq_gathered_kernel_sm90<kSoftcap, kBits>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid = q_tile_grid((p.Lq + Cfg::kBlockM - 1) / Cfg::kBlockM, p.B, p.H, p.Hkv);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t run_dq_gathered_sm90(const BwdParams& p, cudaStream_t stream) {
  if constexpr (kHasMask && !kPacked) {
    if (p.g.bits != nullptr) {
      return p.softcap > 0.f ? launch_dq_gathered<true, true>(p, stream)
                             : launch_dq_gathered<false, true>(p, stream);
    }
    return p.softcap > 0.f ? launch_dq_gathered<true, false>(p, stream)
                           : launch_dq_gathered<false, false>(p, stream);
  }
  return cudaErrorNotSupported;  // the host asks bwd_gathers() first
}

bool bwd_sm90_gathers() { return kHasMask && !kPacked; }
int dq_gathered_block_m() { return Sm90DqGatherConfig<kHeadDimBucket>::kBlockM; }

}  // namespace flash_dmattn

#endif  // FLASH_DMATTN_SM90_BWD
