// Hopper forward kernel (sm_90a): the same algorithm and tile skipping as flash_fwd.cu, with
// both products on warpgroup MMAs (wgmma) instead of mma.sync, and warp-specialised.
//
// One CTA per (128-row query tile, b * H + h), three warpgroups:
// * the producer copies Q once, then K, the mask / bias tile and V of every live key tile
//   with cp.async into the GMMA-canonical swizzled layouts: two stages of K and of V, and as
//   many mask / bias stages as fit (a tile broadcast over queries is one row). Each stage has
//   a full mbarrier (every producer thread arrives once its copies landed) and an empty one
//   (every consumer warp arrives once it stopped reading), so the producer runs up to two
//   tiles ahead and nobody waits on a CTA-wide barrier;
// * two consumers of 64 query rows each: S = Q K^T reads both operands from shared memory,
//   O += P V takes P from registers (an m64nN fp32 accumulator holds exactly the A fragments
//   of the next k16 products) and V from shared memory read as its transpose (MN-major B).
//   A consumer issues S(i) before O += P(i-1) V(i-1), then scales, biases, masks and
//   softmaxes tile i while that product runs, and waits for it only to rescale O.
// setmaxnreg moves registers from the producer (address arithmetic only) to the consumers.
//
// Gathered keys (p.gather, modules with a mask): the walk is the query tile's list of live
// keys (the Triton backend's planner); K / V rows are copied by index and the mask comes as
// the list's bits, which already encode range and causality.
//
// Key intervals (p.intervals, modules with a mask): the walk is the query tile's list from the
// key-interval planner, K / V rows copied by index as above; each listed key's visible query
// range and its bias are staged beside it and tested arithmetically (no mask memory).
//
// This header holds the kernel, its device helpers and its launcher (launch_fwd_sm90); the
// configuration is fwd_sm90_config.cuh (device) over fwd_sm90_launch.h (host). It is included
// by the flash_fwd_sm90_<walk>[_dropout][_softcap].cu sources only, in their guarded blocks
// (sm_90a): each instantiates the launcher of one kernel -- walk (dense, gathered, key
// intervals), dropout, soft cap -- so that a build compiles the kernels side by side;
// run_fwd_sm90 (flash_fwd_sm90.cu) picks one per call.
//
// The host pass of those sources compiles the launcher and the kernel's launch stub, which need
// only fwd_sm90_launch.h: the kernel's configuration, CuTe's layouts and MMAs, CUTLASS and the
// device helpers are included and defined in the device pass only (__CUDA_ARCH__), so the host
// pass (nvcc's host front end and the host compiler) does not parse them. The kernel's
// declaration is the same in both passes. The host pass still includes the two CuTe headers
// below: the registration code nvcc generates from the device pass names the namespace-scope
// __device__ constants of the headers the device pass read (cute::_, cute::product and the
// libcu++ objects those two headers bring: cuda::std's begin / end, in_place, ignore, ...), and
// the host pass must declare them too. A CuTe or CUDA version whose device-only headers
// define more such constants makes the host compile fail with "'::cute::...' (or
// '::cuda::std::...') has not been declared"; -DFLASH_DMATTN_FWD_HOST_CUTE=1 (e.g. in
// $FLASH_DMATTN_CUDA_FLAGS) gives the host pass every header of the device pass.
#pragma once
#include "fwd_sm90_launch.h"
#ifndef FLASH_DMATTN_FWD_HOST_CUTE
#define FLASH_DMATTN_FWD_HOST_CUTE 0
#endif
#if defined(__CUDA_ARCH__) || FLASH_DMATTN_FWD_HOST_CUTE
#include "fwd_sm90_config.cuh"
#include "dropout.cuh"
#include "pipeline.cuh"
#include "wgmma.cuh"
#else
#include <cute/int_tuple.hpp>
#include <cute/underscore.hpp>
#endif

namespace flash_dmattn {

#if defined(__CUDA_ARCH__)

// The mbarriers of one CTA's pipeline. Full barriers count the producer's 128 threads (each
// arrives once its cp.async copies of the stage have landed), empty barriers the consumers'
// warps (each arrives once it stopped reading the stage).
struct Sm90FwdBarriers {
  uint64_t* q_full;
  uint64_t* q_empty;
  uint64_t* k_full;
  uint64_t* k_empty;
  uint64_t* v_full;
  uint64_t* v_empty;
  uint64_t* aux_full;
  uint64_t* aux_empty;

