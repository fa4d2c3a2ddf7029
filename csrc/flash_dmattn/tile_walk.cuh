// Which tiles a CTA owns and walks: the dK/dV kernel's block order, rows of the host's live-tile
// lists, the key tiles a forward query tile visits and the query tiles a dK/dV key tile visits
// (with whether each step needs element checks), and a forward CTA's operand pointers.
#pragma once

#include "bcast_tile.cuh"
#include "params.h"
#include "seq_rows.cuh"

namespace flash_dmattn {

// (key tile, (batch, kv head) slot) of a dK/dV block. Causal key tile n is seen by fewer query
// tiles as n grows, so a causal call launches every slot's tile 0, then every tile 1, ...:
// heaviest blocks first. With GQA the grid is small (64 key tiles x 4 kv heads for an 8K
// sequence) and the plain order leaves the last slots' heavy tiles for the tail.
__device__ __forceinline__ void dkdv_block_of(bool causal, int& n_block, int& slot) {
  n_block = blockIdx.x;
  slot = blockIdx.y;
  if (causal) {
    const int lin = blockIdx.x + blockIdx.y * gridDim.x;
    n_block = lin / gridDim.y;
    slot = lin % gridDim.y;
  }
}

// Row of the live-tile list of (b, h, tile): pointer to its entries and the live count.
__device__ __forceinline__ const int32_t* list_row(const TileList& l, int b, int h, int t,
                                                   int& count) {
  const int hm = h / l.hdiv;
  count = l.cnt[int64_t(b) * l.cnt_sb + int64_t(hm) * l.cnt_sh + int64_t(t) * l.cnt_st];
  return l.idx + int64_t(b) * l.idx_sb + int64_t(hm) * l.idx_sh + int64_t(t) * l.idx_st;
}

// First of the `n` ascending entries of a live-tile list row whose tile is >= `tile`.
__device__ __forceinline__ int list_lower_bound(const int32_t* row, int n, int tile) {
  int lo = 0;
  while (n > 0) {
    const int half = n / 2;
    if ((row[lo + half] >> 1) < tile) {
      lo += half + 1;
      n -= half + 1;
    } else {
      n = half;
    }
  }
  return lo;
}

// The key tiles that query tile `m_block` (rows from q0) of sequence / batch entry `s` visits:
// the count, with `list` set to its row of the host's live-tile list, or (no list) every tile
// up to the causal limit. A packed call's list is shared by the sequence's query tiles, so it
// is cut at this tile's causal limit here.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ int key_tiles_of(const FwdParams& p, const SeqRows& s, int b, int h,
                                            int m_block, int q0, const int32_t*& list) {
  list = nullptr;
  // Packed calls size the grid by the longest sequence: tiles past this one's end do nothing.
  if (kPacked && q0 >= seq_lq(p, s)) return 0;
  const int n_tiles = (seq_lk(p, s) + kBlockN - 1) / kBlockN;
  int n_steps = n_tiles;
  if (!kPacked && p.use_list) {
    // A dense list row is this tile's own, already cut at its causal limit.
    list = list_row(p.list, b, h, m_block, n_steps);
    return n_steps;
  }
  if (p.causal) {
    // Last visible key of this tile's last row: q0 + kBlockM - 1 + (Lk - Lq).
    const int last_key =
        min(q0 + kBlockM - 1, seq_lq(p, s) - 1) + (seq_lk(p, s) - seq_lq(p, s));
    n_steps = last_key < 0 ? 0 : min(n_tiles, last_key / kBlockN + 1);
  }
  if (kPacked && p.use_list) {
    int n;
    list = list_row(p.list, b, h, m_block, n);
    return p.causal ? list_lower_bound(list, n, n_steps) : n;
  }
  return n_steps;
}

// The query tiles a dK/dV CTA of key tile n_block walks for query head h: a dense call's list
// row of live query tiles (m_steps entries), or nullptr and the tiles m_first ..
// m_first + m_steps - 1 (every tile up to the causal limit). A packed call's list is its
// sequence's per-key-mask key tiles: whether this key tile has a live key at all, and whether
// all of its keys are. key_partial: every walked tile needs element checks (dense: causal
// without a list; packed: some key of the tile is masked -- the causal part is per query tile,
// see dkdv_tile_partial).
template <int kBM, int kBN>
__device__ __forceinline__ const int32_t* dkdv_query_tiles(const BwdParams& p, const SeqRows& s,
                                                           int b, int h, int n_block, int m_tiles,
                                                           int& m_steps, int& m_first,
                                                           bool& key_partial) {
  m_first = 0;
  m_steps = m_tiles;
  key_partial = p.causal;
  // The dense branch is written out on its own: folded into the packed code below it compiles
  // the same operations to different Hopper dK/dV SASS (other registers), which no GPU run has
  // timed.
  if constexpr (!kPacked) {
    const int32_t* list = nullptr;
    if (p.use_list) {
      list = list_row(p.bwd_list, b, h, n_block, m_steps);
    } else if (p.causal) {
      m_first = max(0, n_block * kBN - (p.Lk - p.Lq)) / kBM;
      m_steps = max(0, m_tiles - m_first);
    }
    return list;
  }
  key_partial = false;
  if (p.causal) {
    // First query that sees key k0: k0 - (Lk - Lq).
    m_first = max(0, n_block * kBN - (s.Lk - s.Lq)) / kBM;
    m_steps = max(0, m_tiles - m_first);
  }
  if (p.use_list) {
    int n;
    const int32_t* row = list_row(p.list, b, h, 0, n);
    const int pos = list_lower_bound(row, n, n_block);
    const int entry = pos < n ? row[pos] : -1;
    if ((entry >> 1) != n_block) m_steps = 0;
    key_partial = (entry & 1) != 0;
  }
  return nullptr;
}

