// Backward kernels. No atomics anywhere, so gradients are bitwise reproducible
// (deterministic=True costs nothing):
//
// * delta_kernel:  delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d]
// * dq_kernel:     one CTA per (query tile, b * H + h); walks the live key tiles, recomputes
//                  P = exp(S - lse), dP = dO V^T, dS = P (dP - delta); dQ += dS K. Writes the
//                  gradient of a full per-element bias (dbias = dS) on the way.
// * dkdv_kernel:   one CTA per (key tile, b * Hkv + hkv); loops over the query heads of its
//                  group and their live query tiles with keys as the MMA rows:
//                  S^T = K Q^T, dV += P^T dO, dP^T = V dO^T, dK += dS^T Q. Row sums of dS^T
//                  are the gradient of a bias broadcast over queries (per key), written per
//                  (b, h) for the host to reduce into the bias's own shape.
// Both main kernels stream their tiles through two shared-memory buffers: the loads of step
// i + 1 are issued before step i computes.
#include "flash_dmattn/kernel_common.cuh"

namespace flash_dmattn {

template <int kHeadDim>
struct BwdConfig {
  static constexpr int kBlockM = 64;  // queries per tile
  static constexpr int kBlockN = 64;  // keys per tile
  // dQ kernel: queries are the MMA rows, one warp per 16.
  using TrQ = Traits<kHeadDim, kBlockM, kBlockN, 4, 1>;
  // dK/dV kernel: keys are the MMA rows, warps stacked along them only. P^T and dS^T are fed
  // from registers as the A operand of the next product, which needs each thread's two
  // neighbouring n8 tiles to form one k16 block: true only without warps along N. (Heads
  // above 128 therefore hold 2 x 128 accumulator registers per thread and spill; an smem
  // round trip for P / dS would lift that.)
  static constexpr int kWarpsN = 1;
  using TrKV = Traits<kHeadDim, kBlockN, kBlockM, 4, kWarpsN>;
  static constexpr int kTileBytes = 64 * kHeadDim * 2;  // one 64-row operand tile
};

template <int kThreads>
using MaskTile64 = BcastTile<uint8_t, 64, 64, kThreads>;
template <int kThreads>
using BiasTile64 = BcastTile<Elem, 64, 64, kThreads>;

// ---------------------------------------------------------------------------------------------
// delta = rowsum(dO * O), half a warp per row
// ---------------------------------------------------------------------------------------------
__global__ void delta_kernel(const BwdParams p) {
  // A packed call is one batch of total_q rows (batch strides 0; delta laid out like lse).
  const int L = kPacked ? p.total_q : p.Lq;
  const int nb = kPacked ? 1 : p.B;
  // Half a warp per (b, i, h) row, 8 columns (one 16-byte load of each operand) per lane and
  // step; the head varies fastest, which is memory order for (B, L, H, D) tensors. (A warp
  // per row with 2-byte loads reached about half of this kernel's bandwidth.)
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 16;
  const int sub = threadIdx.x % 16;
  if (row >= int64_t(nb) * L * p.H) return;  // whole half-warps: the shuffles stay within one
  const int h = int(row % p.H);
  const int64_t bi = row / p.H;
  const int i = int(bi % L), b = int(bi / L);
  const Elem* o = reinterpret_cast<const Elem*>(p.out) + int64_t(b) * p.o_sb +
                  int64_t(i) * p.o_sl + int64_t(h) * p.o_sh;
  const Elem* d = reinterpret_cast<const Elem*>(p.dout) + int64_t(b) * p.do_sb +
                  int64_t(i) * p.do_sl + int64_t(h) * p.do_sh;
  float acc = 0.f;
  // D is a multiple of 8 and rows are 16-byte aligned (the host's _vector_ready).
  for (int c = sub * 8; c < p.D; c += 128) {
    const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
    const uint4 dv = *reinterpret_cast<const uint4*>(d + c);
    const Elem* oe = reinterpret_cast<const Elem*>(&ov);
    const Elem* de = reinterpret_cast<const Elem*>(&dv);
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) acc += float(oe[e]) * float(de[e]);
  }
  const unsigned half = 0xffffu << (threadIdx.x & 16);
  CUTE_UNROLL
  for (int off = 8; off > 0; off /= 2) acc += __shfl_xor_sync(half, acc, off);
  if (sub == 0) p.delta[int64_t(b) * p.lse_sb + int64_t(h) * p.lse_sh + i] = acc;
}

