// Hopper backward kernels (sm_90a, head dims up to 128): the split of flash_bwd.cu -- no
// atomics, so gradients are bitwise reproducible and deterministic=True costs nothing -- with
// every product on warpgroup MMAs.
//
// * dkdv_kernel_sm90: one CTA per (128-key tile, b * Hkv + hkv), warp-specialised: a producer
//   warpgroup copies K / V once and each step's Q, dO, lse, delta, mask and bias tiles into two
//   mbarrier stages (a per-element mask transposed to one word of query bits per key); two
//   consumer warpgroups of 64 keys each run, for each query head of the group and each of its
//   live 64-query tiles:
//     S^T = K Q^T and dP^T = V dO^T       both operands in shared memory, issued as one batch
//     P^T = exp(S^T - lse), dS^T = P^T (dP^T - delta)   (+ per-key dbias: row sums of dS^T)
//     dV += P^T dO and dK += dS^T Q       P^T, dS^T from registers; dO, Q read as transposes
// * dq_kernel_sm90: one CTA per (64-query tile, b * H + h). Of each live 128-key tile the two
//   warpgroups take 64 keys each: S = Q K^T, dP = dO V^T, dS, dQ += dS K. At the end warpgroup
//   1's partial dQ is added to warpgroup 0's through shared memory, in a fixed order. Writes the
//   gradient of a full per-element bias (dS) on the way.
// * Fused dQ (p.dq_accum set: deterministic=False and no full per-element dbias): the dK/dV
//   kernel also computes dQ_partial = dS K of each step from its dS^T, staged in shared memory,
//   and adds it to an fp32 dQ accumulator with one bulk asynchronous reduction per warpgroup
//   and step; dq_kernel_sm90 is skipped and a conversion kernel writes dQ. Five products per step instead of 4 + 3 across two kernels,
//   at the price of run-to-run bitwise reproducibility (the order of the additions varies).
// * Key intervals (p.intervals, kIntervals): dkdv_kernel_sm90 walks the planner's key blocks
//   instead of key tiles: a CTA copies its block's 128 K / V rows by index, walks the query
//   tiles of one segment of the block's query range (segments cut at multiples of
//   p.iv.segment_rows, so long ranges spread over CTAs), tests each key's interval per element
//   and always fuses dQ. Blocks share keys with no other block, but segments of one block do:
//   dK / dV (and the per-key dbias) are added into zeroed fp32 buffers by atomics.
// * Gathered dQ (p.gather: the forward's gathered key lists, or a per-key mask's live keys): the
//   warp-specialised kernel of flash_dq_gathered_sm90.cu computes dQ instead of dq_kernel_sm90
//   or the fused path, and the dK/dV kernel runs without fused dQ.
// dQ kernel: the next step's K/V and mask/bias tiles are loaded with cp.async into the other of
// two stages while this step computes. Both kernels walk the
// host's live-tile lists, built at 64 queries x 128 keys (bwd_block_m / bwd_block_n).
//
// This file holds the two kernels and the launch; their configuration (tiles, shared-memory
// layouts, register budgets) is flash_dmattn/bwd_sm90_config.cuh, the fused dQ steps and the
// accumulator's conversion flash_dmattn/bwd_sm90_fused_dq.cuh.
#include "flash_dmattn/kernel_common.cuh"

#if FLASH_DMATTN_SM90_BWD

#include "flash_dmattn/dropout.cuh"
#include "flash_dmattn/pipeline.cuh"
#include "flash_dmattn/wgmma.cuh"
#include "flash_dmattn/bwd_sm90_config.cuh"
#include "flash_dmattn/bwd_sm90_fused_dq.cuh"