// Whether the dK/dV step over query tile q0 needs element checks. Packed calls: the key tile's
// mask flag, or the (key tile, query tile) pair crossing the causal diagonal -- key
// k0 + kBN - 1 visible to query q0 means every key of the tile is visible to every query of the
// tile, so only tiles on the diagonal do element work.
template <int kBM, int kBN>
__device__ __forceinline__ bool dkdv_tile_partial(const FwdParams& p, const SeqRows& s,
                                                  bool key_partial, int k0, int q0) {
  if constexpr (!kPacked) return key_partial;
  return key_partial || (p.causal && k0 + kBN - 1 > q0 + s.Lk - s.Lq);
}

// What a forward CTA of query tile q0 of (b, h) reads: Q / K / V at that tile's origin and the
// (b, h) slices of the mask and bias, and which key tiles it walks (`list` from key_tiles_of,
// or every tile in order) and which of those need element checks.
template <int kBlockN>
struct FwdTileWalk {
  const Elem* q;
  const Elem* k;
  const Elem* v;
  const char* mask;
  const char* bias;
  const int32_t* list;
  int q0;

  __device__ FwdTileWalk(const FwdParams& p, const SeqRows& s, int b, int h, int q0_,
                         const int32_t* list_)
      : list(list_), q0(q0_) {
    const int hkv = h / (p.H / p.Hkv);
    if constexpr (!kPacked) {
      q = reinterpret_cast<const Elem*>(p.q) + int64_t(b) * p.q_sb + int64_t(q0) * p.q_sl +
          int64_t(h) * p.q_sh;
      k = reinterpret_cast<const Elem*>(p.k) + int64_t(b) * p.k_sb + int64_t(hkv) * p.k_sh;
      v = reinterpret_cast<const Elem*>(p.v) + int64_t(b) * p.v_sb + int64_t(hkv) * p.v_sh;
      mask = kHasMask ? bcast_base<uint8_t>(p.mask, b, h, 0) : nullptr;
      bias = kHasBias ? bcast_base<Elem>(p.bias, b, h, 0) : nullptr;
      return;
    }
    q = reinterpret_cast<const Elem*>(p.q) + int64_t(b) * p.q_sb + (s.q_row0 + q0) * p.q_sl +
        int64_t(h) * p.q_sh;
    k = reinterpret_cast<const Elem*>(p.k) + int64_t(b) * p.k_sb + s.k_row0 * p.k_sl +
        int64_t(hkv) * p.k_sh;
    v = reinterpret_cast<const Elem*>(p.v) + int64_t(b) * p.v_sb + s.k_row0 * p.v_sl +
        int64_t(hkv) * p.v_sh;
    mask = kHasMask ? bcast_base<uint8_t>(p.mask, b, h, s.aux_row0) : nullptr;
    bias = kHasBias ? bcast_base<Elem>(p.bias, b, h, s.aux_row0) : nullptr;
  }

  // Key tile index of step i.
  __device__ int tile(int i) const { return list ? (list[i] >> 1) : i; }

  // Whether step i (key tile starting at k0) needs element checks: the list's flag, or (no list)
  // a tile crossing the causal diagonal -- key k0 + kBlockN - 1 is visible to every row of the
  // tile iff it is to the first row. A packed call's list is shared by the sequence's query
  // tiles, so its flag lacks the causal part and the crossing is added here.
  // (Lq, Lk: the sequence's lengths.)
  __device__ bool partial(const FwdParams& p, int i, int k0, int Lq, int Lk) const {
    if constexpr (!kPacked) {
      if (list) return (list[i] & 1) != 0;
      return p.causal && (k0 + kBlockN - 1 > q0 + p.Lk - p.Lq);
    }
    const bool crosses = p.causal && (k0 + kBlockN - 1 > q0 + Lk - Lq);
    return list ? ((list[i] & 1) != 0) || crosses : crosses;
  }
};

}  // namespace flash_dmattn
