// Forward kernel: one CTA per (query tile, b * H + h); online softmax over the live key tiles.
//
// Per key tile n (in list order when the host built live-tile lists, else every tile up to the
// causal limit):  wait K(n) -> issue V(n) (+ mask/bias tile) -> S = Q K^T -> scale, softcap,
// + bias, mask, causal and ragged bounds -> online softmax -> wait V(n) -> issue K(next) ->
// O += P V. Full tiles (every element visible) skip the mask tile and the element checks.
//
// Modules built for sm_90a run the Hopper forward (flash_fwd_sm90.cu) instead: there this file
// only answers the module's questions and compiles neither this kernel nor its headers.
#include "flash_dmattn/params.h"

#if FLASH_DMATTN_SM90
#include "flash_dmattn/spec.h"
#else
#include "flash_dmattn/kernel_common.cuh"
#endif

namespace flash_dmattn {

#if !FLASH_DMATTN_SM90
template <int kHeadDim>
struct FwdConfig {
  // 64 rows (4 warps): two CTAs per SM instead of one, faster than 128 rows (8 warps) on
  // dense and masked forwards.
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 64;
  // One warp per 16 query rows keeps the fp32 accumulators (O and S) in registers.
  using Tr = Traits<kHeadDim, kBlockM, kBlockN, kBlockM / 16, 1>;
  using MaskTile = BcastTile<uint8_t, kBlockM, kBlockN, Tr::kThreads>;
  using BiasTile = BcastTile<Elem, kBlockM, kBlockN, Tr::kThreads>;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kMaskOff = kQBytes + 2 * kKVBytes;
  static constexpr int kBiasOff = kMaskOff + (kHasMask ? MaskTile::kBytes : 0);
  static constexpr int kSmem = kBiasOff + (kHasBias ? BiasTile::kBytes : 0);
};

template <bool kSoftcap>
__global__ void __launch_bounds__(FwdConfig<kHeadDimBucket>::Tr::kThreads)
    fwd_kernel(const FwdParams p) {
  using Cfg = FwdConfig<kHeadDimBucket>;
  using Tr = typename Cfg::Tr;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kD = kHeadDimBucket;
  extern __shared__ __align__(128) char smem[];

  const int tid = threadIdx.x;
  const int m_block = blockIdx.x;
  const int bh = blockIdx.y;
  const int b = bh / p.H, h = bh % p.H;
  const int q0 = m_block * kBlockM;

  const SeqRows sr = seq_rows(p, b);
  // Lengths read where used: dense calls straight from the parameters (kept uniform).
  const auto Lq = [&] { return seq_lq(p, sr); };
  const auto Lk = [&] { return seq_lk(p, sr); };
  const int32_t* list;
  const int n_steps = key_tiles_of<kBlockM, kBlockN>(p, sr, b, h, m_block, q0, list);

  Elem* out = reinterpret_cast<Elem*>(p.out) + int64_t(b) * p.o_sb + sr.q_row0 * p.o_sl +
              int64_t(h) * p.o_sh;
  float* lse = p.lse + lse_offset(p, sr, b, h);

  typename Tr::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  Tensor acc_o = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kD>>{});
  clear(acc_o);
  Tensor cO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kD>>{}));
  constexpr int kRowsPerThread = 2 * decltype(size<1>(acc_o))::value;
  float row_max[kRowsPerThread], row_sum[kRowsPerThread];
  init_row_state(row_max, row_sum);

  if (n_steps > 0) {
    Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(smem)),
                            typename Tr::template SmemTile<kBlockM>{});
    Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(smem + Cfg::kQBytes)),
                            typename Tr::template SmemTile<kBlockN>{});
    Elem* v_smem = reinterpret_cast<Elem*>(smem + Cfg::kQBytes + Cfg::kKVBytes);
    Tensor sV = make_tensor(make_smem_ptr(v_smem), typename Tr::template SmemTile<kBlockN>{});
    // ldmatrix.trans reads the swizzled layout; the unswizzled one only shapes fragments.
    Tensor sVt = make_tensor(make_smem_ptr(v_smem), typename Tr::template SmemTileT<kBlockN>{});
    Tensor sVtShape = make_tensor(make_smem_ptr(v_smem),
                                  typename Tr::template SmemTileTNoSwizzle<kBlockN>{});
    char* mask_smem = smem + Cfg::kMaskOff;
    char* bias_smem = smem + Cfg::kBiasOff;

    const FwdTileWalk<kBlockN> walk(p, sr, b, h, q0, list);
    const Elem *qg = walk.q, *kg = walk.k, *vg = walk.v;
    const char *mask_base = walk.mask, *bias_base = walk.bias;
    auto tile_of = [&](int i) { return walk.tile(i); };
    auto partial_of = [&](int i, int k0) { return walk.partial(p, i, k0, Lq(), Lk()); };

    load_rows<Tr, kBlockM>(qg, p.q_sl, Lq() - q0, p.D, sQ, tid);
    {
      const int n0 = tile_of(0);
      load_rows<Tr, kBlockN>(kg + int64_t(n0) * kBlockN * p.k_sl, p.k_sl, Lk() - n0 * kBlockN,
                             p.D, sK, tid);
    }
    cp_async_fence();

    Tensor rQ = thr_mma.partition_fragment_A(sQ);
    Tensor rK = thr_mma.partition_fragment_B(sK);
    Tensor rVt = thr_mma.partition_fragment_B(sVtShape);
    auto ldsm_q = make_tiled_copy_A(typename Tr::LdsmA{}, mma);
    auto ldsm_k = make_tiled_copy_B(typename Tr::LdsmB{}, mma);
    auto ldsm_vt = make_tiled_copy_B(typename Tr::LdsmBT{}, mma);
    Tensor cS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    const bool mask_rows = p.mask.sq != 0, bias_rows = p.bias.sq != 0;

    for (int i = 0; i < n_steps; ++i) {
      const int n = tile_of(i);
      const int k0 = n * kBlockN;
      const bool partial = partial_of(i, k0);
      Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      cp_async_wait<0>();
      __syncthreads();  // K(n) (and Q) landed; every thread is done with V(n-1) and tile smem
      load_rows<Tr, kBlockN>(vg + int64_t(k0) * p.v_sl, p.v_sl, Lk() - k0, p.D, sV, tid);
      const bool need_mask = kHasMask && partial;
      if constexpr (kHasMask) {
        if (need_mask) Cfg::MaskTile::load(mask_smem, p.mask, mask_base, q0, k0, Lq(), Lk(), tid);
      }
      if constexpr (kHasBias) {
        Cfg::BiasTile::load(bias_smem, p.bias, bias_base, q0, k0, Lq(), Lk(), tid);
      }
      cp_async_fence();

      gemm_ss(mma, acc_s, rQ, rK, sQ, sK, ldsm_q, ldsm_k, tid);

      if constexpr (kHasBias || kHasMask) {
        // The bias / mask tile was issued with V; wait for all but nothing newer (V too).
        cp_async_wait<0>();
        __syncthreads();
      }
      // Scores in natural-log units, invisible elements at -inf.
      const bool check = partial || (k0 + kBlockN > Lk());
      CUTE_UNROLL
      for (int e = 0; e < size(acc_s); ++e) {
        float s = acc_s(e);
        if constexpr (kSoftcap) {
          s = p.softcap * tanhf(s * (p.scale / p.softcap));
        } else {
          s *= p.scale;
        }
        const int r = get<0>(cS(e)), c = get<1>(cS(e));
        if constexpr (kHasBias) {
          s += float(Cfg::BiasTile::read(bias_smem, bias_rows, r, c));
        }
        if (check) {
          const int qi = q0 + r, kj = k0 + c;
          bool visible = kj < Lk();
          // Bitwise, not short-circuit: no per-element branches (the mask tile read is in
          // bounds either way and ignored when !need_mask).
          visible &= !p.causal | (kj <= qi + Lk() - Lq());
          if constexpr (kHasMask) {
            visible &= !need_mask | (Cfg::MaskTile::read(mask_smem, mask_rows, r, c) != 0);
          }
          if (!visible) s = -INFINITY;
        }
        acc_s(e) = s;
      }

      online_softmax_step(acc_s, acc_o, row_max, row_sum);
      Tensor rP = to_type<Elem>(acc_s);
      Tensor rPa = make_tensor(rP.data(), acc_as_a_layout(rP.layout()));

      cp_async_wait<0>();
      __syncthreads();  // V(n) landed; every thread is done reading K(n)
      if (i + 1 < n_steps) {
        const int nn = tile_of(i + 1);
        load_rows<Tr, kBlockN>(kg + int64_t(nn) * kBlockN * p.k_sl, p.k_sl,
                               Lk() - nn * kBlockN, p.D, sK, tid);
      }
      cp_async_fence();
      gemm_rs(mma, acc_o, rPa, rVt, sVt, ldsm_vt, tid);
    }
  }

  // Epilogue: normalise, write lse (natural log; -inf and zero output for rows with no key).
  const int lane = tid % 32;
  CUTE_UNROLL
  for (int mi = 0; mi < size<1>(acc_o); ++mi) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int r = mi * 2 + half;
      const float sum = quad_sum(row_sum[r]);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const int row = q0 + get<0>(cO(half * 2, mi, 0));
      if (row < Lq()) {
        if (lane % 4 == 0) lse[row] = sum > 0.f ? row_max[r] + logf(sum) : -INFINITY;
        Elem* orow = out + int64_t(row) * p.o_sl;
        CUTE_UNROLL
        for (int ni = 0; ni < size<2>(acc_o); ++ni) {
          const int col = get<1>(cO(half * 2, mi, ni));
          if (col < p.D) {
            // col is even and D a multiple of 8: the pair is in range and 4-byte aligned.
            __align__(4) Elem pair[2] = {Elem(acc_o(half * 2, mi, ni) * inv),
                                         Elem(acc_o(half * 2 + 1, mi, ni) * inv)};
            *reinterpret_cast<uint32_t*>(orow + col) = *reinterpret_cast<uint32_t*>(pair);
          }
        }
      }
    }
  }
}