namespace flash_dmattn {

void launch_delta(const BwdParams& p, cudaStream_t stream);  // flash_bwd.cu
cudaError_t run_dq_gathered_sm90(const BwdParams& p, cudaStream_t stream);  // flash_dq_gathered_sm90.cu

// ---------------------------------------------------------------------------------------------
// dK, dV (+ per-key dbias partials)
// ---------------------------------------------------------------------------------------------
// Warp-specialised: the producer warpgroup copies K / V once, then Q, dO, lse, delta and the
// mask / bias tile of every step (query head of the group x live query tile) into one of two
// stages, each with a full mbarrier (cp.async completion) and an empty one (consumer warps
// done reading). The consumers never meet at a CTA barrier: one warpgroup's scores and softmax
// run while the other's products are on the tensor cores. With fused dQ at kHD = 128 they still
// exchange their dS^T halves once a step (kBarDsExchange), and a warpgroup overwrites its dS^T
// buffer only after the other finished reading it (kBarDsFree).
// kDropout (p.drop, dropout.cuh): with Z the keep-mask scaled by 1 / (1 - p), dV += (P Z)^T dO
// and dS = P (dP Z - delta), delta = rowsum(dO O) of the dropped output; the scale of dV is
// applied once, when it is stored.
template <bool kSoftcap, bool kIntervals, bool kDropout>
__global__ void __launch_bounds__(Sm90BwdConfig<kHeadDimBucket>::kKvThreads, 1)
    dkdv_kernel_sm90(const BwdParams p) {
  using Cfg = Sm90BwdConfig<kHeadDimBucket>;
  constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kD = kHeadDimBucket, kT = Cfg::kT;
  using MaskT = typename Cfg::MaskTile;
  using BiasT = typename Cfg::BiasTile;
  extern __shared__ __align__(1024) char smem[];
  float* lse_s = reinterpret_cast<float*>(smem + Cfg::kKvLseOff);
  float* delta_s = lse_s + 2 * kBM;
  char* mask_smem = smem + Cfg::kKvMaskOff;
  char* bias_smem = smem + Cfg::kKvBiasOff;
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(smem + Cfg::kKvBarOff);
  uint64_t* full = kv_full + 1;   // [2]
  uint64_t* empty = kv_full + 3;  // [2]
  int* step_info = reinterpret_cast<int*>(smem + Cfg::kKvInfoOff);  // [2]

  int n_block, slot;
  // Key intervals: this CTA's key block (its keys' indices, -1 pads) and query rows.
  const int32_t* blk_keys = nullptr;
  int iv_first = 0, iv_steps = 0;
  if constexpr (kIntervals) {
    const KeyIntervalLists& iv = p.iv;
    n_block = 0;
    slot = blockIdx.x / iv.blocks_per_row;  // mask row b * Hkv + kv head
    blk_keys = iv.blk_keys + int64_t(blockIdx.x) * kBN;
    const int lo = max(iv.blk_qlo[blockIdx.x], int(blockIdx.y) * iv.segment_rows);
    const int hi = min(iv.blk_qhi[blockIdx.x], int(blockIdx.y + 1) * iv.segment_rows);
    if (lo < hi) {
      iv_first = lo / kBM;
      iv_steps = (hi + kBM - 1) / kBM - iv_first;
    }
  } else {
    dkdv_block_of(p.causal, n_block, slot);
  }
  const int group = p.H / p.Hkv;
  const int b = slot / p.Hkv, hkv = slot % p.Hkv;
  const int k0 = n_block * kBN;
  const SeqRows sr = seq_rows(p, b);
  // Lengths read where used: dense calls straight from the parameters (kept uniform).
  const auto Lq = [&] { return seq_lq(p, sr); };
  const auto Lk = [&] { return seq_lk(p, sr); };
  // Packed calls size the grid by the longest sequence: tiles past this one's end do nothing.
  if (kPacked && k0 >= Lk()) return;
  const int m_tiles = (Lq() + kBM - 1) / kBM;
  // The query tiles of head hh of the group: (list or nullptr, first, count, key_partial).
  struct HeadWalk {
    const int32_t* list;
    int first, steps;
    bool key_partial;
    __device__ int tile(int i) const { return list ? (list[i] >> 1) : first + i; }
  };
  auto walk_of = [&](int hh) {
    HeadWalk w;
    if constexpr (kIntervals) {
      w = {nullptr, iv_first, iv_steps, true};
    } else {
      w.list = dkdv_query_tiles<kBM, kBN>(p, sr, b, hkv * group + hh, n_block, m_tiles, w.steps,
                                          w.first, w.key_partial);
    }
    return w;
  };

  // Steps over all heads of the group: a CTA with none (a dead key tile) reads no K / V.
  int total_steps = 0;
  for (int hh = 0; hh < group; ++hh) total_steps += walk_of(hh).steps;

  if (threadIdx.x == 0) {
    ClusterBarrier::init(kv_full, Cfg::kKvProducerThreads);
    for (int s = 0; s < 2; ++s) {
      ClusterBarrier::init(full + s, Cfg::kKvProducerThreads);
      ClusterBarrier::init(empty + s, Cfg::kThreads / 32);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  // ---- Producer warpgroup.
  if (threadIdx.x < Cfg::kKvProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kKvProducerRegs>();
    const int ptid = threadIdx.x;
    constexpr int kPT = Cfg::kKvProducerThreads;
    auto load64 = [&](const Elem* g, int64_t row_stride, int rows_valid, char* dst) {
      load_tile_swizzled<kD, Cfg::kAtomK, kPT, 64, /*kRolled=*/true>(g, row_stride, rows_valid,
                                                                      p.D, dst, ptid);
    };
    const Elem* kg = reinterpret_cast<const Elem*>(p.k) + int64_t(b) * p.k_sb +
                     (sr.k_row0 + k0) * p.k_sl + int64_t(hkv) * p.k_sh;
    const Elem* vg = reinterpret_cast<const Elem*>(p.v) + int64_t(b) * p.v_sb +
                     (sr.k_row0 + k0) * p.v_sl + int64_t(hkv) * p.v_sh;
    if (total_steps == 0) return;
    CUTE_UNROLL
    for (int w = 0; w < 2; ++w) {
      if constexpr (kIntervals) {
        RowIndices<Cfg::kAtomK, kPT, 64> rows;
        rows.fetch(blk_keys + 64 * w, 64, ptid);  // -1 pads: zero rows
        load_rows_by_index<kD, Cfg::kAtomK, kPT, 64>(kg, p.k_sl, rows, p.D, smem + w * kT, ptid);
        load_rows_by_index<kD, Cfg::kAtomK, kPT, 64>(vg, p.v_sl, rows, p.D,
                                                     smem + (2 + w) * kT, ptid);
      } else {
        load64(kg + int64_t(64 * w) * p.k_sl, p.k_sl, Lk() - k0 - 64 * w, smem + w * kT);
        load64(vg + int64_t(64 * w) * p.v_sl, p.v_sl, Lk() - k0 - 64 * w, smem + (2 + w) * kT);
      }
    }
    stage_filled(kv_full);
    int step = 0;
    for (int hh = 0; hh < group; ++hh) {
      const int h = hkv * group + hh;
      const HeadWalk walk = walk_of(hh);
      const BwdHeadOperands g = bwd_head_operands(p, sr, b, h);
      // This thread's two keys of the head's key bits (when given), less the query word.
      const uint64_t* key_bits = p.kbits + int64_t(b) * p.kbits_sb +
                                 int64_t(h / p.kbits_hdiv) * p.kbits_sh + k0 + 2 * ptid;
      // A list's entries are read a step ahead: the load is synchronous (the step's addresses
      // need it), so read where used it put a global round trip on every step.
      int entry_next = walk.list != nullptr && walk.steps > 0 ? walk.list[0] : 0;
      for (int i = 0; i < walk.steps; ++i, ++step) {
        const int st = step & 1;
        const int entry = entry_next;
        if (walk.list != nullptr && i + 1 < walk.steps) entry_next = walk.list[i + 1];
        const int tile = walk.list != nullptr ? entry >> 1 : walk.first + i;
        const int q0 = tile * kBM;
        bool partial;
        if constexpr (kIntervals) {
          partial = true;  // the consumers test every key's interval
        } else {
          partial = walk.list != nullptr
                        ? (entry & 1) != 0
                        : dkdv_tile_partial<kBM, kBN>(p, sr, walk.key_partial, k0, q0);
        }
        ClusterBarrier::wait(empty + st, ((step >> 1) & 1) ^ 1);
        const bool mask_bits = kHasMask && partial && p.mask.sq != 0;
        if constexpr (kHasMask && !kIntervals) {
          if (mask_bits && p.kbits != nullptr) {
            // The summary's key bits: 8 bytes a key, copied like the rest of the stage.
            static_assert(kBM == 64 && Cfg::kKeyBitsBytes / 16 <= kPT, "one word a key, one chunk a thread");
            if (ptid < Cfg::kKeyBitsBytes / 16) {
              cp_async_16(mask_smem + MaskT::kBytes + st * Cfg::kKeyBitsBytes + 16 * ptid,
                          key_bits + int64_t(tile) * p.kbits_sw, 16);
            }
          } else if (mask_bits) {
            // Raw bytes first, as their own group: transposed below while the rest lands.
            Cfg::MaskTileP::template load<true>(mask_smem, p.mask, g.mask, q0, k0, Lq(), Lk(), ptid);
            cp_async_fence();
          } else if (partial) {
            Cfg::MaskTileP::template load<true>(mask_smem + st * MaskT::kBytes, p.mask, g.mask, q0, k0, Lq(),
                                 Lk(), ptid);
          }
        }
        load64(g.q + int64_t(q0) * p.q_sl, p.q_sl, Lq() - q0, smem + (4 + 2 * st) * kT);
        load64(g.dout + int64_t(q0) * p.do_sl, p.do_sl, Lq() - q0, smem + (5 + 2 * st) * kT);
        load_floats<kBM>(lse_s + st * kBM, g.lse + q0, Lq() - q0, ptid, kPT);
        load_floats<kBM>(delta_s + st * kBM, g.delta + q0, Lq() - q0, ptid, kPT);
        if constexpr (kHasBias && !kIntervals) {
          Cfg::BiasTileP::template load<true>(bias_smem + st * BiasT::kBytes, p.bias, g.bias, q0, k0, Lq(),
                               Lk(), ptid);
        }
        if constexpr (kHasMask && !kIntervals) {
          if (mask_bits && p.kbits == nullptr) {
            cp_async_wait<0>();  // the committed group: this thread's raw mask chunks
            named_barrier_sync(kBarProducer, kPT);  // everyone's
            // Key ptid's bits over the tile's 64 queries (rows past Lq hold stale bytes: the
            // consumers' query bound excludes them).
            uint64_t bits = 0;
#pragma unroll 8
            for (int q = 0; q < kBM; ++q) {
              bits |= uint64_t(mask_smem[q * MaskT::kPitch + ptid] != 0) << q;
            }
            reinterpret_cast<uint64_t*>(mask_smem + MaskT::kBytes + st * Cfg::kKeyBitsBytes)[ptid] =
                bits;
            named_barrier_sync(kBarProducer, kPT);  // raw bytes read before the next step's copy
          }
        }
        if (ptid == 0) step_info[st] = (tile << 1) | int(partial);
        stage_filled(full + st);
      }
    }
    // Copies still in flight must not outlive their thread.
    cp_async_wait<0>();
    return;
  }

  // ---- Consumer warpgroups: 64 keys each.
  cutlass::arch::warpgroup_reg_alloc<Cfg::kKvConsumerRegs>();
  const int tid = threadIdx.x - Cfg::kKvProducerThreads, wg = tid / 128, lane = tid % 32;
  const int kw = 64 * wg;  // this warpgroup's keys: k0 + kw + [0, 64)
  // Query tiles per (b, h) of the fused-dQ accumulator (dense calls only).
  const int accum_m_tiles = (p.Lq + kBM - 1) / kBM;
  auto at = [&](int off) { return make_smem_ptr(reinterpret_cast<Elem*>(smem + off)); };

  typename Cfg::MmaScores mma_s;
  typename Cfg::MmaGrad mma_g;
  auto thr_s = mma_s.get_thread_slice(tid % 128);
  auto thr_g = mma_g.get_thread_slice(tid % 128);
  Tensor tSrK = thr_s.partition_fragment_A(make_tensor(at(wg * kT), typename Cfg::Tile{}));
  Tensor tSrV = thr_s.partition_fragment_A(make_tensor(at((2 + wg) * kT), typename Cfg::Tile{}));
  Tensor acc_dk = partition_fragment_C(mma_g, Shape<_64, Int<kD>>{});
  Tensor acc_dv = partition_fragment_C(mma_g, Shape<_64, Int<kD>>{});
  clear(acc_dk);
  clear(acc_dv);
  // (key, query) of each S^T accumulator value, within this warpgroup's 64 x 64 tile.
  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<_64, _64>{}));
  constexpr int kGroups = decltype(size<0, 2>(cS))::value;
  const bool mask_rows = p.mask.sq != 0, bias_rows = p.bias.sq != 0;
  const bool keys_dbias = kHasBias && p.dbias_keys != nullptr;
  // Packed modules never fuse dQ (the host runs the dQ kernel): compiled out, its registers too.
  const bool fused_dq = !kPacked && p.dq_accum != nullptr;
  typename Cfg::MmaDq mma_q;
  auto thr_q = mma_q.get_thread_slice(tid % 128);
  // Fused dQ at kHD = 128 reads the other warpgroup's dS^T buffer: before overwriting its own,
  // a warpgroup waits until the other has read it (every step after the first).
  const bool exchange = fused_dq && Cfg::kSplitD;
  if (total_steps > 0) ClusterBarrier::wait(kv_full, 0);
  // Key intervals: this thread's two keys (one per r), the query indices [lo, hi) that see
  // each (causality folded in; -1 pads see none) and, per head, their bias.
  int iv_key[2] = {-1, -1}, iv_lo[2] = {0, 0}, iv_hi[2] = {0, 0};
  if constexpr (kIntervals) {
    const KeyIntervalLists& iv = p.iv;
    const int off = p.Lk - p.Lq;  // query index i sits at key position i + off
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int j = blk_keys[kw + get<0>(cS(make_coord(make_coord(0, r, 0), 0, 0)))];
      iv_key[r] = j;
      iv_lo[r] = 1 << 30;
      iv_hi[r] = -(1 << 30);
      if (j >= 0) {
        const int32_t* bnd = iv.bounds + int64_t(slot) * p.Lk + j;
        iv_lo[r] = (p.causal ? max(bnd[0], j) : bnd[0]) - off;
        iv_hi[r] = bnd[iv.bounds_plane] - off;
      }
    }
  }
  // Dropout: this thread's two keys (rows of S^T; -1 pads of a key-interval block draw key 0,
  // unseen).
  int drop_key[2] = {0, 0};
  if constexpr (kDropout) {
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      drop_key[r] = kIntervals ? max(iv_key[r], 0)
                               : k0 + kw + get<0>(cS(make_coord(make_coord(0, r, 0), 0, 0)));
    }
  }
  int step = 0;
  for (int hh = 0; hh < group; ++hh) {
    const int h = hkv * group + hh;
    const int steps = walk_of(hh).steps;
    DropoutKey dkey;
    if constexpr (kDropout) dkey = dropout_key(p.drop, b, h);
    float key_dbias[2] = {0.f, 0.f};
    float iv_bias[2] = {0.f, 0.f};
    if constexpr (kIntervals && kHasBias) {
      const KeyIntervalLists& iv = p.iv;
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        if (iv_key[r] >= 0) {
          iv_bias[r] = float(reinterpret_cast<const Elem*>(iv.bias)[
              int64_t(b) * iv.bias_sb + int64_t(h / iv.bias_hdiv) * iv.bias_sh +
              int64_t(iv_key[r]) * iv.bias_sk]);
        }
      }
    }

    for (int i = 0; i < steps; ++i, ++step) {
      const int st = step & 1;
      ClusterBarrier::wait(full + st, (step >> 1) & 1);
      // The producer's entry: no list read (global latency) on the consumers' path.
      const int entry = step_info[st];
      const int q0 = (entry >> 1) * kBM;
      const bool partial = (entry & 1) != 0;

      Tensor acc_s = partition_fragment_C(mma_s, Shape<_64, _64>{});   // S^T
      Tensor acc_dp = partition_fragment_C(mma_s, Shape<_64, _64>{});  // dP^T
      {
        Tensor tSrQ = thr_s.partition_fragment_B(make_tensor(at((4 + 2 * st) * kT), typename Cfg::Tile{}));
        Tensor tSrdO = thr_s.partition_fragment_B(make_tensor(at((5 + 2 * st) * kT), typename Cfg::Tile{}));
        wgmma_issue<false>(mma_s, tSrK, tSrQ, acc_s, /*zero=*/true);
        wgmma_issue<false>(mma_s, tSrV, tSrdO, acc_dp, /*zero=*/true);
        wgmma_wait<0>(acc_s);
        warpgroup_fence_operand(acc_dp);
      }

      const float* lse_t = lse_s + st * kBM;
      const float* delta_t = delta_s + st * kBM;
      const char* mtile = mask_smem + st * MaskT::kBytes;
      const char* btile = bias_smem + st * BiasT::kBytes;
      const bool check = kIntervals || partial || (q0 + kBM > Lq()) || (k0 + kw + 64 > Lk());
      const bool use_mask = kHasMask && !kIntervals && partial;
      // A thread's values of S^T share two keys (one per r) and come in pairs of adjacent
      // queries (c2): per key, the range / causal bounds become one query interval and a mask
      // or bias broadcast over queries one read. The queries are the outer loop so each lse /
      // delta value is read and used once for both keys: with the keys outer, the 16 queries'
      // lse and delta stayed live across the loop and spilled (the per-query mask + bias
      // module).
      int q_lo[2], q_hi[2];  // queries q0 + [q_lo, q_hi) of the tile see key r
      float key_bias[2];
      bool key_mask[2];
      uint64_t query_bits[2];  // key r's bits, from this thread's first query
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        if constexpr (kIntervals) {
          q_lo[r] = iv_lo[r] - q0;
          q_hi[r] = iv_hi[r] - q0;
          key_bias[r] = iv_bias[r];
          key_mask[r] = true;
          query_bits[r] = ~uint64_t(0);
          continue;
        }
        const int kr = kw + get<0>(cS(make_coord(make_coord(0, r, 0), 0, 0)));  // key in the tile
        const int kj = k0 + kr;
        q_lo[r] = 0;
        q_hi[r] = kBM;
        if (check) {
          q_hi[r] = kj < Lk() ? Lq() - q0 : 0;
          if (p.causal) q_lo[r] = kj - (Lk() - Lq()) - q0;
        }
        key_bias[r] = 0.f;
        if constexpr (kHasBias) {
          if (!bias_rows) key_bias[r] = float(BiasT::read(btile, false, 0, kr));
        }
        key_mask[r] = true;
        query_bits[r] = ~uint64_t(0);
        if constexpr (kHasMask) {
          if (use_mask && !mask_rows) key_mask[r] = MaskT::read(mtile, false, 0, kr) != 0;
          if (use_mask && mask_rows) {
            query_bits[r] = reinterpret_cast<const uint64_t*>(mask_smem + MaskT::kBytes +
                                                              st * Cfg::kKeyBitsBytes)[kr] >>
                            (2 * (lane % 4));
          }
        }
      }
      // A tile every element of which is visible, with plain scores and no bias or a per-key
      // one (most steps: whole live tiles off the diagonal): P = 2^(S log2e - lse log2e),
      // one FFMA and one EX2 an element. The general path below costs about three times the
      // instructions (range, mask and causal tests, a 64-bit shift per element), and this
      // element work, not the MMAs, sets the dK/dV time of block-sparse masks (a build without
      // it ran in about half the time).
      // Compiled where it pays (kPlainPath): modules without a bias, whose masks are per key
      // or absent (whole visible tiles); the per-query mask + bias module, where few tiles
      // are whole, measured slower with it.
      bool plain;
      if constexpr (kIntervals) {
        // Every value of this warp's keys x the tile's queries visible (most steps of a
        // selection that keeps its keys for long): the plain path, with the per-key bias.
        const bool whole = (q_lo[0] <= 0) & (q_hi[0] >= kBM) & (q_lo[1] <= 0) & (q_hi[1] >= kBM);
        plain = !kSoftcap && __all_sync(0xffffffffu, whole);
      } else {
        plain = kPlainPath && !kSoftcap && !check && !use_mask && !(kHasBias && bias_rows);
      }
      // Dropout: bit key_rows_bit(g, c2) of drop_bits[r] says whether query
      // q0 + 8 g + 2 (lane % 4) + c2 keeps key r (two evaluations a thread).
      static_assert(kGroups == 8, "dropout_key_rows_bits: 64 queries a step");
      uint32_t drop_bits[2] = {0u, 0u};
      if constexpr (kDropout) {
        dropout_key_rows_bits(dkey, drop_key[0], drop_key[1], q0, lane, drop_bits);
      }
      // P of the value and its dS from P and dP (dropout: P Z and P (dP Z - delta)).
      const float dscale = kDropout ? p.drop.scale : 1.f;
      // bit: key_rows_bit of the value's column.
      auto grads = [&](float pr, float dp, float dl, int r, int bit, float& p_out, float& ds_out) {
        if constexpr (kDropout) {
          const bool keep = ((drop_bits[r] >> bit) & 1u) != 0u;
          ds_out = pr * (keep ? fmaf(dp, dscale, -dl) : -dl);
          p_out = keep ? pr : 0.f;
        } else {
          ds_out = pr * (dp - dl);
          p_out = pr;
        }
      };
      const float scale2 = p.scale * kLog2e;
      if (plain) {
        float key_bias2[2];
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) key_bias2[r] = key_bias[r] * kLog2e;
        CUTE_UNROLL
        for (int g = 0; g < kGroups; ++g) {
          const int qc0 = get<1>(cS(make_coord(make_coord(0, 0, g), 0, 0)));
          CUTE_UNROLL
          for (int c2 = 0; c2 < 2; ++c2) {
            const float l = lse_t[qc0 + c2];
            const float l2 = l == -INFINITY ? INFINITY : l * kLog2e;  // fully masked row: P = 0
            const float dl = delta_t[qc0 + c2];
            CUTE_UNROLL
            for (int r = 0; r < 2; ++r) {
              const auto e = make_coord(make_coord(c2, r, g), 0, 0);
              const float pr = exp2f(fmaf(acc_s(e), scale2, kHasBias ? key_bias2[r] - l2 : -l2));
              float pk, ds;
              grads(pr, acc_dp(e), dl, r, key_rows_bit(g, c2), pk, ds);
              if constexpr (kHasBias) key_dbias[r] += ds;
              acc_s(e) = pk;
              acc_dp(e) = ds;
            }
          }
        }
      }
      CUTE_UNROLL
      for (int g = 0; g < (plain ? 0 : kGroups); ++g) {
        const int qc0 = get<1>(cS(make_coord(make_coord(0, 0, g), 0, 0)));  // even, same for r
        CUTE_UNROLL
        for (int c2 = 0; c2 < 2; ++c2) {
          const int qc = qc0 + c2;
          float l = lse_t[qc];
          l = l == -INFINITY ? INFINITY : l;  // fully masked row: P = 0
          const float dl = delta_t[qc];
          CUTE_UNROLL
          for (int r = 0; r < 2; ++r) {
            const auto e = make_coord(make_coord(c2, r, g), 0, 0);
            float bias = 0.f;
            if constexpr (kHasBias) {
              if (bias_rows) {
                const int kr = kw + get<0>(cS(make_coord(make_coord(0, r, 0), 0, 0)));
                bias = float(BiasT::read(btile, true, qc, kr));
              } else {
                bias = key_bias[r];
              }
            }
            // Bitwise, not short-circuit: no per-element branches.
            bool visible = (qc >= q_lo[r]) & (qc < q_hi[r]) & key_mask[r];
            if constexpr (kHasMask) {
              visible &= ((query_bits[r] >> (8 * g + c2)) & 1u) != 0;  // qc - 2 (lane % 4)
            }
            float dt = 1.f, pr;
            if constexpr (kSoftcap) {
              pr = visible ? __expf(score<kSoftcap>(acc_s(e), p, dt) + bias - l) : 0.f;
            } else {
              pr = visible ? exp2f(fmaf(acc_s(e), scale2, fmaf(bias, kLog2e, -l * kLog2e))) : 0.f;
            }
            float pk, ds;
            grads(pr, acc_dp(e), dl, r, key_rows_bit(g, c2), pk, ds);
            key_dbias[r] += ds;  // unconditional: a branch here costs spills
            acc_s(e) = pk;
            acc_dp(e) = ds * dt;
          }
        }
      }
      Tensor rP = to_type<Elem>(acc_s);
      Tensor rdS = to_type<Elem>(acc_dp);
      if (fused_dq) {
        if (exchange && step > 0) named_barrier_sync(kBarDsFree + (1 - wg), 256);
        stage_ds_t<Cfg>(smem, wg, tid, rdS);
      }
      Tensor tOrP = make_tensor(rP.data(), acc_as_gmma_a_layout(rP.layout()));
      Tensor tOrdS = make_tensor(rdS.data(), acc_as_gmma_a_layout(rdS.layout()));
      Tensor tBdOt = thr_g.partition_fragment_B(make_tensor(at((5 + 2 * st) * kT), typename Cfg::TileT{}));
      Tensor tBQt = thr_g.partition_fragment_B(make_tensor(at((4 + 2 * st) * kT), typename Cfg::TileT{}));
      wgmma_issue<true>(mma_g, tOrP, tBdOt, acc_dv, /*zero=*/false);
      wgmma_issue<true>(mma_g, tOrdS, tBQt, acc_dk, /*zero=*/false);
      Tensor acc_dq = partition_fragment_C(mma_q, Shape<_64, Int<Cfg::kDqN>>{});
      if (fused_dq) issue_fused_dq<Cfg>(mma_q, thr_q, smem, wg, acc_dq);
      wgmma_wait<0>(acc_dv);
      warpgroup_fence_operand(acc_dk);
      warpgroup_fence_operand(tOrP);
      warpgroup_fence_operand(tOrdS);
      // This warp read the stage's last byte (Q^T, dO^T, lse, delta, mask, bias).
      stage_released(empty + st);
      if (fused_dq) {
        warpgroup_fence_operand(acc_dq);
        // Done reading the other warpgroup's dS^T: it may overwrite it for its next step.
        if (exchange && step + 1 < total_steps) named_barrier_arrive(kBarDsFree + wg, 256);
        // Accumulator layout (B, H, query tile, kHD / 32 column blocks, 64, 32).
        float* dst = p.dq_accum + ((int64_t(b) * p.H + h) * accum_m_tiles + q0 / kBM) * (64 * kD) +
                     (Cfg::kSplitD ? wg * 64 * 64 : 0);
        reduce_dq_partial<Cfg>(smem, dst, wg, tid, acc_dq);
      }
    }

    if (kIntervals && keys_dbias) {
      // Segments of one block add their sums for the same keys.
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const float v = quad_sum(key_dbias[r]);
        if (lane % 4 == 0 && iv_key[r] >= 0 && steps > 0) {
          atomicAdd(p.dbias_keys + (int64_t(b) * p.H + h) * p.Lk + iv_key[r], v);
        }
      }
    } else if (keys_dbias) {
      // Each key's row of S^T lies in one quad of one warpgroup: its sum over this head's
      // queries is a quad reduction, written once (no atomics).
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const float v = quad_sum(key_dbias[r]);
        const int kj = k0 + kw + get<0>(cS(make_coord(make_coord(0, r, 0), 0, 0)));
        if (lane % 4 == 0 && kj < Lk()) {
          p.dbias_keys[dbias_key_offset(p, sr, b, h) + kj] = v;
        }
      }
    }
  }

  // The stage must stay allocated until the last reduction has completed.
  if (fused_dq && tid % 128 == 0) bulk_wait_all<0>();
  if (!p.need_dkv) return;
  Tensor cKV = thr_g.partition_C(make_identity_tensor(Shape<_64, Int<kD>>{}));
  // Dropout's 1 / (1 - p) of the kept probabilities dV summed.
  const float dv_scale = kDropout ? p.drop.scale : 1.f;
  if constexpr (kIntervals) {
    // fp32 (B, Lk, Hkv, D) buffers, rows by key index; a CTA without steps adds nothing.
    if (total_steps == 0) return;
    float* dk = reinterpret_cast<float*>(p.dk) + int64_t(b) * p.dk_sb + int64_t(hkv) * p.dk_sh;
    float* dv = reinterpret_cast<float*>(p.dv) + int64_t(b) * p.dv_sb + int64_t(hkv) * p.dv_sh;
    constexpr int kGroupsO = decltype(size<0, 2>(acc_dk))::value;
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int j = iv_key[r];  // the same row of the 64-key tile as S^T's value (0, r, 0)
      if (j < 0) continue;
      float* dkr = dk + int64_t(j) * p.dk_sl;
      float* dvr = dv + int64_t(j) * p.dv_sl;
      CUTE_UNROLL
      for (int g = 0; g < kGroupsO; ++g) {
        const int col = get<1>(cKV(make_coord(0, r, g), 0, 0));
        if (col < p.D) {
          atomicAdd(reinterpret_cast<float2*>(dkr + col),
                    make_float2(acc_dk(make_coord(0, r, g), 0, 0) * p.scale,
                                acc_dk(make_coord(1, r, g), 0, 0) * p.scale));
          atomicAdd(reinterpret_cast<float2*>(dvr + col),
                    make_float2(acc_dv(make_coord(0, r, g), 0, 0) * dv_scale,
                                acc_dv(make_coord(1, r, g), 0, 0) * dv_scale));
        }
      }
    }
    return;
  }
  Elem* dk = reinterpret_cast<Elem*>(p.dk) + int64_t(b) * p.dk_sb + sr.k_row0 * p.dk_sl +
             int64_t(hkv) * p.dk_sh;
  Elem* dv = reinterpret_cast<Elem*>(p.dv) + int64_t(b) * p.dv_sb + sr.k_row0 * p.dv_sl +
             int64_t(hkv) * p.dv_sh;
  store_wg_rows(dk, p.dk_sl, k0 + kw, Lk(), p.D, p.scale, acc_dk, cKV);
  store_wg_rows(dv, p.dv_sl, k0 + kw, Lk(), p.D, dv_scale, acc_dv, cKV);
}

