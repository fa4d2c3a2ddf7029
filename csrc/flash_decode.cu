// Split-KV decode forward: a few queries against a long (cached, optionally paged) key range.
//
// Decoding is bandwidth-bound: a step must read K, V, mask and bias once. The forward kernel
// gives each query head its own CTA (so a GQA group reads every K/V tile G times) and one CTA
// per (batch, head) for Lq = 1, far too few to fill the GPU. Here:
//   * one CTA owns (key split, batch, kv head); its rows are the kv head's G query heads times
//     the Lq queries (row r = g * Lq + i, at most 64), so each K/V tile is read once per kv head;
//   * the batch's used keys (cache_seqlens) are divided into num_splits ranges of whole 64-key
//     tiles; each split writes its normalised fp32 output and lse, and decode_combine_kernel
//     merges them (a single split writes the output directly);
//   * K/V (and mask / bias) tiles stream through kStages cp.async buffers, so the next tiles'
//     loads are in flight while one is computed; Q lives in registers (loaded once);
//   * paged KV: each row of a tile finds its page in the block table, so tiles may span pages
//     and the tile size does not depend on the page size.
// Mask and bias are read through their strides in every broadcast shape; a per-key one that
// all rows of the CTA share (the dynamic-mask decode case) is loaded as one row per tile.
#include "flash_dmattn/kernel_common.cuh"

namespace flash_dmattn {

#if !FLASH_DMATTN_PACKED

template <int kHeadDim>
struct DecodeConfig {
  static constexpr int kBlockM = 64;  // packed rows (G * Lq <= 64), one warp per 16
  static constexpr int kBlockN = 64;
  // K/V tile buffers: tiles t + 1 .. t + kStages - 1 are in flight while tile t is computed.
  // Three (96 KB at head dim 128) leave room for a second CTA on the SM; 256 fits two.
  static constexpr int kStages = kHeadDim <= 192 ? 3 : 2;
  using Tr = Traits<kHeadDim, kBlockM, kBlockN, kBlockM / 16, 1>;
  using MaskTile = BcastTile<uint8_t, kBlockM, kBlockN, Tr::kThreads>;
  using BiasTile = BcastTile<Elem, kBlockM, kBlockN, Tr::kThreads>;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  // Up to head dim 128 Q is staged in the last buffer and moved to registers before that
  // buffer's first tile is issued, so it needs no shared memory of its own. Larger heads keep
  // Q in shared memory (in registers it spilled: 180 bytes at 256 on sm_90a).
  static constexpr bool kQInRegs = kHeadDim <= 128;
  static constexpr int kQOff = kQInRegs ? (kStages - 1) * 2 * kKVBytes : kStages * 2 * kKVBytes;
  static_assert(kQBytes <= 2 * kKVBytes, "Q fits one K/V buffer");
  static constexpr int kAuxOff = kStages * 2 * kKVBytes + (kQInRegs ? 0 : kQBytes);