void launch_delta(const BwdParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(kPacked ? p.total_q : p.B * p.Lq) * p.H;
  const int threads = 256;
  const int64_t blocks = (rows * 16 + threads - 1) / threads;
  delta_kernel<<<unsigned(blocks), threads, 0, stream>>>(p);
}

#if !FLASH_DMATTN_SM90_BWD

// ---------------------------------------------------------------------------------------------
// dQ (+ full dbias)
// ---------------------------------------------------------------------------------------------
template <bool kSoftcap>
__global__ void __launch_bounds__(BwdConfig<kHeadDimBucket>::TrQ::kThreads)
    dq_kernel(const BwdParams p) {
  using Cfg = BwdConfig<kHeadDimBucket>;
  using Tr = typename Cfg::TrQ;
  constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kD = kHeadDimBucket;
  constexpr int kT = Cfg::kTileBytes;
  using MaskT = MaskTile64<Tr::kThreads>;
  using BiasT = BiasTile64<Tr::kThreads>;
  extern __shared__ __align__(128) char smem[];
  // [Q][dO][K0][V0][K1][V1][mask0][mask1][bias0][bias1]
  char* mask_smem = smem + 6 * kT;
  char* bias_smem = mask_smem + (kHasMask ? 2 * MaskT::kBytes : 0);

  const int tid = threadIdx.x;
  const int m_block = blockIdx.x;
  const int b = blockIdx.y / p.H, h = blockIdx.y % p.H;
  const int hkv = h / (p.H / p.Hkv);
  const int q0 = m_block * kBM;

  const SeqRows sr = seq_rows(p, b);
  // Lengths read where used: dense calls straight from the parameters (kept uniform).
  const auto Lq = [&] { return seq_lq(p, sr); };
  const auto Lk = [&] { return seq_lk(p, sr); };
  const int32_t* list;
  const int n_steps = key_tiles_of<kBM, kBN>(p, sr, b, h, m_block, q0, list);

  typename Tr::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  Tensor acc_dq = partition_fragment_C(mma, Shape<Int<kBM>, Int<kD>>{});
  clear(acc_dq);
  Tensor cQ = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kD>>{}));

  if (n_steps > 0) {
    using SL = typename Tr::template SmemTile<64>;
    using SLT = typename Tr::template SmemTileT<64>;  // swizzled: what ldmatrix reads
    using SLTn = typename Tr::template SmemTileTNoSwizzle<64>;  // fragment shapes only
    auto elem_at = [&](int off) { return reinterpret_cast<Elem*>(smem + off); };
    Tensor sQ = make_tensor(make_smem_ptr(elem_at(0)), SL{});
    Tensor sdO = make_tensor(make_smem_ptr(elem_at(kT)), SL{});

    const BwdHeadOperands g = bwd_head_operands(p, sr, b, h);
    const Elem* qg = g.q + int64_t(q0) * p.q_sl;  // this tile's rows
    const Elem* dog = g.dout + int64_t(q0) * p.do_sl;
    const Elem* kg = reinterpret_cast<const Elem*>(p.k) + int64_t(b) * p.k_sb +
                     sr.k_row0 * p.k_sl + int64_t(hkv) * p.k_sh;
    const Elem* vg = reinterpret_cast<const Elem*>(p.v) + int64_t(b) * p.v_sb +
                     sr.k_row0 * p.v_sl + int64_t(hkv) * p.v_sh;

    auto tile_of = [&](int i) { return list ? (list[i] >> 1) : i; };
    // Element checks: the list's flag or a tile crossing the causal diagonal (a dense list's
    // flag includes that already; a packed call's is shared by the query tiles and cannot).
    const int diag = p.causal ? q0 + Lk() - Lq() : INT_MAX;
    auto partial_of = [&](int i) -> bool {
      const bool crosses = tile_of(i) * kBN + kBN - 1 > diag;
      if constexpr (!kPacked) return list ? (list[i] & 1) != 0 : crosses;
      return list ? ((list[i] & 1) != 0) || crosses : crosses;
    };
    auto issue = [&](int i) {
      const int n = tile_of(i), k0 = n * kBN, buf = i & 1;
      Tensor sK = make_tensor(make_smem_ptr(elem_at((2 + 2 * buf) * kT)), SL{});
      Tensor sV = make_tensor(make_smem_ptr(elem_at((3 + 2 * buf) * kT)), SL{});
      load_rows<Tr, 64>(kg + int64_t(k0) * p.k_sl, p.k_sl, Lk() - k0, p.D, sK, tid);
      load_rows<Tr, 64>(vg + int64_t(k0) * p.v_sl, p.v_sl, Lk() - k0, p.D, sV, tid);
      if constexpr (kHasMask) {
        if (partial_of(i))
          MaskT::load(mask_smem + buf * MaskT::kBytes, p.mask, g.mask, q0, k0, Lq(), Lk(), tid);
      }
      if constexpr (kHasBias) {
        BiasT::load(bias_smem + buf * BiasT::kBytes, p.bias, g.bias, q0, k0, Lq(), Lk(), tid);
      }
    };

    load_rows<Tr, 64>(qg, p.q_sl, Lq() - q0, p.D, sQ, tid);
    load_rows<Tr, 64>(dog, p.do_sl, Lq() - q0, p.D, sdO, tid);
    issue(0);
    cp_async_fence();

    Tensor rQ = thr_mma.partition_fragment_A(sQ);
    Tensor rdO = thr_mma.partition_fragment_A(sdO);
    Tensor rK = thr_mma.partition_fragment_B(make_tensor(make_smem_ptr(elem_at(2 * kT)), SL{}));
    Tensor rKt = thr_mma.partition_fragment_B(make_tensor(make_smem_ptr(elem_at(2 * kT)), SLTn{}));
    auto ldsm_a = make_tiled_copy_A(typename Tr::LdsmA{}, mma);
    auto ldsm_b = make_tiled_copy_B(typename Tr::LdsmB{}, mma);
    auto ldsm_bt = make_tiled_copy_B(typename Tr::LdsmBT{}, mma);
    Tensor cS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{}));

    // lse / delta of this thread's rows (rows beyond Lq: lse = +inf so P = 0).
    constexpr int kRows = 2 * decltype(size<1>(acc_dq))::value;
    float row_lse[kRows], row_delta[kRows];
    CUTE_UNROLL
    for (int mi = 0; mi < kRows / 2; ++mi) {
      CUTE_UNROLL
      for (int half = 0; half < 2; ++half) {
        const int qi = q0 + get<0>(cQ(half * 2, mi, 0));
        float l = qi < Lq() ? g.lse[qi] : INFINITY;
        row_lse[mi * 2 + half] = l == -INFINITY ? INFINITY : l;  // fully masked row: P = 0
        row_delta[mi * 2 + half] = qi < Lq() ? g.delta[qi] : 0.f;
      }
    }
    const bool mask_rows = p.mask.sq != 0, bias_rows = p.bias.sq != 0;

    for (int i = 0; i < n_steps; ++i) {
      const int buf = i & 1;
      const int n = tile_of(i), k0 = n * kBN;
      const bool partial = partial_of(i);
      cp_async_wait<0>();
      __syncthreads();  // step i's tiles landed; everyone is done with step i - 1's buffer
      if (i + 1 < n_steps) issue(i + 1);
      cp_async_fence();

      Tensor sK = make_tensor(make_smem_ptr(elem_at((2 + 2 * buf) * kT)), SL{});
      Tensor sV = make_tensor(make_smem_ptr(elem_at((3 + 2 * buf) * kT)), SL{});
      Tensor sKt = make_tensor(make_smem_ptr(elem_at((2 + 2 * buf) * kT)), SLT{});
      const char* mtile = mask_smem + buf * MaskT::kBytes;
      const char* btile = bias_smem + buf * BiasT::kBytes;

      Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBM>, Int<kBN>>{});
      Tensor acc_dp = partition_fragment_C(mma, Shape<Int<kBM>, Int<kBN>>{});
      clear(acc_s);
      clear(acc_dp);
      gemm_ss(mma, acc_s, rQ, rK, sQ, sK, ldsm_a, ldsm_b, tid);
      gemm_ss(mma, acc_dp, rdO, rK, sdO, sV, ldsm_a, ldsm_b, tid);

      const bool check = partial || (k0 + kBN > Lk());
      CUTE_UNROLL
      for (int e = 0; e < size(acc_s); ++e) {
        const int r = get<0>(cS(e)), c = get<1>(cS(e));
        const int slot = (e / 4 % size<1>(acc_s)) * 2 + (e % 4) / 2;
        float dt;
        float s = score<kSoftcap>(acc_s(e), p, dt);
        if constexpr (kHasBias) s += float(BiasT::read(btile, bias_rows, r, c));
        bool visible = true;
        if (check) {
          const int qi = q0 + r, kj = k0 + c;
          visible = kj < Lk();
          // Bitwise, not short-circuit: no per-element branches (the mask tile read is in
          // bounds either way and ignored when !partial).
          visible &= !p.causal | (kj <= qi + Lk() - Lq());
          if constexpr (kHasMask) {
            visible &= !partial | (MaskT::read(mtile, mask_rows, r, c) != 0);
          }
        }
        const float pr = visible ? __expf(s - row_lse[slot]) : 0.f;
        const float ds = pr * (acc_dp(e) - row_delta[slot]);
        if constexpr (kHasBias) {
          if (p.dbias_full != nullptr) {
            const int qi = q0 + r, kj = k0 + c;
            if (qi < Lq() && kj < Lk()) {
              Elem* db = reinterpret_cast<Elem*>(p.dbias_full) + int64_t(b) * p.dbf_sb +
                         int64_t(h) * p.dbf_sh + int64_t(qi) * p.dbf_sq + kj;
              *db = Elem(ds);
            }
          }
        }
        acc_s(e) = ds * dt;
      }
      Tensor rdS = to_type<Elem>(acc_s);
      Tensor rdSa = make_tensor(rdS.data(), acc_as_a_layout(rdS.layout()));
      gemm_rs(mma, acc_dq, rdSa, rKt, sKt, ldsm_bt, tid);
    }
  }

  if (!p.need_dq) return;
  // Written out rather than through store_rows: that call compiled the dQ kernel to ~700 more
  // instructions (sm_90, nvcc 13.0) and this loop is the one the GPU tests validated.
  Elem* dq = reinterpret_cast<Elem*>(p.dq) + int64_t(b) * p.dq_sb + sr.q_row0 * p.dq_sl +
             int64_t(h) * p.dq_sh;
  CUTE_UNROLL
  for (int mi = 0; mi < size<1>(acc_dq); ++mi) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int row = q0 + get<0>(cQ(half * 2, mi, 0));
      if (row >= Lq()) continue;
      Elem* drow = dq + int64_t(row) * p.dq_sl;
      CUTE_UNROLL
      for (int ni = 0; ni < size<2>(acc_dq); ++ni) {
        const int col = get<1>(cQ(half * 2, mi, ni));
        if (col < p.D) {
          __align__(4) Elem pair[2] = {Elem(acc_dq(half * 2, mi, ni) * p.scale),
                                       Elem(acc_dq(half * 2 + 1, mi, ni) * p.scale)};
          *reinterpret_cast<uint32_t*>(drow + col) = *reinterpret_cast<uint32_t*>(pair);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// dK, dV (+ per-key dbias partials)
// ---------------------------------------------------------------------------------------------
template <bool kSoftcap>
__global__ void __launch_bounds__(BwdConfig<kHeadDimBucket>::TrKV::kThreads)
    dkdv_kernel(const BwdParams p) {
  using Cfg = BwdConfig<kHeadDimBucket>;
  using Tr = typename Cfg::TrKV;
  constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kD = kHeadDimBucket;
  constexpr int kT = Cfg::kTileBytes;
  constexpr int kThreads = Tr::kThreads;
  using MaskT = MaskTile64<kThreads>;
  using BiasT = BiasTile64<kThreads>;
  extern __shared__ __align__(128) char smem[];
  // [K][V][Q0][dO0][Q1][dO1][lse0][lse1][delta0][delta1][rowsum scratch][mask0/1][bias0/1]
  float* lse_s = reinterpret_cast<float*>(smem + 6 * kT);
  float* delta_s = lse_s + 2 * kBM;
  float* red_s = delta_s + 2 * kBM;  // (kWarpsN, kBN) partial row sums for dbias
  char* mask_smem = reinterpret_cast<char*>(red_s + Tr::kWarpsN * kBN);
  char* bias_smem = mask_smem + (kHasMask ? 2 * MaskT::kBytes : 0);

  const int tid = threadIdx.x;
  int n_block, slot;
  dkdv_block_of(p.causal, n_block, slot);
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

  using SL = typename Tr::template SmemTile<64>;
  using SLT = typename Tr::template SmemTileT<64>;  // swizzled: what ldmatrix reads
  using SLTn = typename Tr::template SmemTileTNoSwizzle<64>;  // fragment shapes only
  auto elem_at = [&](int off) { return reinterpret_cast<Elem*>(smem + off); };
  Tensor sK = make_tensor(make_smem_ptr(elem_at(0)), SL{});
  Tensor sV = make_tensor(make_smem_ptr(elem_at(kT)), SL{});

  typename Tr::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  Tensor acc_dk = partition_fragment_C(mma, Shape<Int<kBN>, Int<kD>>{});
  Tensor acc_dv = partition_fragment_C(mma, Shape<Int<kBN>, Int<kD>>{});
  clear(acc_dk);
  clear(acc_dv);
  Tensor cS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBN>, Int<kBM>>{}));
  Tensor cKV = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBN>, Int<kD>>{}));
  auto ldsm_a = make_tiled_copy_A(typename Tr::LdsmA{}, mma);
  auto ldsm_b = make_tiled_copy_B(typename Tr::LdsmB{}, mma);
  auto ldsm_bt = make_tiled_copy_B(typename Tr::LdsmBT{}, mma);

  const Elem* kg = reinterpret_cast<const Elem*>(p.k) + int64_t(b) * p.k_sb +
                   (sr.k_row0 + k0) * p.k_sl + int64_t(hkv) * p.k_sh;
  const Elem* vg = reinterpret_cast<const Elem*>(p.v) + int64_t(b) * p.v_sb +
                   (sr.k_row0 + k0) * p.v_sl + int64_t(hkv) * p.v_sh;
  load_rows<Tr, 64>(kg, p.k_sl, Lk() - k0, p.D, sK, tid);
  load_rows<Tr, 64>(vg, p.v_sl, Lk() - k0, p.D, sV, tid);
  cp_async_fence();

  Tensor rK = thr_mma.partition_fragment_A(sK);
  Tensor rV = thr_mma.partition_fragment_A(sV);
  Tensor rQ = thr_mma.partition_fragment_B(make_tensor(make_smem_ptr(elem_at(2 * kT)), SL{}));
  Tensor rQt = thr_mma.partition_fragment_B(make_tensor(make_smem_ptr(elem_at(2 * kT)), SLTn{}));
  const bool mask_rows = p.mask.sq != 0, bias_rows = p.bias.sq != 0;
  const bool keys_dbias = kHasBias && p.dbias_keys != nullptr;
  constexpr int kRowSlots = 2 * decltype(size<1>(acc_dk))::value;

  for (int hh = 0; hh < group; ++hh) {
    const int h = hkv * group + hh;
    int m_steps, m_first;
    bool key_partial;
    const int32_t* list = dkdv_query_tiles<kBM, kBN>(p, sr, b, h, n_block, m_tiles, m_steps,
                                                     m_first, key_partial);
    float key_dbias[kRowSlots];
    CUTE_UNROLL
    for (int r = 0; r < kRowSlots; ++r) key_dbias[r] = 0.f;

    const BwdHeadOperands g = bwd_head_operands(p, sr, b, h);
    auto tile_of = [&](int i) { return list ? (list[i] >> 1) : m_first + i; };
    auto partial_of = [&](int i) -> bool {
      return list ? (list[i] & 1) != 0
                  : dkdv_tile_partial<kBM, kBN>(p, sr, key_partial, k0, tile_of(i) * kBM);
    };
    auto issue = [&](int i) {
      const int m = tile_of(i), q0 = m * kBM, buf = i & 1;
      Tensor sQ = make_tensor(make_smem_ptr(elem_at((2 + 2 * buf) * kT)), SL{});
      Tensor sdO = make_tensor(make_smem_ptr(elem_at((3 + 2 * buf) * kT)), SL{});
      load_rows<Tr, 64>(g.q + int64_t(q0) * p.q_sl, p.q_sl, Lq() - q0, p.D, sQ, tid);
      load_rows<Tr, 64>(g.dout + int64_t(q0) * p.do_sl, p.do_sl, Lq() - q0, p.D, sdO, tid);
      load_floats<kBM>(lse_s + buf * kBM, g.lse + q0, Lq() - q0, tid, kThreads);
      load_floats<kBM>(delta_s + buf * kBM, g.delta + q0, Lq() - q0, tid, kThreads);
      if constexpr (kHasMask) {
        if (partial_of(i))
          MaskT::load(mask_smem + buf * MaskT::kBytes, p.mask, g.mask, q0, k0, Lq(), Lk(), tid);
      }
      if constexpr (kHasBias) {
        BiasT::load(bias_smem + buf * BiasT::kBytes, p.bias, g.bias, q0, k0, Lq(), Lk(), tid);
      }
    };

    if (m_steps > 0) {
      __syncthreads();  // the previous head's last step is done with buffer 0
      issue(0);
      cp_async_fence();
    }
    for (int i = 0; i < m_steps; ++i) {
      const int buf = i & 1;
      const int m = tile_of(i), q0 = m * kBM;
      const bool partial = partial_of(i);
      cp_async_wait<0>();
      __syncthreads();
      if (i + 1 < m_steps) issue(i + 1);
      cp_async_fence();

      Tensor sQ = make_tensor(make_smem_ptr(elem_at((2 + 2 * buf) * kT)), SL{});
      Tensor sdO = make_tensor(make_smem_ptr(elem_at((3 + 2 * buf) * kT)), SL{});
      Tensor sQt = make_tensor(make_smem_ptr(elem_at((2 + 2 * buf) * kT)), SLT{});
      Tensor sdOt = make_tensor(make_smem_ptr(elem_at((3 + 2 * buf) * kT)), SLT{});
      const float* lse_t = lse_s + buf * kBM;
      const float* delta_t = delta_s + buf * kBM;
      const char* mtile = mask_smem + buf * MaskT::kBytes;
      const char* btile = bias_smem + buf * BiasT::kBytes;

      Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBN>, Int<kBM>>{});  // S^T
      clear(acc_s);
      gemm_ss(mma, acc_s, rK, rQ, sK, sQ, ldsm_a, ldsm_b, tid);

      const bool check = partial || (q0 + kBM > Lq()) || (k0 + kBN > Lk());
      Tensor dts = make_tensor_like(acc_s);
      CUTE_UNROLL
      for (int e = 0; e < size(acc_s); ++e) {
        const int r = get<0>(cS(e)), c = get<1>(cS(e));  // r: key, c: query
        float dt;
        float s = score<kSoftcap>(acc_s(e), p, dt);
        dts(e) = dt;
        if constexpr (kHasBias) s += float(BiasT::read(btile, bias_rows, c, r));
        bool visible = true;
        if (check) {
          const int qi = q0 + c, kj = k0 + r;
          visible = qi < Lq() && kj < Lk();
          visible &= !p.causal | (kj <= qi + Lk() - Lq());  // bitwise: branch-free
          if constexpr (kHasMask) {
            visible &= !partial | (MaskT::read(mtile, mask_rows, c, r) != 0);
          }
        }
        float l = lse_t[c];
        l = l == -INFINITY ? INFINITY : l;
        acc_s(e) = visible ? __expf(s - l) : 0.f;  // P^T
      }
      {
        Tensor rP = to_type<Elem>(acc_s);
        Tensor rPa = make_tensor(rP.data(), acc_as_a_layout(rP.layout()));
        gemm_rs(mma, acc_dv, rPa, rQt, sdOt, ldsm_bt, tid);
      }
      Tensor acc_dp = partition_fragment_C(mma, Shape<Int<kBN>, Int<kBM>>{});  // dP^T
      clear(acc_dp);
      gemm_ss(mma, acc_dp, rV, rQ, sV, sdO, ldsm_a, ldsm_b, tid);
      CUTE_UNROLL
      for (int e = 0; e < size(acc_s); ++e) {
        const int c = get<1>(cS(e));
        const float ds = acc_s(e) * (acc_dp(e) - delta_t[c]);
        if (keys_dbias) key_dbias[(e / 4 % size<1>(acc_s)) * 2 + (e % 4) / 2] += ds;
        acc_s(e) = ds * dts(e);
      }
      Tensor rdS = to_type<Elem>(acc_s);
      Tensor rdSa = make_tensor(rdS.data(), acc_as_a_layout(rdS.layout()));
      gemm_rs(mma, acc_dk, rdSa, rQt, sQt, ldsm_bt, tid);
    }

    if (keys_dbias) {
      // Per-key sum over this head's queries: quad shuffle, then across warp columns in a
      // fixed order (deterministic).
      const int warp_n = (tid / 32) / Tr::kWarpsM;
      const int lane = tid % 32;
      __syncthreads();
      CUTE_UNROLL
      for (int mi = 0; mi < kRowSlots / 2; ++mi) {
        CUTE_UNROLL
        for (int half = 0; half < 2; ++half) {
          const float v = quad_sum(key_dbias[mi * 2 + half]);
          const int r = get<0>(cS(half * 2, mi, 0));
          if (lane % 4 == 0) red_s[warp_n * kBN + r] = v;
        }
      }
      __syncthreads();
      for (int r = tid; r < kBN; r += kThreads) {
        if (k0 + r < Lk()) {
          float v = 0.f;
          for (int w = 0; w < Tr::kWarpsN; ++w) v += red_s[w * kBN + r];
          p.dbias_keys[dbias_key_offset(p, sr, b, h) + k0 + r] = v;
        }
      }
    }
  }

  if (!p.need_dkv) return;
  Elem* dk = reinterpret_cast<Elem*>(p.dk) + int64_t(b) * p.dk_sb + sr.k_row0 * p.dk_sl +
             int64_t(hkv) * p.dk_sh;
  Elem* dv = reinterpret_cast<Elem*>(p.dv) + int64_t(b) * p.dv_sb + sr.k_row0 * p.dv_sl +
             int64_t(hkv) * p.dv_sh;
  store_rows(dk, p.dk_sl, k0, Lk(), p.D, p.scale, acc_dk, cKV);
  store_rows(dv, p.dv_sl, k0, Lk(), p.D, 1.f, acc_dv, cKV);
}