// ---------------------------------------------------------------------------------------------
// dQ (+ full dbias)
// ---------------------------------------------------------------------------------------------
// kDropout: dS = P (dP Z - delta), Z the keep-mask scaled by 1 / (1 - p) (p.drop).
template <bool kSoftcap, bool kDropout>
__global__ void __launch_bounds__(256, 1) dq_kernel_sm90(const BwdParams p) {
  using Cfg = Sm90BwdConfig<kHeadDimBucket>;
  constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kD = kHeadDimBucket, kT = Cfg::kT;
  using MaskT = typename Cfg::MaskTile;
  using BiasT = typename Cfg::BiasTile;
  extern __shared__ __align__(1024) char smem[];
  char* mask_smem = smem + Cfg::kQMaskOff;
  char* bias_smem = smem + Cfg::kQBiasOff;

  const int tid = threadIdx.x, wg = tid / 128;
  const QTileCoord coord = q_tile_coord(p.H, p.Hkv);
  const int m_block = coord.m_block, b = coord.b, h = coord.h;
  const int q0 = m_block * kBM;
  const int kw = 64 * wg;  // this warpgroup's keys of each tile: k0 + kw + [0, 64)
  auto at = [&](int off) { return make_smem_ptr(reinterpret_cast<Elem*>(smem + off)); };

  const SeqRows sr = seq_rows(p, b);
  // Lengths read where used: dense calls straight from the parameters (kept uniform).
  const auto Lq = [&] { return seq_lq(p, sr); };
  const auto Lk = [&] { return seq_lk(p, sr); };
  const int32_t* list;
  const int n_steps = key_tiles_of<kBM, kBN>(p, sr, b, h, m_block, q0, list);

  typename Cfg::MmaScores mma_s;
  typename Cfg::MmaGrad mma_g;
  auto thr_s = mma_s.get_thread_slice(tid % 128);
  auto thr_g = mma_g.get_thread_slice(tid % 128);
  Tensor acc_dq = partition_fragment_C(mma_g, Shape<_64, Int<kD>>{});
  clear(acc_dq);
  // (query, key) of each S accumulator value, within this warpgroup's 64 x 64 tile.
  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<_64, _64>{}));
  constexpr int kGroups = decltype(size<0, 2>(cS))::value;

  if (n_steps > 0) {
    const FwdTileWalk<kBN> walk(p, sr, b, h, q0, list);
    const float* lse_g = p.lse + lse_offset(p, sr, b, h);
    const float* delta_g = p.delta + lse_offset(p, sr, b, h);
    const Elem* dog = reinterpret_cast<const Elem*>(p.dout) + int64_t(b) * p.do_sb +
                      (sr.q_row0 + q0) * p.do_sl + int64_t(h) * p.do_sh;
    // K(s, w) at (2 + 4 s + w) tiles, V(s, w) at (4 + 4 s + w).
    auto issue = [&](int i) {
      const int k0 = walk.tile(i) * kBN, st = i & 1;
      CUTE_UNROLL
      for (int w = 0; w < 2; ++w) {
        const int kk = k0 + 64 * w;
        load_tile64<Cfg>(walk.k + int64_t(kk) * p.k_sl, p.k_sl, Lk() - kk, p.D,
                         smem + (2 + 4 * st + w) * kT, tid);
        load_tile64<Cfg>(walk.v + int64_t(kk) * p.v_sl, p.v_sl, Lk() - kk, p.D,
                         smem + (4 + 4 * st + w) * kT, tid);
      }
      if constexpr (kHasMask) {
        if (walk.partial(p, i, k0, Lq(), Lk()))
          MaskT::load(mask_smem + st * MaskT::kBytes, p.mask, walk.mask, q0, k0, Lq(), Lk(), tid);
      }
      if constexpr (kHasBias) {
        BiasT::load(bias_smem + st * BiasT::kBytes, p.bias, walk.bias, q0, k0, Lq(), Lk(), tid);
      }
    };

    load_tile64<Cfg>(walk.q, p.q_sl, Lq() - q0, p.D, smem, tid);
    load_tile64<Cfg>(dog, p.do_sl, Lq() - q0, p.D, smem + kT, tid);
    issue(0);
    cp_async_fence();

    float row_lse[2], row_delta[2];
    load_row_stats(lse_g, delta_g, q0, Lq(), cS, row_lse, row_delta);
    Tensor tSrQ = thr_s.partition_fragment_A(make_tensor(at(0), typename Cfg::Tile{}));
    Tensor tSrdO = thr_s.partition_fragment_A(make_tensor(at(kT), typename Cfg::Tile{}));
    const bool mask_rows = p.mask.sq != 0, bias_rows = p.bias.sq != 0;
    DropoutKey dkey;
    if constexpr (kDropout) dkey = dropout_key(p.drop, b, h);

    for (int i = 0; i < n_steps; ++i) {
      const int st = i & 1, k0 = walk.tile(i) * kBN;
      const bool partial = walk.partial(p, i, k0, Lq(), Lk());
      cp_async_wait<0>();
      fence_async_shared();
      __syncthreads();  // step i's tiles landed; both warpgroups are done with step i - 1's stage
      if (i + 1 < n_steps) issue(i + 1);
      cp_async_fence();

      const int k_off = (2 + 4 * st + wg) * kT, v_off = (4 + 4 * st + wg) * kT;
      Tensor acc_s = partition_fragment_C(mma_s, Shape<_64, _64>{});
      Tensor acc_dp = partition_fragment_C(mma_s, Shape<_64, _64>{});
      {
        Tensor tSrK = thr_s.partition_fragment_B(make_tensor(at(k_off), typename Cfg::Tile{}));
        Tensor tSrV = thr_s.partition_fragment_B(make_tensor(at(v_off), typename Cfg::Tile{}));
        wgmma_issue<false>(mma_s, tSrQ, tSrK, acc_s, /*zero=*/true);
        wgmma_issue<false>(mma_s, tSrdO, tSrV, acc_dp, /*zero=*/true);
        wgmma_wait<0>(acc_s);
        warpgroup_fence_operand(acc_dp);
      }

      const char* mtile = mask_smem + st * MaskT::kBytes;
      const char* btile = bias_smem + st * BiasT::kBytes;
      const bool check = partial || (k0 + kw + 64 > Lk());
      const bool use_mask = kHasMask && partial;
      // Dropout: this warpgroup's 64 keys of the thread's two rows (a warp's 16 rows are one
      // 16-row group: q0 is a multiple of 64); bit 2 g + c2 of drop_bits[r] for key
      // k0 + kw + 8 g + 2 (lane % 4) + c2.
      uint32_t drop_bits[2] = {0u, 0u};
      if constexpr (kDropout) {
        const int row0 = q0 + get<0>(cS(make_coord(make_coord(0, 0, 0), 0, 0)));
        const int kk = k0 + kw;
        dropout_query_rows_bits<64>(dkey, uint32_t(row0) >> 4, tid % 32,
                                    [&](int c) { return kk + c; }, drop_bits);
      }
      // A thread's values come in pairs of adjacent keys (c, c + 1), c even: their mask / bias
      // are read as one 2- / 4-byte word; the causal / ragged bound is one key limit per row.
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int qr = get<0>(cS(make_coord(make_coord(0, r, 0), 0, 0)));
        int limit = Lk() - k0;  // keys k0 + kc with kc < limit are visible to this row
        if (p.causal) limit = min(limit, q0 + qr + Lk() - Lq() - k0 + 1);
        if (!check) limit = kBN;
        CUTE_UNROLL
        for (int g = 0; g < kGroups; ++g) {
          const int kc = kw + get<1>(cS(make_coord(make_coord(0, r, g), 0, 0)));
          float2 b2 = make_float2(0.f, 0.f);
          if constexpr (kHasBias) b2 = BiasT::read_pair(btile, bias_rows ? qr : 0, kc);
          uint32_t m2 = 0x0101u;
          if constexpr (kHasMask) {
            // Read unconditionally (in bounds either way), used only on partial tiles.
            const uint32_t raw = MaskT::read_pair(mtile, mask_rows ? qr : 0, kc);
            m2 = use_mask ? raw : 0x0101u;
          }
          CUTE_UNROLL
          for (int c2 = 0; c2 < 2; ++c2) {
            const auto e = make_coord(make_coord(c2, r, g), 0, 0);
            float dt;
            const float s = score<kSoftcap>(acc_s(e), p, dt) + (c2 == 0 ? b2.x : b2.y);
            const bool visible = (kc + c2 < limit) & (((m2 >> (8 * c2)) & 0xffu) != 0u);
            const float pr = visible ? __expf(s - row_lse[r]) : 0.f;
            float ds;
            if constexpr (kDropout) {
              const bool keep = ((drop_bits[r] >> (2 * g + c2)) & 1u) != 0u;
              ds = pr * (keep ? fmaf(acc_dp(e), p.drop.scale, -row_delta[r]) : -row_delta[r]);
            } else {
              ds = pr * (acc_dp(e) - row_delta[r]);
            }
            if constexpr (kHasBias) {
              if (p.dbias_full != nullptr) {
                const int qi = q0 + qr, kj = k0 + kc + c2;
                if (qi < Lq() && kj < Lk()) {
                  Elem* db = reinterpret_cast<Elem*>(p.dbias_full) + int64_t(b) * p.dbf_sb +
                             int64_t(h) * p.dbf_sh + int64_t(qi) * p.dbf_sq + kj;
                  *db = Elem(ds);
                }
              }
            }
            acc_s(e) = ds * dt;
          }
        }
      }
      Tensor rdS = to_type<Elem>(acc_s);
      Tensor tOrdS = make_tensor(rdS.data(), acc_as_gmma_a_layout(rdS.layout()));
      Tensor tBKt = thr_g.partition_fragment_B(make_tensor(at(k_off), typename Cfg::TileT{}));
      wgmma_issue<true>(mma_g, tOrdS, tBKt, acc_dq, /*zero=*/false);
      wgmma_wait<0>(acc_dq);
      warpgroup_fence_operand(tOrdS);
    }
  }

  if (!p.need_dq) return;
  // Warpgroup 1's partial dQ (its half of every key tile) joins warpgroup 0's through the K/V
  // stages, free now: same fragment layout in both, so thread t adds thread t + 128's values.
  float* red = reinterpret_cast<float*>(smem + 2 * kT);
  constexpr int kVals = decltype(size(acc_dq))::value;
  static_assert(kVals * 128 * 4 <= 8 * kT, "dQ reduction scratch");
  __syncthreads();
  if (wg == 1) {
    CUTE_UNROLL
    for (int e = 0; e < kVals; ++e) red[e * 128 + tid % 128] = acc_dq(e);
  }
  __syncthreads();
  if (wg == 1) return;
  CUTE_UNROLL
  for (int e = 0; e < kVals; ++e) acc_dq(e) += red[e * 128 + tid];
  Tensor cQ = thr_g.partition_C(make_identity_tensor(Shape<_64, Int<kD>>{}));
  Elem* dq = reinterpret_cast<Elem*>(p.dq) + int64_t(b) * p.dq_sb + sr.q_row0 * p.dq_sl +
             int64_t(h) * p.dq_sh;
  store_wg_rows(dq, p.dq_sl, q0, Lq(), p.D, p.scale, acc_dq, cQ);
}