  // Bytes of one stage of a mask / bias tile: one row when every CTA row shares it.
  template <typename Tile>
  __host__ __device__ static constexpr int aux_stage_bytes(bool present, bool shared) {
    return present ? ((shared ? 1 : kBlockM) * Tile::kPitch + 127) / 128 * 128 : 0;
  }
  __host__ __device__ static constexpr int mask_off() { return kAuxOff; }
  __host__ __device__ static constexpr int bias_off(bool mask_shared) {
    return kAuxOff + kStages * aux_stage_bytes<MaskTile>(kHasMask, mask_shared);
  }
  __host__ __device__ static constexpr int smem_bytes(bool mask_shared, bool bias_shared) {
    return bias_off(mask_shared) + kStages * aux_stage_bytes<BiasTile>(kHasBias, bias_shared);
  }
};

// Copy an (R x kHeadDim) tile into the swizzled SmemTile<R> layout like load_tile_swizzled,
// but with each row's address from row_ptr(r) (paged keys, packed query heads). Rows >=
// rows_valid and columns >= cols_valid are zero-filled (`fallback` is a valid address that
// zero-byte copies name).
template <int kHeadDim, int kAtomK, int kThreads, int R, typename RowPtr>
__device__ __forceinline__ void load_tile_rows(RowPtr row_ptr, const Elem* fallback,
                                               int rows_valid, int cols_valid, char* smem,
                                               int tid) {
  constexpr int kRowBytes = kAtomK * 2;
  constexpr int kChunksPerRow = kRowBytes / 16;
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  constexpr int kPasses = R / kRowsPerPass;
  constexpr int kBlocks = kHeadDim / kAtomK;
  static_assert(R % kRowsPerPass == 0 && kRowsPerPass % 8 == 0, "tile rows");
  const int r0 = tid / kChunksPerRow, c = tid % kChunksPerRow;
  // Every row this thread copies has the same row within the 8-row swizzle atom.
  const int swz = kRowBytes == 128 ? (r0 % 8) : ((r0 % 8) >> 1);
  char* s0 = smem + (r0 / 8) * 8 * kRowBytes + (r0 % 8) * kRowBytes + ((c ^ swz) * 16);
  CUTE_UNROLL
  for (int j = 0; j < kPasses; ++j) {
    const int r = r0 + j * kRowsPerPass;
    const bool row_ok = r < rows_valid;
    const Elem* g = row_ok ? row_ptr(r) + c * 8 : fallback;
    CUTE_UNROLL
    for (int b = 0; b < kBlocks; ++b) {
      const bool ok = row_ok && b * kAtomK + c * 8 < cols_valid;
      cp_async_16(s0 + b * R * kRowBytes + j * kRowsPerPass * kRowBytes,
                  ok ? g + b * kAtomK : fallback, ok ? 16 : 0);
    }
  }
}

// One stage of a mask / bias tile: rows r < n_rows (n_rows = 1 when shared) of the decode
// CTA, columns k0 .. k0 + kBlockN, zero beyond `cols`. row_base(r) is the byte address of
// row r's key k0.
template <typename T, typename Tile, int kBlockN, int kThreads, typename RowBase>
__device__ __forceinline__ void load_decode_aux(char* smem, const Bcast& a, RowBase row_base,
                                                const char* fallback, int n_rows, int cols,
                                                int tid) {
  if (a.vec) {
    constexpr int kChunks = kBlockN * int(sizeof(T)) / 16;
    for (int c = tid; c < n_rows * kChunks; c += kThreads) {
      const int r = c / kChunks, ch = c % kChunks;
      const int valid = max(0, min(16, cols * int(sizeof(T)) - ch * 16));
      cp_async_16(smem + r * Tile::kPitch + ch * 16, valid > 0 ? row_base(r) + ch * 16 : fallback,
                  valid);
    }
  } else {
    for (int e = tid; e < n_rows * kBlockN; e += kThreads) {
      const int r = e / kBlockN, c = e % kBlockN;
      T val = T(0);
      if (c < cols) val = *reinterpret_cast<const T*>(row_base(r) + int64_t(c) * a.sk * int64_t(sizeof(T)));
      *reinterpret_cast<T*>(smem + r * Tile::kPitch + c * int(sizeof(T))) = val;
    }
  }
}

// kWarpSplit (G * Lq <= 16 rows): the four warps would otherwise hold 16 rows each, of which
// only warp 0's are real, so one warp computed every tile while three waited at the barrier
// (a per-key mask + bias decode ran 1.35-1.5x slower than Triton's). Instead every warp holds
// the same real rows (Q is staged four times) and takes its own 16 keys of each 64-key tile,
// with its own softmax state; after the loop the four states are merged through shared memory
// and warp 0 writes the split. (Writing each warp's state as a split of its own for the
// combine kernel made steps with many splits slower.)
template <bool kSoftcap, bool kWarpSplit>
__global__ void __launch_bounds__(DecodeConfig<kHeadDimBucket>::Tr::kThreads)
    decode_kernel(const DecodeParams p) {
  using Cfg = DecodeConfig<kHeadDimBucket>;
  using Tr = typename Cfg::Tr;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kD = kHeadDimBucket;
  constexpr int kStages = Cfg::kStages;
  constexpr int kWarpRows = 16;  // rows of one warp's MMA tile
  // Keys of a tile a warp computes: its quarter with kWarpSplit, else all of them.
  constexpr int kWarpKeys = kWarpSplit ? kBlockN / (kBlockM / kWarpRows) : kBlockN;
  extern __shared__ __align__(128) char smem[];
  const int warp = threadIdx.x / 32;

  const int tid = threadIdx.x;
  const int split = blockIdx.x;
  const int bk = blockIdx.y;
  const int b = bk / p.Hkv, hkv = bk % p.Hkv;
  const int h0 = hkv * p.G;  // first query head of the group

  // This split's keys: the used keys in num_splits ranges of whole tiles.
  const int used = p.seqused ? min(max(p.seqused[b], 0), p.Lk) : p.Lk;
  const int per_split =
      ((used + p.num_splits - 1) / p.num_splits + kBlockN - 1) / kBlockN * kBlockN;
  const int k_begin = split * per_split;
  const int k_end = min(used, k_begin + per_split);
  const int n_tiles = k_end > k_begin ? (k_end - k_begin + kBlockN - 1) / kBlockN : 0;

  typename Tr::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  Tensor acc_o = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kD>>{});
  clear(acc_o);
  Tensor cO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kD>>{}));
  constexpr int kRowsPerThread = 2 * decltype(size<1>(acc_o))::value;
  float row_max[kRowsPerThread], row_sum[kRowsPerThread];
  init_row_state(row_max, row_sum);

  if (n_tiles > 0) {
    const Elem* qg = reinterpret_cast<const Elem*>(p.q) + int64_t(b) * p.q_sb;
    // Paged or not is a runtime switch (uniform per CTA): a template parameter doubled the
    // module's compile time for a branch per copied row.
    const bool paged = p.block_table != nullptr;
    const Elem* kg = reinterpret_cast<const Elem*>(p.k) + int64_t(hkv) * p.k_sh;
    const Elem* vg = reinterpret_cast<const Elem*>(p.v) + int64_t(hkv) * p.v_sh;
    if (!paged) {
      kg += int64_t(b) * p.k_sb;
      vg += int64_t(b) * p.v_sb;
    }
    const int32_t* table = paged ? p.block_table + int64_t(b) * p.bt_sb : nullptr;
    // Row offset (in elements, before the kv-head offset) of logical key j.
    auto key_row = [&](int j, int64_t page_stride, int64_t slot_stride) -> int64_t {
      if (paged) {
        // Page ids are not checked on the device (that would sync the host); clamped so a bad
        // id reads a wrong page rather than out of bounds.
        const int page = min(max(table[j / p.page_size], 0), p.num_pages - 1);
        return int64_t(page) * page_stride + int64_t(j % p.page_size) * slot_stride;
      }
      return int64_t(j) * slot_stride;
    };
    const char* mask_b = kHasMask ? reinterpret_cast<const char*>(p.mask.ptr) + int64_t(b) * p.mask.sb : nullptr;
    const char* bias_b = kHasBias
        ? reinterpret_cast<const char*>(p.bias.ptr) + int64_t(b) * p.bias.sb * int64_t(sizeof(Elem))
        : nullptr;
    const int mask_rows = p.mask_shared ? 1 : p.rows;
    const int bias_rows = p.bias_shared ? 1 : p.rows;
    const int mask_stage = Cfg::template aux_stage_bytes<typename Cfg::MaskTile>(kHasMask, p.mask_shared);
    const int bias_stage = Cfg::template aux_stage_bytes<typename Cfg::BiasTile>(kHasBias, p.bias_shared);
    char* mask_smem = smem + Cfg::mask_off();
    char* bias_smem = smem + Cfg::bias_off(p.mask_shared);

    // Byte address of key k0 in the mask / bias row of CTA row r (query head h0 + r / Lq,
    // query r % Lq), for a tensor of elem_bytes-byte elements based at `base`.
    auto aux_row = [&](const char* base, const Bcast& a, int elem_bytes, int r, int k0) {
      const int g = r / p.Lq, i = r % p.Lq;
      return base + (int64_t((h0 + g) / a.hdiv) * a.sh + int64_t(i) * a.sq + int64_t(k0) * a.sk) *
                        int64_t(elem_bytes);
    };
    // Issue tile t of this split (keys k_begin + t * kBlockN ..) into buffer `stage`.
    auto issue_tile = [&](int t, int stage) {
      const int k0 = k_begin + t * kBlockN;
      const int valid = k_end - k0;
      char* ks = smem + stage * 2 * Cfg::kKVBytes;
      load_tile_rows<kD, Tr::kSmemK, Tr::kThreads, kBlockN>(
          [&](int r) { return kg + key_row(k0 + r, p.k_sb, p.k_sl); }, kg, valid, p.D, ks, tid);
      load_tile_rows<kD, Tr::kSmemK, Tr::kThreads, kBlockN>(
          [&](int r) { return vg + key_row(k0 + r, p.v_sb, p.v_sl); }, vg, valid, p.D,
          ks + Cfg::kKVBytes, tid);
      if constexpr (kHasMask) {
        load_decode_aux<uint8_t, typename Cfg::MaskTile, kBlockN, Tr::kThreads>(
            mask_smem + stage * mask_stage, p.mask,
            [&](int r) { return aux_row(mask_b, p.mask, 1, r, k0); }, mask_b, mask_rows, valid,
            tid);
      }
      if constexpr (kHasBias) {
        load_decode_aux<Elem, typename Cfg::BiasTile, kBlockN, Tr::kThreads>(
            bias_smem + stage * bias_stage, p.bias,
            [&](int r) { return aux_row(bias_b, p.bias, int(sizeof(Elem)), r, k0); }, bias_b,
            bias_rows, valid, tid);
      }
    };

    Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(smem + Cfg::kQOff)),
                            typename Tr::template SmemTile<kBlockM>{});
    load_tile_rows<kD, Tr::kSmemK, Tr::kThreads, kBlockM>(
        [&](int r) {
          // Warp split: row r holds real row r % 16 (padding rows repeat row 0; their results
          // are never written).
          if constexpr (kWarpSplit) r = r % kWarpRows < p.rows ? r % kWarpRows : 0;
          const int g = r / p.Lq, i = r % p.Lq;
          return qg + int64_t(i) * p.q_sl + int64_t(h0 + g) * p.q_sh;
        },
        qg, kWarpSplit ? kBlockM : p.rows, p.D, smem + Cfg::kQOff, tid);
    CUTE_UNROLL
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < n_tiles) issue_tile(s, s);
      cp_async_fence();  // one group per stage, even when empty, so the waits count right
    }

    auto ldsm_q = make_tiled_copy_A(typename Tr::LdsmA{}, mma);
    Tensor rQ = thr_mma.partition_fragment_A(sQ);
    if constexpr (Cfg::kQInRegs) {
      // Q (in group 0, with tile 0) to registers once; the loop's first barrier then frees
      // its buffer for tile kStages - 1.
      cp_async_wait<kStages - 2>();
      __syncthreads();
      auto thr_q = ldsm_q.get_thread_slice(tid);
      Tensor tsQ = thr_q.partition_S(sQ);
      Tensor trQ = thr_q.retile_D(rQ);
      copy(ldsm_q, tsQ, trQ);
    }
    // B fragments of this warp's keys (of all keys without the warp split).
    Tensor rKw = thr_mma.partition_fragment_B(make_tensor(
        make_smem_ptr(reinterpret_cast<Elem*>(smem)), typename Tr::template SmemTile<kWarpKeys>{}));
    Tensor rVtw = thr_mma.partition_fragment_B(make_tensor(
        make_smem_ptr(reinterpret_cast<Elem*>(smem)),
        typename Tr::template SmemTileTNoSwizzle<kWarpKeys>{}));
    auto ldsm_k = make_tiled_copy_B(typename Tr::LdsmB{}, mma);
    auto ldsm_vt = make_tiled_copy_B(typename Tr::LdsmBT{}, mma);
    // Score tile coordinates: (CTA row, column within the warp's keys).
    Tensor cS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kWarpKeys>>{}));
    const int key_off = kWarpSplit ? warp * kWarpKeys : 0;  // first key of this warp's columns

    // The last key row r may see (causal: bottom-right aligned with the used length).
    int last_key[kRowsPerThread];
    CUTE_UNROLL
    for (int mi = 0; mi < size<1>(acc_o); ++mi) {
      CUTE_UNROLL
      for (int half = 0; half < 2; ++half) {
        int r = get<0>(cS(half * 2, mi, 0));
        if constexpr (kWarpSplit) r %= kWarpRows;
        last_key[mi * 2 + half] = p.causal ? r % p.Lq + used - p.Lq : INT_MAX;
      }
    }

    const bool warp_live = kWarpSplit || warp * kWarpRows < p.rows;
    for (int t = 0; t < n_tiles; ++t) {
      const int stage = t % kStages;
      const int k0 = k_begin + t * kBlockN;
      cp_async_wait<kStages - 2>();
      __syncthreads();  // tile t landed for every thread; every thread is done with tile t - 1
      if (t + kStages - 1 < n_tiles) issue_tile(t + kStages - 1, (t + kStages - 1) % kStages);
      cp_async_fence();

      char* ks = smem + stage * 2 * Cfg::kKVBytes;
      Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(ks)),
                              typename Tr::template SmemTile<kBlockN>{});
      Tensor sVt = make_tensor(make_smem_ptr(reinterpret_cast<Elem*>(ks + Cfg::kKVBytes)),
                               typename Tr::template SmemTileT<kBlockN>{});
      const char* mtile = mask_smem + stage * mask_stage;
      const char* btile = bias_smem + stage * bias_stage;

      // A warp whose 16 rows are all padding (G * Lq below 64) skips its products and
      // softmax: only the loads and barriers need every thread.
      if (warp_live) {
        // This warp's keys of the tile (all of them without the warp split).
        Tensor sKw = local_tile(sK, Shape<Int<kWarpKeys>, Int<kD>>{},
                                make_coord(key_off / kWarpKeys, 0));
        Tensor sVtw = local_tile(sVt, Shape<Int<kD>, Int<kWarpKeys>>{},
                                 make_coord(0, key_off / kWarpKeys));
        Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kWarpKeys>>{});
        clear(acc_s);
        if constexpr (Cfg::kQInRegs) {
          gemm_rs(mma, acc_s, rQ, rKw, sKw, ldsm_k, tid);
        } else {
          gemm_ss(mma, acc_s, rQ, rKw, sQ, sKw, ldsm_q, ldsm_k, tid);
        }

        // Scores in natural-log units; invisible elements (past the split, causal, masked) -inf.
        const bool check = kHasMask || k0 + kBlockN > k_end ||
                           (p.causal && k0 + kBlockN - 1 > used - p.Lq);
        CUTE_UNROLL
        for (int mi = 0; mi < size<1>(acc_s); ++mi) {
          CUTE_UNROLL
          for (int half = 0; half < 2; ++half) {
            const int lim = min(k_end - 1, last_key[mi * 2 + half]);
            CUTE_UNROLL
            for (int ni = 0; ni < size<2>(acc_s); ++ni) {
              CUTE_UNROLL
              for (int j = 0; j < 2; ++j) {
                int r = get<0>(cS(half * 2 + j, mi, ni));
                if constexpr (kWarpSplit) r %= kWarpRows;
                const int c = key_off + get<1>(cS(half * 2 + j, mi, ni));
                float s = acc_s(half * 2 + j, mi, ni);
                if constexpr (kSoftcap) {
                  s = p.softcap * tanhf(s * (p.scale / p.softcap));
                } else {
                  s *= p.scale;
                }
                if constexpr (kHasBias) {
                  s += float(Cfg::BiasTile::read(btile, !p.bias_shared, r, c));
                }
                if (check) {
                  bool visible = k0 + c <= lim;
                  if constexpr (kHasMask) {
                    visible &= Cfg::MaskTile::read(mtile, !p.mask_shared, r, c) != 0;
                  }
                  if (!visible) s = -INFINITY;
                }
                acc_s(half * 2 + j, mi, ni) = s;
              }
            }
          }
        }

        online_softmax_step(acc_s, acc_o, row_max, row_sum);
        Tensor rP = to_type<Elem>(acc_s);
        Tensor rPa = make_tensor(rP.data(), acc_as_a_layout(rP.layout()));
        gemm_rs(mma, acc_o, rPa, rVtw, sVtw, ldsm_vt, tid);
      }
    }
  }

  const int lane = tid % 32;
  if constexpr (kWarpSplit) {
    // Merge the four warps' (max, sum, output) of each row: m = max_w m_w, and every warp's
    // sum and output scaled by exp(m_w - m). The K/V buffers are free once no copy is in
    // flight and every warp is past its last tile.
    cp_async_wait<0>();
    __syncthreads();
    float* sm_ml = reinterpret_cast<float*>(smem);     // [warp][row][max, sum]
    float* sm_acc = sm_ml + kBlockM / kWarpRows * kWarpRows * 2;  // [warp][row][kD]
    static_assert((kBlockM / kWarpRows) * kWarpRows * (2 + kD) * 4 <= kStages * 2 * Cfg::kKVBytes,
                  "the merge fits the K/V buffers");
    // fn(mi, half, slot, r) for each row slot of this thread (r: the row within the warp).
    auto each_row = [&](auto&& fn) {
      CUTE_UNROLL
      for (int mi = 0; mi < size<1>(acc_o); ++mi) {
        CUTE_UNROLL
        for (int half = 0; half < 2; ++half) {
          fn(mi, half, mi * 2 + half, get<0>(cO(half * 2, mi, 0)) % kWarpRows);
        }
      }
    };
    each_row([&](int, int, int slot, int r) {
      const float sum = quad_sum(row_sum[slot]);
      if (lane % 4 == 0) {
        sm_ml[(warp * kWarpRows + r) * 2] = row_max[slot];
        sm_ml[(warp * kWarpRows + r) * 2 + 1] = sum;
      }
    });
    __syncthreads();
    each_row([&](int mi, int half, int slot, int r) {
      float mx = -INFINITY;
      CUTE_UNROLL
      for (int w = 0; w < kBlockM / kWarpRows; ++w) mx = fmaxf(mx, sm_ml[(w * kWarpRows + r) * 2]);
      // A row no warp saw keeps max -inf and sum 0 (every weight below is 0).
      const float base = mx == -INFINITY ? 0.f : mx * kLog2e;
      float total = 0.f;
      CUTE_UNROLL
      for (int w = 0; w < kBlockM / kWarpRows; ++w) {
        total += sm_ml[(w * kWarpRows + r) * 2 + 1] *
                 exp2f(sm_ml[(w * kWarpRows + r) * 2] * kLog2e - base);
      }
      const float own = exp2f(row_max[slot] * kLog2e - base);
      float* arow = sm_acc + (warp * kWarpRows + r) * kD;
      CUTE_UNROLL
      for (int ni = 0; ni < size<2>(acc_o); ++ni) {
        const int col = get<1>(cO(half * 2, mi, ni));
        *reinterpret_cast<float2*>(arow + col) =
            make_float2(acc_o(half * 2, mi, ni) * own, acc_o(half * 2 + 1, mi, ni) * own);
      }
      // The epilogue below reduces row_sum over the quad: the total once.
      row_max[slot] = mx;
      row_sum[slot] = lane % 4 == 0 ? total : 0.f;
    });
    __syncthreads();
    if (warp != 0) return;
    each_row([&](int mi, int half, int, int r) {
      CUTE_UNROLL
      for (int ni = 0; ni < size<2>(acc_o); ++ni) {
        const int col = get<1>(cO(half * 2, mi, ni));
        float2 v = make_float2(0.f, 0.f);
        CUTE_UNROLL
        for (int w = 0; w < kBlockM / kWarpRows; ++w) {
          const float2 a = *reinterpret_cast<const float2*>(sm_acc + (w * kWarpRows + r) * kD + col);
          v.x += a.x;
          v.y += a.y;
        }
        acc_o(half * 2, mi, ni) = v.x;
        acc_o(half * 2 + 1, mi, ni) = v.y;
      }
    });
  }

  // Epilogue: this split's normalised rows and lse (natural log; -inf and zeros for rows that
  // see no key here), straight into out / lse when there is one split.
  const int64_t part_rows = int64_t(p.B) * p.Hkv * p.rows;
  CUTE_UNROLL
  for (int mi = 0; mi < size<1>(acc_o); ++mi) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int slot = mi * 2 + half;
      const float sum = quad_sum(row_sum[slot]);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const float lse_v = sum > 0.f ? row_max[slot] + logf(sum) : -INFINITY;
      int r = get<0>(cO(half * 2, mi, 0));
      if constexpr (kWarpSplit) r %= kWarpRows;
      if (r >= p.rows) continue;
      const int g = r / p.Lq, i = r % p.Lq, h = h0 + g;
      if (p.num_splits == 1) {
        if (lane % 4 == 0) p.lse[(int64_t(b) * p.H + h) * p.Lq + i] = lse_v;
        Elem* orow = reinterpret_cast<Elem*>(p.out) + int64_t(b) * p.o_sb + int64_t(i) * p.o_sl +
                     int64_t(h) * p.o_sh;
        CUTE_UNROLL
        for (int ni = 0; ni < size<2>(acc_o); ++ni) {
          const int col = get<1>(cO(half * 2, mi, ni));
          if (col < p.D) {
            __align__(4) Elem pair[2] = {Elem(acc_o(half * 2, mi, ni) * inv),
                                         Elem(acc_o(half * 2 + 1, mi, ni) * inv)};
            *reinterpret_cast<uint32_t*>(orow + col) = *reinterpret_cast<uint32_t*>(pair);
          }
        }
      } else {
        const int64_t prow = int64_t(split) * part_rows + int64_t(bk) * p.rows + r;
        if (lane % 4 == 0) p.lse_part[prow] = lse_v;
        float* orow = p.o_part + prow * p.D;
        CUTE_UNROLL
        for (int ni = 0; ni < size<2>(acc_o); ++ni) {
          const int col = get<1>(cO(half * 2, mi, ni));
          if (col < p.D) {
            *reinterpret_cast<float2*>(orow + col) =
                make_float2(acc_o(half * 2, mi, ni) * inv, acc_o(half * 2 + 1, mi, ni) * inv);
          }
        }
      }
    }
  }
}