  template <typename Cfg>
  __device__ static Sm90FwdBarriers at(char* smem) {
    uint64_t* b = reinterpret_cast<uint64_t*>(smem + Cfg::kBarOff);
    constexpr int S = Cfg::kStages;
    constexpr int A = Cfg::kMaxAuxStages;
    return {b,         b + 1,         b + 2,         b + 2 + S,
            b + 2 + 2 * S, b + 2 + 3 * S, b + 2 + 4 * S, b + 2 + 4 * S + A};
  }
};

// Stage the mask bits of gathered tile k0 (rows q0 .., kBitWords words each) and its row of the
// gathered bias (zero past the row's width; what lies past the list's count is never used).
__device__ __forceinline__ void load_gathered_aux(const FwdParams& p, int b, int h, int m_block,
                                                  int q0, int k0, char* bits_smem,
                                                  char* bias_smem, int tid) {
  using Cfg = Sm90FwdConfig<kHeadDimBucket>;
  const KeyGather& g = p.g;
  // The planner's bits have a row for every query of every tile (rows past Lq are 0).
  const uint64_t* row = g.bits + b * g.bits_sb + (h / g.bits_hdiv) * g.bits_sh +
                        int64_t(q0 + tid) * g.bits_sq + k0 / 64;
  static_assert(Cfg::kProducerThreads == Cfg::kBlockM, "one bits row per producer thread");
  CUTE_UNROLL
  for (int w = 0; w < Cfg::kBitWords; ++w) {
    cp_async_8(bits_smem + (tid * Cfg::kBitWords + w) * 8, row + w, 8);
  }
  if constexpr (kHasBias) {
    constexpr int kChunks = Cfg::kGBiasBytes / 16;
    if (tid < kChunks) {
      const int col = k0 + tid * 8;
      const Elem* src = reinterpret_cast<const Elem*>(g.bias) + b * g.bias_sb +
                        (h / g.bias_hdiv) * g.bias_sh + m_block * g.bias_sm + col;
      const int valid = max(0, min(16, (g.bias_width - col) * 2));
      cp_async_16(bias_smem + tid * 16, valid > 0 ? src : reinterpret_cast<const Elem*>(g.bias),
                  valid);
    }
  }
}

// A raw score q·k as a logit in log2 units (the natural-log logit times log2 e): scaled,
// soft-capped where the call asks for it. The sm90 forward keeps every logit, running max and
// bias in these units, so exp2 of a logit minus the max needs no multiply.
template <bool kSoftcap>
__device__ __forceinline__ float log2_logit(const FwdParams& p, float s) {
  if constexpr (kSoftcap) return (p.softcap * kLog2e) * tanhf(s * (p.scale / p.softcap));
  return s * (p.scale * kLog2e);
}

// One listed key of a key-interval tile, as the producer thread that stages it holds it: the
// query indices [lo, hi) that see it (its interval, causality folded in) and its bias. Columns
// past the list get an empty range.
struct IntervalKey {
  int lo = 1 << 30, hi = -(1 << 30);
  float bias = 0.f;  // log2 units
};

__device__ __forceinline__ IntervalKey fetch_interval_key(const FwdParams& p, int b, int h,
                                                          int key) {
  IntervalKey k;
  if (key < 0) return k;
  const KeyIntervalLists& iv = p.iv;
  const int32_t* s = iv.bounds + (int64_t(b) * iv.row_heads + h / iv.hdiv) * p.Lk + key;
  const int off = p.Lk - p.Lq;  // query index i sits at key position i + off
  k.lo = p.causal ? max(s[0], key) - off : s[0] - off;
  k.hi = s[iv.bounds_plane] - off;
  if constexpr (kHasBias) {
    k.bias = kLog2e * float(reinterpret_cast<const Elem*>(iv.bias)[int64_t(b) * iv.bias_sb +
                                                                 int64_t(h / iv.bias_hdiv) * iv.bias_sh +
                                                                 int64_t(key) * iv.bias_sk]);
  }
  return k;
}

#endif  // __CUDA_ARCH__

// kGather: walk the query tile's gathered key list (p.g) instead of key tiles: K / V rows are
// copied by index, the mask comes as the list's bits (which also hold range and causality) and
// a bias as the list's gathered row.
// kIntervals (with kGather): the list is the key-interval planner's (p.iv), and the aux stage
// holds each listed key's query range and bias (IntervalKey) instead of bits.
// kDropout: attention dropout (p.drop, dropout.cuh). The row sums take every probability (the
// normaliser of the true softmax); then dropped probabilities are zeroed before P becomes the
// P V operand, and the epilogue scales kept ones by 1 / (1 - p) with the normaliser. Keys are
// drawn at their positions in the sequence: a list's entries, not its columns.
template <bool kSoftcap, bool kGather, bool kIntervals, bool kDropout>
__global__ void __launch_bounds__(Sm90FwdShape<kHeadDimBucket>::kThreads, 1)
    fwd_kernel_sm90(const FwdParams p) {
// The body is compiled in the device pass only: the host pass needs just the signature for
// the launch stub (and has none of the headers the body uses).
#if defined(__CUDA_ARCH__)
  static_assert(kGather || !kIntervals, "key intervals walk gathered lists");
  using Cfg = Sm90FwdConfig<kHeadDimBucket>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kD = kHeadDimBucket;
  constexpr int kStages = Cfg::kStages;
  const typename Cfg::AuxLayout aux = Cfg::aux_layout(p);
  const int kAuxStages = aux.stages;
  extern __shared__ __align__(1024) char smem[];

  char* mask_smem0 = smem + Cfg::kAuxOff;
  char* bias_smem0 = smem + Cfg::kAuxOff + aux.mask_bytes;

  const Sm90FwdBarriers bar = Sm90FwdBarriers::at<Cfg>(smem);
  if (threadIdx.x == 0) {
    ClusterBarrier::init(bar.q_full, Cfg::kProducerThreads);
    ClusterBarrier::init(bar.q_empty, Cfg::kConsumerWarps);
    for (int s = 0; s < kStages; ++s) {
      ClusterBarrier::init(bar.k_full + s, Cfg::kProducerThreads);
      ClusterBarrier::init(bar.v_full + s, Cfg::kProducerThreads);
      ClusterBarrier::init(bar.k_empty + s, Cfg::kConsumerWarps);
      ClusterBarrier::init(bar.v_empty + s, Cfg::kConsumerWarps);
    }
    for (int s = 0; s < kAuxStages; ++s) {
      ClusterBarrier::init(bar.aux_full + s, Cfg::kProducerThreads);
      ClusterBarrier::init(bar.aux_empty + s, Cfg::kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  // Work items are (query tile, batch, head), in the order q_tile_coord_at gives them. A grid
  // of one CTA per item runs each once; a smaller grid (key-interval walks) makes CTAs walk
  // items grid-strided, so the next item's Q and first keys load while the consumers finish
  // the last one. Each role walks the items in its own loop (setmaxnreg budgets hold per
  // role); `step0` counts the CTA's key steps so far (stage and phase of the K / V / aux
  // rings), `rounds` its items with keys (the phase of the Q barriers). With one item per CTA
  // the loops stop after it at compile time, so the ring counters stay constants (the
  // persistent form's extra live state made the other walks spill).
  constexpr bool kPersistent = kIntervals;
  const int m_blocks = (p.Lq + kBlockM - 1) / kBlockM;
  const int n_items = m_blocks * p.B * p.H;
  struct Item {
    int m_block, b, h, q0;
    SeqRows sr;
    const int32_t* list;
    int n_steps, n_keys, n_full;
  };
  auto item_at = [&](int t) {
    Item it;
    const QTileCoord coord = q_tile_coord_at(t, m_blocks, p.H, p.Hkv);
    it.m_block = coord.m_block;
    it.b = coord.b;
    it.h = coord.h;
    it.q0 = it.m_block * kBlockM;
    it.sr = seq_rows(p, it.b);
    it.n_keys = 0;
    it.n_full = 0;
    const int m_block = it.m_block, b = it.b, h = it.h;
    if constexpr (kIntervals) {
      const KeyIntervalLists& iv = p.iv;
      const int at = (b * iv.row_heads + h / iv.hdiv) * iv.n_tiles + m_block;
      it.list = iv.keys + iv.tile_start[at];
      it.n_keys = iv.tile_len[at];
      it.n_full = iv.tile_full[at];
      it.n_steps = (it.n_keys + kBlockN - 1) / kBlockN;
    } else if constexpr (kGather) {
      const int hl = h / p.g.hdiv;
      it.list = p.g.idx + b * p.g.idx_sb + hl * p.g.idx_sh + m_block * p.g.idx_sm;
      it.n_keys = p.g.cnt[b * p.g.cnt_sb + hl * p.g.cnt_sh + m_block * p.g.cnt_sm];
      it.n_steps = (it.n_keys + kBlockN - 1) / kBlockN;
    } else {
      it.n_steps = key_tiles_of<kBlockM, kBlockN>(p, it.sr, b, h, m_block, it.q0, it.list);
    }
    return it;
  };

  // ---- Producer warpgroup: copies Q once, then K, mask / bias and V of every live tile into
  // the stage the consumers freed last, running up to kStages tiles ahead of them.
  if (threadIdx.x < Cfg::kProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    int step0 = 0, rounds = 0;
    for (int t = blockIdx.x; t < n_items; t += gridDim.x) {
      const Item it = item_at(t);
      const int m_block = it.m_block, b = it.b, h = it.h, q0 = it.q0;
      const int n_steps = it.n_steps, n_keys = it.n_keys, n_full = it.n_full;
      const int32_t* list = it.list;
      const SeqRows& sr = it.sr;
      // Lengths read where used: dense calls straight from the parameters (kept uniform).
      const auto Lq = [&] { return seq_lq(p, sr); };
      const auto Lk = [&] { return seq_lk(p, sr); };
      const FwdTileWalk<kBlockN> walk(p, sr, b, h, q0, kGather ? nullptr : list);
      auto tile_of = [&](int i) { return walk.tile(i); };
      auto partial_of = [&](int i, int k0) { return walk.partial(p, i, k0, Lq(), Lk()); };
      const int ptid = threadIdx.x;
      if (n_steps > 0) {
        // Q of the previous item is free once the consumers' last S product read it.
        if (rounds > 0) ClusterBarrier::wait(bar.q_empty, (rounds - 1) & 1);
        load_tile_swizzled<kD, Cfg::kAtomK, Cfg::kProducerThreads, kBlockM, true>(
            walk.q, p.q_sl, Lq() - q0, p.D, smem, ptid);
        stage_filled(bar.q_full);
        using Rows = RowIndices<Cfg::kAtomK, Cfg::kProducerThreads, kBlockN>;
        Rows rows, rows_next;
        if constexpr (kGather) rows_next.fetch(list, n_keys, ptid);
        // Key intervals: this thread's column of the staged ranges. Its key index is read two
        // steps ahead and its range / bias one step ahead, so neither global load waits.
        IntervalKey ikey;
        int ikey_next = -1;
        if constexpr (kIntervals) {
          const int k1 = ptid < kBlockN && ptid < n_keys ? list[ptid] : -1;
          ikey_next = ptid < kBlockN && kBlockN + ptid < n_keys ? list[kBlockN + ptid] : -1;
          ikey = fetch_interval_key(p, b, h, k1);
        }
        for (int i = 0; i < n_steps; ++i) {
          const int g = step0 + i;  // steps of this CTA so far: stage and phase
          const int s = g % kStages;
          const uint32_t free_phase = ((g / kStages) & 1) ^ 1;
          const int k0 = kGather ? i * kBlockN : tile_of(i) * kBlockN;
          if constexpr (kGather) {
            // This step's rows were fetched last step; fetch the next step's now.
            rows = rows_next;
            if (i + 1 < n_steps) rows_next.fetch(list + k0 + kBlockN, n_keys - k0 - kBlockN, ptid);
          }
          ClusterBarrier::wait(bar.k_empty + s, free_phase);
          if constexpr (kGather) {
            load_rows_by_index<kD, Cfg::kAtomK, Cfg::kProducerThreads, kBlockN>(
                walk.k, p.k_sl, rows, p.D, smem + Cfg::kKOff + s * Cfg::kStageBytes, ptid);
          } else {
            load_tile_swizzled<kD, Cfg::kAtomK, Cfg::kProducerThreads, kBlockN, true>(
                walk.k + int64_t(k0) * p.k_sl, p.k_sl, Lk() - k0, p.D,
                smem + Cfg::kKOff + s * Cfg::kStageBytes, ptid);
          }
          stage_filled(bar.k_full + s);
          if constexpr (kIntervals) {
            const int a = g % kAuxStages;
            ClusterBarrier::wait(bar.aux_empty + a, ((g / kAuxStages) & 1) ^ 1);
            if (ptid < kBlockN) {
              reinterpret_cast<int2*>(mask_smem0 + a * aux.stride)[ptid] = make_int2(ikey.lo, ikey.hi);
              if constexpr (kHasBias) {
                reinterpret_cast<float*>(bias_smem0 + a * aux.stride)[ptid] = ikey.bias;
              }
            }
            stage_filled(bar.aux_full + a);
            ikey = fetch_interval_key(p, b, h, ikey_next);
            const int c2 = (i + 2) * kBlockN + ptid;
            ikey_next = ptid < kBlockN && c2 < n_keys ? list[c2] : -1;
          } else if constexpr (kGather) {
            const int a = g % kAuxStages;
            ClusterBarrier::wait(bar.aux_empty + a, ((g / kAuxStages) & 1) ^ 1);
            load_gathered_aux(p, b, h, m_block, q0, k0, mask_smem0 + a * aux.stride,
                              bias_smem0 + a * aux.stride, ptid);
            stage_filled(bar.aux_full + a);
          } else if constexpr (Cfg::kHasAux) {
            const int a = g % kAuxStages;
            ClusterBarrier::wait(bar.aux_empty + a, ((g / kAuxStages) & 1) ^ 1);
            if constexpr (kHasMask) {
              if (partial_of(i, k0)) {
                Cfg::MaskTile::template load<true>(mask_smem0 + a * aux.stride, p.mask, walk.mask, q0, k0,
                                    Lq(), Lk(), ptid);
              }
            }
            if constexpr (kHasBias) {
              Cfg::BiasTile::template load<true>(bias_smem0 + a * aux.stride, p.bias, walk.bias, q0, k0, Lq(),
                                  Lk(), ptid);
            }
            stage_filled(bar.aux_full + a);
          }
          ClusterBarrier::wait(bar.v_empty + s, free_phase);
          if constexpr (kGather) {
            load_rows_by_index<kD, Cfg::kAtomK, Cfg::kProducerThreads, kBlockN>(
                walk.v, p.v_sl, rows, p.D, smem + Cfg::kVOff + s * Cfg::kStageBytes, ptid);
          } else {
            load_tile_swizzled<kD, Cfg::kAtomK, Cfg::kProducerThreads, kBlockN, true>(
                walk.v + int64_t(k0) * p.v_sl, p.v_sl, Lk() - k0, p.D,
                smem + Cfg::kVOff + s * Cfg::kStageBytes, ptid);
          }
          stage_filled(bar.v_full + s);
        }
      }
      if (n_steps > 0) {
        step0 += n_steps;
        ++rounds;
      }
      if constexpr (!kPersistent) break;
    }
    // Copies still in flight must not outlive their thread.
    cp_async_wait<0>();
    return;
  }

  // ---- Consumer warpgroups: 64 query rows each.
  cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
  int step0 = 0, rounds = 0;
  for (int t = blockIdx.x; t < n_items; t += gridDim.x) {
    const Item it = item_at(t);
    const int m_block = it.m_block, b = it.b, h = it.h, q0 = it.q0;
    const int n_steps = it.n_steps, n_keys = it.n_keys, n_full = it.n_full;
    const int32_t* list = it.list;
    const SeqRows& sr = it.sr;
    // Lengths read where used: dense calls straight from the parameters (kept uniform).
    const auto Lq = [&] { return seq_lq(p, sr); };
    const auto Lk = [&] { return seq_lk(p, sr); };
    const FwdTileWalk<kBlockN> walk(p, sr, b, h, q0, kGather ? nullptr : list);
    auto tile_of = [&](int i) { return walk.tile(i); };
    auto partial_of = [&](int i, int k0) { return walk.partial(p, i, k0, Lq(), Lk()); };
    const int tid = threadIdx.x - Cfg::kProducerThreads;
    Elem* out = reinterpret_cast<Elem*>(p.out) + int64_t(b) * p.o_sb + sr.q_row0 * p.o_sl +
                int64_t(h) * p.o_sh;
    float* lse = p.lse + lse_offset(p, sr, b, h);

    typename Cfg::MmaQK mma_qk;
    typename Cfg::MmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(tid);
    auto thr_pv = mma_pv.get_thread_slice(tid);
    Tensor acc_o = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kD>>{});
    clear(acc_o);
    Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kD>>{}));
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
    DropoutKey dkey;
    if constexpr (kDropout) dkey = dropout_key(p.drop, b, h);

    if (n_steps > 0) {
      Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(smem)), typename Cfg::SmemQ{});
      Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(smem + Cfg::kKOff)),
                              typename Cfg::SmemK{});
      Tensor sVt = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(smem + Cfg::kVOff)),
                               typename Cfg::SmemVt{});
      Tensor tSrQ = thr_qk.partition_fragment_A(sQ);
      Tensor tSrK = thr_qk.partition_fragment_B(sK);    // (..., stage)
      Tensor tOrVt = thr_pv.partition_fragment_B(sVt);  // (..., stage)
      Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
      const bool mask_rows = p.mask.sq != 0, bias_rows = p.bias.sq != 0;

      // Raw scores of tile i -> scaled (softcapped) logits + bias, -inf where invisible; the
      // mask / bias tile is read from aux stage `a`.
      // Gathered tile i: + the gathered bias, -inf where the row's bit is clear or the column
      // lies past the list (its bits there are not written).
      auto gathered_logits = [&](auto& acc_s, int i, int a) {
        const char* bits_smem = mask_smem0 + a * aux.stride;
        const char* bias_smem = bias_smem0 + a * aux.stride;
        const int limit = n_keys - i * kBlockN;
        constexpr int kGroupsS = decltype(size<0, 2>(acc_s))::value;
        const int lane_shift = 2 * (tid % 4);  // this thread's first column within 8
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) {
          const int row = get<0>(cS(make_coord(0, r, 0), 0, 0));
          uint64_t words[Cfg::kBitWords];
          CUTE_UNROLL
          for (int w = 0; w < Cfg::kBitWords; ++w) {
            words[w] = reinterpret_cast<const uint64_t*>(bits_smem)[row * Cfg::kBitWords + w] >>
                       lane_shift;
          }
          CUTE_UNROLL
          for (int g = 0; g < kGroupsS; ++g) {
            const int c = get<1>(cS(make_coord(0, r, g), 0, 0));  // 8 g + lane_shift
            float& s0 = acc_s(make_coord(0, r, g), 0, 0);
            float& s1 = acc_s(make_coord(1, r, g), 0, 0);
            float x0 = log2_logit<kSoftcap>(p, s0), x1 = log2_logit<kSoftcap>(p, s1);
            if constexpr (kHasBias) {
              __align__(4) Elem two[2];
              *reinterpret_cast<uint32_t*>(two) =
                  *reinterpret_cast<const uint32_t*>(bias_smem + c * int(sizeof(Elem)));
              x0 = fmaf(float(two[0]), kLog2e, x0);
              x1 = fmaf(float(two[1]), kLog2e, x1);
            }
            const uint32_t pair = uint32_t(words[g / 8] >> (8 * (g % 8))) & 3u;
            s0 = ((pair & 1u) != 0u) & (c < limit) ? x0 : -INFINITY;
            s1 = ((pair & 2u) != 0u) & (c + 1 < limit) ? x1 : -INFINITY;
          }
        }
      };

      // Key-interval tile: + the staged bias, -inf where the row's query index lies outside the
      // column's staged range (columns past the list have an empty one). A step whose keys all
      // lie among the list's leading n_full (seen by every query of the tile) skips the test:
      // the test is uniform over a step, so those steps (most of a long list) branch to a body
      // that neither reads nor compares the staged ranges and makes a logit with one FMA.
      const float scale_log2 = p.scale * kLog2e;
      auto interval_logits = [&](auto& acc_s, int i, int a) {
        const char* range_smem = mask_smem0 + a * aux.stride;
        const char* bias_smem = bias_smem0 + a * aux.stride;
        constexpr int kGroupsS = decltype(size<0, 2>(acc_s))::value;
        int qrow[2];
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) qrow[r] = q0 + get<0>(cS(make_coord(0, r, 0), 0, 0));
        auto body = [&](auto test_c) {
          constexpr bool kTest = decltype(test_c)::value;
          CUTE_UNROLL
          for (int g = 0; g < kGroupsS; ++g) {
            const int c = get<1>(cS(make_coord(0, 0, g), 0, 0));  // even: ranges c, c + 1 in 16 B
            int4 rg;
            if constexpr (kTest) rg = *reinterpret_cast<const int4*>(range_smem + c * 8);
            float2 b2 = make_float2(0.f, 0.f);
            if constexpr (kHasBias) b2 = *reinterpret_cast<const float2*>(bias_smem + c * 4);
            CUTE_UNROLL
            for (int r = 0; r < 2; ++r) {
              float& s0 = acc_s(make_coord(0, r, g), 0, 0);
              float& s1 = acc_s(make_coord(1, r, g), 0, 0);
              float x0, x1;
              if constexpr (kSoftcap) {
                x0 = log2_logit<kSoftcap>(p, s0) + b2.x;
                x1 = log2_logit<kSoftcap>(p, s1) + b2.y;
              } else {
                x0 = fmaf(s0, scale_log2, b2.x);
                x1 = fmaf(s1, scale_log2, b2.y);
              }
              if constexpr (kTest) {
                const int q = qrow[r];
                s0 = (rg.x <= q) & (q < rg.y) ? x0 : -INFINITY;
                s1 = (rg.z <= q) & (q < rg.w) ? x1 : -INFINITY;
              } else {
                s0 = x0;
                s1 = x1;
              }
            }
          }
        };
        if ((i + 1) * kBlockN > n_full) {
          body(std::true_type{});
        } else {
          body(std::false_type{});
        }
      };

      auto to_logits = [&](auto& acc_s, int i, int a) {
        if constexpr (kIntervals) {
          interval_logits(acc_s, i, a);
          return;
        } else if constexpr (kGather) {
          gathered_logits(acc_s, i, a);
          return;
        }
        const char* mask_smem = mask_smem0 + a * aux.stride;
        const char* bias_smem = bias_smem0 + a * aux.stride;
        const int k0 = tile_of(i) * kBlockN;
        const bool partial = partial_of(i, k0);
        CUTE_UNROLL
        for (int e = 0; e < size(acc_s); ++e) {
          float s = acc_s(e);
          acc_s(e) = log2_logit<kSoftcap>(p, s);
        }
        // A thread's accumulator values come in pairs of adjacent columns (c, c + 1), c even: read
        // their bias / mask as one 4-byte / 2-byte word, and a bias or mask broadcast over queries
        // once for both of the thread's rows; the causal / ragged bound becomes one column limit
        // per row (about 10 % faster than per-element reads on a per-query mask + bias).
        constexpr int kGroupsS = decltype(size<0, 2>(acc_s))::value;
        if constexpr (kHasBias) {
          CUTE_UNROLL
          for (int g = 0; g < kGroupsS; ++g) {
            const int c = get<1>(cS(make_coord(0, 0, g), 0, 0));
            if (!bias_rows) {
              const float2 b2 = Cfg::BiasTile::read_pair(bias_smem, 0, c);
              CUTE_UNROLL
              for (int r = 0; r < 2; ++r) {
                float& s0 = acc_s(make_coord(0, r, g), 0, 0);
                float& s1 = acc_s(make_coord(1, r, g), 0, 0);
                s0 = fmaf(b2.x, kLog2e, s0);
                s1 = fmaf(b2.y, kLog2e, s1);
              }
            } else {
              CUTE_UNROLL
              for (int r = 0; r < 2; ++r) {
                const float2 b2 =
                    Cfg::BiasTile::read_pair(bias_smem, get<0>(cS(make_coord(0, r, g), 0, 0)), c);
                float& s0 = acc_s(make_coord(0, r, g), 0, 0);
                float& s1 = acc_s(make_coord(1, r, g), 0, 0);
                s0 = fmaf(b2.x, kLog2e, s0);
                s1 = fmaf(b2.y, kLog2e, s1);
              }
            }
          }
        }
        if (partial || (k0 + kBlockN > Lk())) {
          // Branch-free: every element gets a select, the mask word is read unconditionally
          // (bitwise &, not &&, so the compiler does not guard the load with a branch).
          auto apply = [&](auto with_mask) {
            CUTE_UNROLL
            for (int r = 0; r < 2; ++r) {
              const int row = get<0>(cS(make_coord(0, r, 0), 0, 0));
              // Columns < limit are in range and causally visible to this row.
              int limit = Lk() - k0;
              if (p.causal) limit = min(limit, q0 + row + Lk() - Lq() - k0 + 1);
              CUTE_UNROLL
              for (int g = 0; g < kGroupsS; ++g) {
                const int c = get<1>(cS(make_coord(0, r, g), 0, 0));
                bool v0 = c < limit, v1 = c + 1 < limit;
                if constexpr (decltype(with_mask)::value) {
                  const uint32_t m2 = Cfg::MaskTile::read_pair(mask_smem, mask_rows ? row : 0, c);
                  v0 = v0 & ((m2 & 0xffu) != 0u);
                  v1 = v1 & ((m2 >> 8) != 0u);
                }
                float& s0 = acc_s(make_coord(0, r, g), 0, 0);
                float& s1 = acc_s(make_coord(1, r, g), 0, 0);
                s0 = v0 ? s0 : -INFINITY;
                s1 = v1 ? s1 : -INFINITY;
              }
            }
          };
          if (kHasMask && partial) {
            apply(cute::true_type{});
          } else {
            apply(cute::false_type{});
          }
        }
      };

      // Online softmax: logits (log2 units) -> unnormalised probabilities in place, running max
      // (log2 units) and sum updated; alpha[r] is the factor the accumulated output rows must be
      // rescaled by.
      // Accumulator value (c, r, g) is column 8 g + c, row 8 r of this thread's quad; the four
      // threads of a quad share rows.
      auto softmax_step = [&](auto& acc_s, float (&alpha)[2]) {
        constexpr int kGroupsS = decltype(size<0, 2>(acc_s))::value;
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) {
          float mx = row_max[r];
          CUTE_UNROLL
          for (int g = 0; g < kGroupsS; ++g) {
            mx = fmaxf(mx, fmaxf(acc_s(make_coord(0, r, g), 0, 0), acc_s(make_coord(1, r, g), 0, 0)));
          }
          mx = quad_max(mx);
          const float base = mx == -INFINITY ? 0.f : mx;
          alpha[r] = exp2f(row_max[r] - base);
          row_max[r] = mx;
          float sum = 0.f;
          CUTE_UNROLL
          for (int g = 0; g < kGroupsS; ++g) {
            CUTE_UNROLL
            for (int c = 0; c < 2; ++c) {
              const float pv = exp2f(acc_s(make_coord(c, r, g), 0, 0) - base);
              acc_s(make_coord(c, r, g), 0, 0) = pv;
              sum += pv;
            }
          }
          row_sum[r] = row_sum[r] * alpha[r] + sum;  // quad-reduced once, at the end
        }
      };
      // Dropout of tile i's probabilities (after softmax_step has summed them): dropped ones
      // zeroed. Its Philox evaluations run while the previous tile's P V product is on the
      // tensor cores. A warp's 16 rows are one 16-row group (q0 is a multiple of kBlockM):
      // kBlockN / 32 evaluations a thread, for listed keys as for a key tile.
      auto drop_probs = [&](auto& acc_s, int i) {
        constexpr int kGroupsS = decltype(size<0, 2>(acc_s))::value;
        static_assert(kGroupsS * 8 == kBlockN, "a thread's columns span the tile");
        const int lane = tid % 32;
        const int row0 = q0 + get<0>(cS(make_coord(0, 0, 0), 0, 0));
        uint32_t bits[2];
        if constexpr (kGather) {
          // Columns past the list are invisible (probability 0): any key will do.
          const int32_t* keys = list + i * kBlockN;
          const int n = n_keys - i * kBlockN;
          dropout_query_rows_bits<kBlockN>(dkey, uint32_t(row0) >> 4, lane,
                                           [&](int c) { return c < n ? keys[c] : 0; }, bits);
        } else {
          const int k0 = tile_of(i) * kBlockN;
          dropout_query_rows_bits<kBlockN>(dkey, uint32_t(row0) >> 4, lane,
                                           [&](int c) { return k0 + c; }, bits);
        }
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) {
          CUTE_UNROLL
          for (int g = 0; g < kGroupsS; ++g) {
            float& s0 = acc_s(make_coord(0, r, g), 0, 0);
            float& s1 = acc_s(make_coord(1, r, g), 0, 0);
            s0 = ((bits[r] >> (2 * g)) & 1u) != 0u ? s0 : 0.f;
            s1 = ((bits[r] >> (2 * g + 1)) & 1u) != 0u ? s1 : 0.f;
          }
        }
      };
      auto rescale_o = [&](const float (&alpha)[2]) {
        constexpr int kGroupsO = decltype(size<0, 2>(acc_o))::value;
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) {
          CUTE_UNROLL
          for (int g = 0; g < kGroupsO; ++g) {
            acc_o(make_coord(0, r, g), 0, 0) *= alpha[r];
            acc_o(make_coord(1, r, g), 0, 0) *= alpha[r];
          }
        }
      };

      Tensor acc_s = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
      // P of the tile whose P V product is next, as the register A operand of that product.
      Tensor rP = make_tensor_like<Elem>(acc_s);
      Tensor tOrP = make_tensor(rP.data(), acc_as_gmma_a_layout(rP.layout()));
      auto to_p = [&] {
        CUTE_UNROLL
        for (int e = 0; e < size(acc_s); ++e) rP(e) = Elem(acc_s(e));
      };
      auto issue_qk = [&](int i) {
        const int s = (step0 + i) % kStages;
        ClusterBarrier::wait(bar.k_full + s, ((step0 + i) / kStages) & 1);
        Tensor tSrKs = tSrK(_, _, _, s);
        wgmma_issue<false>(mma_qk, tSrQ, tSrKs, acc_s, /*zero=*/true);
      };
      auto issue_pv = [&](int i) {
        const int s = (step0 + i) % kStages;
        ClusterBarrier::wait(bar.v_full + s, ((step0 + i) / kStages) & 1);
        Tensor tOrVts = tOrVt(_, _, _, s);
        wgmma_issue<true>(mma_pv, tOrP, tOrVts, acc_o, /*zero=*/false);
      };
      // Scores of tile i (its S product waited for) -> probabilities; alpha as softmax_step.
      auto scores_to_probs = [&](int i, float (&alpha)[2]) {
        const int g = step0 + i;
        stage_released(bar.k_empty + g % kStages);
        // The last S product was the last reader of Q: the producer may load the next item's.
        if (kPersistent && i == n_steps - 1) stage_released(bar.q_empty);
        if constexpr (Cfg::kHasAux || kGather) {
          const int a = g % kAuxStages;
          ClusterBarrier::wait(bar.aux_full + a, (g / kAuxStages) & 1);
          to_logits(acc_s, i, a);
          stage_released(bar.aux_empty + a);
        } else {
          to_logits(acc_s, i, 0);
        }
        softmax_step(acc_s, alpha);
        if constexpr (kDropout) drop_probs(acc_s, i);
      };
      auto pv_done = [&](int i) {
        wgmma_wait<0>(acc_o);
        warpgroup_fence_operand(rP);
        stage_released(bar.v_empty + (step0 + i) % kStages);
      };

      ClusterBarrier::wait(bar.q_full, rounds & 1);
      float alpha[2];
      issue_qk(0);
      wgmma_wait<0>(acc_s);
      scores_to_probs(0, alpha);  // O is still zero: nothing to rescale
      to_p();
      for (int i = 1; i < n_steps; ++i) {
        issue_qk(i);
        issue_pv(i - 1);
        wgmma_wait<1>(acc_s);  // batches complete in order: S(i) is ready, P V may still run
        scores_to_probs(i, alpha);
        pv_done(i - 1);
        rescale_o(alpha);
        to_p();
      }
      issue_pv(n_steps - 1);
      pv_done(n_steps - 1);
    }

    // Epilogue: normalise, write lse (natural log; -inf and zero output for rows with no key).
    const int lane = tid % 32;
    constexpr int kGroupsO = decltype(size<0, 2>(acc_o))::value;
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const float sum = quad_sum(row_sum[r]);
      // With dropout, kept probabilities are scaled by 1 / (1 - p) here.
      const float inv = sum > 0.f ? (kDropout ? p.drop.scale : 1.f) / sum : 0.f;
      const int row = q0 + get<0>(cO(make_coord(0, r, 0), 0, 0));
      if (row < Lq()) {
        // The running max is in log2 units; lse is in natural-log units.
        if (lane % 4 == 0) lse[row] = sum > 0.f ? row_max[r] * kLn2 + logf(sum) : -INFINITY;
        Elem* orow = out + int64_t(row) * p.o_sl;
        CUTE_UNROLL
        for (int g = 0; g < kGroupsO; ++g) {
          const int col = get<1>(cO(make_coord(0, r, g), 0, 0));
          if (col < p.D) {
            // col is even and D a multiple of 8: the pair is in range and 4-byte aligned.
            __align__(4) Elem pair[2] = {Elem(acc_o(make_coord(0, r, g), 0, 0) * inv),
                                         Elem(acc_o(make_coord(1, r, g), 0, 0) * inv)};
            *reinterpret_cast<uint32_t*>(orow + col) = *reinterpret_cast<uint32_t*>(pair);
          }
        }
      }
    }
    if (n_steps > 0) {
      step0 += n_steps;
      ++rounds;
    }
    if constexpr (!kPersistent) break;
  }
#endif  // __CUDA_ARCH__
}

template <bool kSoftcap, bool kGather, bool kIntervals, bool kDropout>
cudaError_t launch_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  // A module compiles only the kernels its specialisation can call (params.h).
  static_assert(!kGather || FLASH_DMATTN_FWD_GATHER, "list walks: dense-batch modules with a mask");
  static_assert(!kDropout || FLASH_DMATTN_DROPOUT, "dropout: the modules that build it");
  using Cfg = Sm90FwdShape<kHeadDimBucket>;
  auto kernel = &fwd_kernel_sm90<kSoftcap, kGather, kIntervals, kDropout>;
  const int smem = Cfg::aux_layout(p).smem;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const int items = (p.Lq + Cfg::kBlockM - 1) / Cfg::kBlockM * p.B * p.H;
  // Key-interval walks are short (about window / kBlockN steps an item), so a CTA's own load
  // of Q and its epilogue would be a large share of its time: one CTA per SM walks items in
  // turn and overlaps them (the lists are of similar lengths, so a fixed stride balances).
  // Other walks keep one CTA per item, which the hardware schedules as SMs free up.
  const int grid = kIntervals ? std::min(items, sm_count()) : items;
  kernel<<<grid, Cfg::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flash_dmattn