// ---------------------------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------------------------
template <bool kSoftcap>
static cudaError_t launch_bwd_sm90(const BwdParams& p, cudaStream_t stream) {
  using Cfg = Sm90BwdConfig<kHeadDimBucket>;
  launch_delta(p, stream);
  const bool fused_dq = p.dq_accum != nullptr;
  if (p.intervals) {
    // dQ comes from the dK/dV kernel (fused) below.
  } else if (p.need_dq && p.gather) {
    // The host passes gathered lists only with per-key (or no) dbias: nothing else to write.
    cudaError_t err = run_dq_gathered_sm90(p, stream);
    if (err != cudaSuccess) return err;
  } else if ((p.need_dq && !fused_dq) || p.dbias_full != nullptr) {
    auto kernel = &dq_kernel_sm90<kSoftcap, false>;
    if constexpr (FLASH_DMATTN_DROPOUT) {
      if (p.drop.rng != nullptr) kernel = &dq_kernel_sm90<kSoftcap, true>;
    }
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kQSmem);
    if (err != cudaSuccess) return err;
    const dim3 grid = q_tile_grid((p.Lq + Cfg::kBlockM - 1) / Cfg::kBlockM, p.B, p.H, p.Hkv);
    kernel<<<grid, Cfg::kThreads, Cfg::kQSmem, stream>>>(p);
  }
  if (p.intervals) {
    // Key blocks x query segments; dQ is always fused (the host allocates the accumulator).
    auto kernel = &dkdv_kernel_sm90<kSoftcap, true, false>;
    if constexpr (FLASH_DMATTN_DROPOUT) {
      if (p.drop.rng != nullptr) kernel = &dkdv_kernel_sm90<kSoftcap, true, true>;
    }
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kKvSmem);
    if (err != cudaSuccess) return err;
    const int segments = (p.Lq + p.iv.segment_rows - 1) / p.iv.segment_rows;
    if (p.iv.n_blocks > 0) {
      kernel<<<dim3(p.iv.n_blocks, segments), Cfg::kKvThreads, Cfg::kKvSmem, stream>>>(p);
    }
  } else if (p.need_dkv || p.dbias_keys != nullptr || fused_dq) {
    auto kernel = &dkdv_kernel_sm90<kSoftcap, false, false>;
    if constexpr (FLASH_DMATTN_DROPOUT) {
      if (p.drop.rng != nullptr) kernel = &dkdv_kernel_sm90<kSoftcap, false, true>;
    }
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kKvSmem);
    if (err != cudaSuccess) return err;
    dim3 grid((p.Lk + Cfg::kBlockN - 1) / Cfg::kBlockN, p.B * p.Hkv);
    kernel<<<grid, Cfg::kKvThreads, Cfg::kKvSmem, stream>>>(p);
  }
  if (fused_dq && p.need_dq) {
    const int64_t n = int64_t(p.B) * p.Lq * p.H * (p.D / 2);
    const int threads = 256;
    const int blocks = int(std::min<int64_t>((n + threads - 1) / threads, 65535LL * 8));
    dq_accum_to_dq_kernel<kHeadDimBucket><<<blocks, threads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t run_bwd_sm90(const BwdParams& p, cudaStream_t stream) {
  return p.softcap > 0.f ? launch_bwd_sm90<true>(p, stream) : launch_bwd_sm90<false>(p, stream);
}

int bwd_sm90_block_m() { return Sm90BwdConfig<kHeadDimBucket>::kBlockM; }
int bwd_sm90_block_n() { return Sm90BwdConfig<kHeadDimBucket>::kBlockN; }
bool bwd_sm90_fused_dq() { return true; }

}  // namespace flash_dmattn

#endif  // FLASH_DMATTN_SM90_BWD