// Merge the splits of one output row (b, query i, head h): lse = logsumexp over splits of
// lse_s, out = sum_s exp(lse_s - lse) * o_s; a row no split saw stays 0 / -inf.
constexpr int kCombineThreads = 64;

__global__ void __launch_bounds__(kCombineThreads) decode_combine_kernel(const DecodeParams p) {
  const int64_t prow = blockIdx.x;  // (b * Hkv + kv head) * rows + r
  const int bk = int(prow / p.rows), r = int(prow % p.rows);
  const int b = bk / p.Hkv, hkv = bk % p.Hkv;
  const int g = r / p.Lq, i = r % p.Lq, h = hkv * p.G + g;
  const int64_t part_rows = int64_t(p.B) * p.Hkv * p.rows;
  const int splits = p.num_splits;
  float mx = -INFINITY;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, p.lse_part[s * part_rows + prow]);
  float total = 0.f;
  if (mx != -INFINITY) {
    for (int s = 0; s < splits; ++s) total += __expf(p.lse_part[s * part_rows + prow] - mx);
  }
  const float lse_v = mx == -INFINITY ? -INFINITY : mx + logf(total);
  if (threadIdx.x == 0) p.lse[(int64_t(b) * p.H + h) * p.Lq + i] = lse_v;
  Elem* orow = reinterpret_cast<Elem*>(p.out) + int64_t(b) * p.o_sb + int64_t(i) * p.o_sl +
               int64_t(h) * p.o_sh;
  for (int col = threadIdx.x * 2; col < p.D; col += kCombineThreads * 2) {
    float2 acc = make_float2(0.f, 0.f);
    if (mx != -INFINITY) {
      for (int s = 0; s < splits; ++s) {
        const float l = p.lse_part[s * part_rows + prow];
        if (l == -INFINITY) continue;  // also skips the split's unused (zero) rows
        const float w = __expf(l - lse_v);
        const float2 o = *reinterpret_cast<const float2*>(p.o_part + (s * part_rows + prow) * p.D + col);
        acc.x += w * o.x;
        acc.y += w * o.y;
      }
    }
    __align__(4) Elem pair[2] = {Elem(acc.x), Elem(acc.y)};
    *reinterpret_cast<uint32_t*>(orow + col) = *reinterpret_cast<uint32_t*>(pair);
  }
}