// ---------------------------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------------------------
static int dq_smem() {
  using Cfg = BwdConfig<kHeadDimBucket>;
  constexpr int kThreads = Cfg::TrQ::kThreads;
  return 6 * Cfg::kTileBytes + (kHasMask ? 2 * MaskTile64<kThreads>::kBytes : 0) +
         (kHasBias ? 2 * BiasTile64<kThreads>::kBytes : 0);
}

static int dkdv_smem() {
  using Cfg = BwdConfig<kHeadDimBucket>;
  constexpr int kThreads = Cfg::TrKV::kThreads;
  return 6 * Cfg::kTileBytes + (4 * Cfg::kBlockM + Cfg::TrKV::kWarpsN * Cfg::kBlockN) * 4 +
         (kHasMask ? 2 * MaskTile64<kThreads>::kBytes : 0) +
         (kHasBias ? 2 * BiasTile64<kThreads>::kBytes : 0);
}

template <typename Kernel>
static cudaError_t prepare(Kernel kernel, int smem) {
  if (smem > 48 * 1024) {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  }
  return cudaSuccess;
}

template <bool kSoftcap>
static cudaError_t launch_bwd(const BwdParams& p, cudaStream_t stream) {
  using Cfg = BwdConfig<kHeadDimBucket>;
  launch_delta(p, stream);
  if (p.need_dq || p.dbias_full != nullptr) {
    auto kernel = &dq_kernel<kSoftcap>;
    cudaError_t err = prepare(kernel, dq_smem());
    if (err != cudaSuccess) return err;
    dim3 grid((p.Lq + Cfg::kBlockM - 1) / Cfg::kBlockM, p.B * p.H);
    kernel<<<grid, Cfg::TrQ::kThreads, dq_smem(), stream>>>(p);
  }
  if (p.need_dkv || p.dbias_keys != nullptr) {
    auto kernel = &dkdv_kernel<kSoftcap>;
    cudaError_t err = prepare(kernel, dkdv_smem());
    if (err != cudaSuccess) return err;
    dim3 grid((p.Lk + Cfg::kBlockN - 1) / Cfg::kBlockN, p.B * p.Hkv);
    kernel<<<grid, Cfg::TrKV::kThreads, dkdv_smem(), stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t run_bwd(const BwdParams& p, cudaStream_t stream) {
  return p.softcap > 0.f ? launch_bwd<true>(p, stream) : launch_bwd<false>(p, stream);
}

int bwd_block_m() { return BwdConfig<kHeadDimBucket>::kBlockM; }
int bwd_block_n() { return BwdConfig<kHeadDimBucket>::kBlockN; }
bool bwd_fused_dq() { return false; }  // the sm80 backward always runs its own dQ kernel
bool bwd_gathers() { return false; }
int bwd_gather_block_m() { return 0; }  // no gathered dQ kernel: bwd_gathers() is false
bool bwd_key_bits() { return false; }  // the sm80 dK/dV kernel reads the mask tile itself

#else  // FLASH_DMATTN_SM90_BWD
// flash_bwd_sm90.cu: the wgmma backward, used whenever the module is built for sm_90a and the
// head dim is at most 128.
cudaError_t run_bwd_sm90(const BwdParams& p, cudaStream_t stream);
int bwd_sm90_block_m();
int bwd_sm90_block_n();
bool bwd_sm90_fused_dq();
bool bwd_sm90_gathers();
int dq_gathered_block_m();  // flash_dq_gathered_sm90.cu
cudaError_t run_bwd(const BwdParams& p, cudaStream_t stream) { return run_bwd_sm90(p, stream); }
int bwd_block_m() { return bwd_sm90_block_m(); }
int bwd_block_n() { return bwd_sm90_block_n(); }
bool bwd_fused_dq() { return bwd_sm90_fused_dq(); }
bool bwd_gathers() { return bwd_sm90_gathers(); }
// The gathered dQ kernel's query tile: the gathered forward's, whose lists it walks.
int bwd_gather_block_m() { return dq_gathered_block_m(); }
bool bwd_key_bits() { return kHasMask && !kPacked; }
#endif  // FLASH_DMATTN_SM90_BWD
// Attention dropout: the sm_90 kernels (the gathered dQ kernel has none).
bool bwd_dropout() { return FLASH_DMATTN_DROPOUT; }

}  // namespace flash_dmattn