template <bool kSoftcap>
static cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream) {
  using Cfg = FwdConfig<kHeadDimBucket>;
  auto kernel = &fwd_kernel<kSoftcap>;
  if (Cfg::kSmem > 48 * 1024) {
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmem);
    if (err != cudaSuccess) return err;
  }
  dim3 grid((p.Lq + Cfg::kBlockM - 1) / Cfg::kBlockM, p.B * p.H);
  kernel<<<grid, Cfg::Tr::kThreads, Cfg::kSmem, stream>>>(p);
  return cudaGetLastError();
}
#endif  // !FLASH_DMATTN_SM90

#if FLASH_DMATTN_SM90
// flash_fwd_sm90.cu: the wgmma forward, used whenever the module is built for sm_90a.
cudaError_t run_fwd_sm90(const FwdParams& p, cudaStream_t stream);
int fwd_sm90_block_m();
int fwd_sm90_block_n();
cudaError_t run_fwd(const FwdParams& p, cudaStream_t stream) { return run_fwd_sm90(p, stream); }
int fwd_block_m() { return fwd_sm90_block_m(); }
int fwd_block_n() { return fwd_sm90_block_n(); }
// Gathered key lists: the sm_90 forward of a dense module with a mask.
bool fwd_gathers() { return FLASH_DMATTN_FWD_GATHER; }  // kHasMask && !kPacked
// Key-interval masks: the gathered forward where the spec's backward has them too (the wgmma
// backward, head dims up to 128), so that every call the forward takes can be trained.
bool fwd_intervals() { return fwd_gathers() && FLASH_DMATTN_SM90_BWD; }
#else
bool fwd_gathers() { return false; }
bool fwd_intervals() { return false; }
cudaError_t run_fwd(const FwdParams& p, cudaStream_t stream) {
  return p.softcap > 0.f ? launch_fwd<true>(p, stream) : launch_fwd<false>(p, stream);
}
int fwd_block_m() { return FwdConfig<kHeadDimBucket>::kBlockM; }
int fwd_block_n() { return FwdConfig<kHeadDimBucket>::kBlockN; }
#endif
// Attention dropout: the sm_90 kernels of modules whose backward is sm_90 too.
bool fwd_dropout() { return FLASH_DMATTN_DROPOUT; }

}  // namespace flash_dmattn