template <bool kSoftcap, bool kWarpSplit>
static cudaError_t launch_decode(const DecodeParams& p, cudaStream_t stream) {
  using Cfg = DecodeConfig<kHeadDimBucket>;
  auto kernel = &decode_kernel<kSoftcap, kWarpSplit>;
  const int smem = Cfg::smem_bytes(p.mask_shared, p.bias_shared);
  if (smem > 48 * 1024) {
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  dim3 grid(p.num_splits, p.B * p.Hkv);
  kernel<<<grid, Cfg::Tr::kThreads, smem, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.num_splits == 1) return err;
  decode_combine_kernel<<<p.B * p.Hkv * p.rows, kCombineThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

bool decode_warp_split(int rows) { return rows <= 16; }

cudaError_t run_decode(const DecodeParams& p, cudaStream_t stream) {
  if (p.warp_split) {
    if (!decode_warp_split(p.rows)) return cudaErrorInvalidValue;
    return p.softcap > 0.f ? launch_decode<true, true>(p, stream)
                           : launch_decode<false, true>(p, stream);
  }
  return p.softcap > 0.f ? launch_decode<true, false>(p, stream)
                         : launch_decode<false, false>(p, stream);
}

int decode_max_rows() { return DecodeConfig<kHeadDimBucket>::kBlockM; }
int decode_block_n() { return DecodeConfig<kHeadDimBucket>::kBlockN; }

#else  // packed-sequence modules have no decode path (the dense module of the spec has it)

cudaError_t run_decode(const DecodeParams&, cudaStream_t) { return cudaErrorNotSupported; }
bool decode_warp_split(int) { return false; }
int decode_max_rows() { return 0; }
int decode_block_n() { return 0; }

#endif

}  // namespace flash_dmattn
