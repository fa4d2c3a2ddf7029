// Argument blocks of the CUDA kernels. Plain C++ (no CuTe, no torch) so that the torch binding
// (flash_dmattn_api.cpp) and the kernels (flash_fwd.cu, flash_bwd.cu) share them.
//
// Layouts follow the public API: q (B, Lq, H, D), k/v (B, Lk, Hkv, D), out like q, lse (B, H, Lq)
// fp32. Strides are in elements. A mask (bool, read as bytes) or bias (q's dtype) is a 4-D view
// broadcastable to (B, H, Lq, Lk): a broadcast dim has stride 0 and the mask head of query head
// h is h / *_hdiv. Nothing of size (B, H, Lq, Lk) is ever expanded.
#pragma once
#include <cstdint>

// The specialisation (spec.py's KernelSpec.defines() passes these); defaults for editors and
// stand-alone compiles.
#ifndef FLASH_DMATTN_HEADDIM
#define FLASH_DMATTN_HEADDIM 128
#endif
#ifndef FLASH_DMATTN_IS_BF16
#define FLASH_DMATTN_IS_BF16 1
#endif
#ifndef FLASH_DMATTN_HAS_MASK
#define FLASH_DMATTN_HAS_MASK 1
#endif
#ifndef FLASH_DMATTN_HAS_BIAS
#define FLASH_DMATTN_HAS_BIAS 1
#endif
// Packed sequences (varlen): a module of its own, so that dense calls keep sequence lengths in
// the constant bank instead of registers (spec.py says what a runtime switch cost).
#ifndef FLASH_DMATTN_PACKED
#define FLASH_DMATTN_PACKED 0
#endif
// Built for sm_90a (the wgmma forward: flash_fwd_sm90.cu and the kernels it launches).
#ifndef FLASH_DMATTN_SM90
#define FLASH_DMATTN_SM90 0
#endif
// The wgmma backward (flash_bwd_sm90.cu) covers head dims up to 128 (its dK and dV accumulators
// share a thread's registers); larger head dims run the sm80 backward on Hopper too.
#define FLASH_DMATTN_SM90_BWD \
  (FLASH_DMATTN_SM90 && FLASH_DMATTN_HEADDIM <= 128)
// Attention dropout (Dropout below): built into the sm_90 forward and backward of modules whose
// backward is sm_90 too, dense batches and packed sequences alike (a packed call's batch index
// is the sequence, its rows and keys counted from the sequence's start: the coordinates of the
// keep-mask); other modules compile no dropout kernels.
#define FLASH_DMATTN_DROPOUT FLASH_DMATTN_SM90_BWD
// Gathered key lists and key intervals, the list walks of the sm_90 forward: built into the
// modules of dense batches with a mask; other modules compile none of their kernels.
#define FLASH_DMATTN_FWD_GATHER \
  (FLASH_DMATTN_SM90 && FLASH_DMATTN_HAS_MASK && !FLASH_DMATTN_PACKED)

namespace flash_dmattn {

// Live-tile lists built on the host (flash_dmattn/planning/tiles.py, shared with the
// Triton kernels): per row (b, h / hdiv, tile), `cnt[0]` entries of `idx`, each
// `tile * 2 + partial`. Broadcast dims have stride 0.
struct TileList {
  const int32_t* idx = nullptr;
  const int32_t* cnt = nullptr;
  int64_t idx_sb = 0, idx_sh = 0, idx_st = 0;
  int64_t cnt_sb = 0, cnt_sh = 0, cnt_st = 0;
  int hdiv = 1;
};

// Gathered keys (flash_dmattn/planning/gather.py, the planner shared with Triton): per
// query tile (b, h / hdiv, m), its rows' live keys compacted into one ascending list of `cnt`
// key indices, the mask at those keys as bits (int64 words of 64 listed keys per query row;
// they also hold the causal limit) and a per-key bias at those keys. The forward walks the
// list instead of the key tiles. Strides in elements (words for bits); broadcast dims 0.
struct KeyGather {
  const int32_t* idx = nullptr;
  const int32_t* cnt = nullptr;
  int64_t idx_sb = 0, idx_sh = 0, idx_sm = 0;
  int64_t cnt_sb = 0, cnt_sh = 0, cnt_sm = 0;
  int hdiv = 1;  // query heads per list head
  const uint64_t* bits = nullptr;
  int64_t bits_sb = 0, bits_sh = 0, bits_sq = 0;
  int bits_hdiv = 1;
  const void* bias = nullptr;  // nullptr: no bias
  int64_t bias_sb = 0, bias_sh = 0, bias_sm = 0;
  int bias_hdiv = 1;
  int bias_width = 0;  // elements a row (the list width rounded up to 64)
};

// Key-interval masks (flash_dmattn/masks.py KeyIntervals; lists from
// flash_dmattn/planning/key_lists.py). Key j of mask row (b, h / hdiv) is seen by the query
// positions [start_j, end_j) (query index i sits at position i + Lk - Lq; causal calls also
// need j <= position). Row r = b * row_heads + h / hdiv.
// * Forward: query tile m of row r reads keys[tile_start[r * n_tiles + m] ...], tile_len of
//   them, K / V rows by index, and tests each listed key's interval arithmetically (except in
//   steps whose keys are all among the tile_full leading ones, which every query sees).
// * dK / dV: key block k holds blk_keys[k * 128 ...] (-1 pads) and is seen by the query rows
//   [blk_qlo[k], blk_qhi[k]); blocks_per_row blocks a row. A CTA walks one segment of
//   segment_rows of those queries for every query head of the block's kv head.
// A bias with a key-interval mask is per key: (Bx, Hb, 1, Lk), read by index.
struct KeyIntervalLists {
  const int32_t* bounds = nullptr;
  int64_t bounds_plane = 0;  // elements from the start plane to the end plane
  int row_heads = 1, hdiv = 1;
  const int32_t* tile_start = nullptr;
  const int32_t* tile_len = nullptr;
  const int32_t* tile_full = nullptr;  // leading keys of a tile's list that all its queries see
  const int32_t* keys = nullptr;
  int n_tiles = 0;
  const int32_t* blk_keys = nullptr;
  const int32_t* blk_qlo = nullptr;
  const int32_t* blk_qhi = nullptr;
  int n_blocks = 0, blocks_per_row = 0, segment_rows = 0;
  const void* bias = nullptr;
  int64_t bias_sb = 0, bias_sh = 0, bias_sk = 0;
  int bias_hdiv = 1;
};

// A broadcastable (B, H, Lq, Lk) operand read through strides.
struct Bcast {
  const void* ptr = nullptr;
  int64_t sb = 0, sh = 0, sq = 0, sk = 0;
  int hdiv = 1;
  // Rows can be read in aligned 16-byte chunks (sk == 1, base and row strides 16-byte aligned).
  bool vec = false;
};

// Attention dropout (flash_dmattn/dropout.py; device side in dropout.cuh): probabilities are
// kept iff their random byte reaches `threshold` and kept ones scaled by `scale`. The random
// stream is keyed by the call's int64 rng tensor, read on the device: (seed, offset) and, with
// rng_batch, the batch index of the call's first row. A kernel's batch b and head h draw
// counter word (b + b0 [+ rng[2]]) * heads + h + h0: a call on a slice of the batch and heads
// (the per-chunk backward of a shared bias) names where its slice starts. rng nullptr: none.
struct Dropout {
  const int64_t* rng = nullptr;
  bool rng_batch = false;
  uint32_t threshold = 0;  // round(256 p), in [0, 256]
  float scale = 1.f;       // 1 / (1 - p)
  int64_t b0 = 0;
  int h0 = 0, heads = 0;
};

struct FwdParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  int64_t q_sb, q_sl, q_sh;
  int64_t k_sb, k_sl, k_sh;
  int64_t v_sb, v_sl, v_sh;
  int64_t o_sb, o_sl, o_sh;
  Bcast mask, bias;
  int B, H, Hkv, Lq, Lk, D;
  float scale = 1.f;
  float softcap = 0.f;  // 0 = off
  bool causal = false;
  bool use_list = false;
  // Per (b, h, query tile): live key tiles. A packed call's list is per (sequence, mask head)
  // (tile stride 0), shared by every query tile of the sequence and cut at each tile's causal
  // limit on the device.
  TileList list;
  // lse (and the backward's delta) strides: dense calls (B, H, Lq), packed calls (H, total_q).
  int64_t lse_sb = 0, lse_sh = 0;
  // Packed sequences (varlen): batch entry b is sequence b, query rows cu_q[b] .. cu_q[b + 1]
  // of the packed q / out (batch strides 0) and key rows cu_k[b] .. of k / v; Lq and Lk are
  // then the longest lengths (they size the grid). nullptr: a dense batch.
  const int32_t* cu_q = nullptr;
  const int32_t* cu_k = nullptr;
  // Packed: where sequence b's keys start in the per-key mask / bias, when the host gave
  // copies whose sequences start on 16-element boundaries (rows read as 16-byte vectors);
  // nullptr: at cu_k[b], read element by element.
  const int32_t* cu_aux = nullptr;
  int total_q = 0;  // packed query rows (the delta kernel walks them all)
  // Set: the forward walks these gathered key lists (sm_90 forward of a module with a mask,
  // dense batches) instead of key tiles; `mask`, `bias` and `list` are then unused.
  bool gather = false;
  KeyGather g;
  // Set: a key-interval mask (sm_90 modules with a mask, dense batches): the forward walks
  // iv's query-tile lists, the dK / dV kernel its key blocks; `mask`, `bias`, `list` and `g`
  // are unused.
  bool intervals = false;
  KeyIntervalLists iv;
  Dropout drop;
};

struct BwdParams : FwdParams {
  const void* dout = nullptr;
  int64_t do_sb, do_sl, do_sh;
  float* delta = nullptr;  // (B, H, Lq) fp32: rowsum(dout * out)
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  int64_t dq_sb, dq_sl, dq_sh;
  int64_t dk_sb, dk_sl, dk_sh;
  int64_t dv_sb, dv_sl, dv_sh;
  // dbias of a full per-element bias whose head dim is H (written by the dQ kernel, in the
  // bias dtype, same strides as the bias)...
  void* dbias_full = nullptr;
  int64_t dbf_sb = 0, dbf_sh = 0, dbf_sq = 0;
  // ...or per-key partial sums (B, H, Lk) fp32 of a bias broadcast over queries, written by
  // the dK/dV kernel (the host sums them into the bias's own shape).
  float* dbias_keys = nullptr;
  int64_t dbk_sb = 0, dbk_sh = 0;  // dense (B, H, Lk), packed (H, total_k)
  // Fused dQ (Hopper backward, deterministic=False): zeroed fp32 accumulator of
  // B * H * ceil(Lq / 64) * 64 * head-dim-bucket floats (tiled, see flash_bwd_sm90.cu) the dK/dV
  // kernel adds dS K into; nullptr runs the separate dQ kernel.
  float* dq_accum = nullptr;
  bool need_dq = true;
  bool need_dkv = true;
  TileList bwd_list;  // per (b, h, key tile): live query tiles
  // A per-query mask as key bits (flash_dmattn/planning/mask_summary.py, written by the
  // mask summary's one pass): bit q % 64 of word (b, h / kbits_hdiv, q / 64, k) is
  // mask[b, h, q, k], 0 past the causal limit. The Hopper dK/dV producer copies a step's 128
  // words instead of transposing the step's 8 KB mask tile (a synchronous load every step).
  // Rows hold at least Lk rounded up to 128 words, 16-byte aligned. nullptr: transpose.
  const uint64_t* kbits = nullptr;
  int64_t kbits_sb = 0, kbits_sh = 0, kbits_sw = 0;
  int kbits_hdiv = 1;
};

// Split-KV decode (flash_decode.cu): few queries against a long, possibly paged, KV cache.
// A CTA owns one (key split, batch, kv head) and the G = H / Hkv query heads of that kv head
// times the Lq queries as its rows (row r = g * Lq + i, rows = G * Lq <= 64).
struct DecodeParams : FwdParams {
  // (B,) used keys per batch (cache_seqlens), clamped to Lk on the device; nullptr: all Lk.
  const int32_t* seqused = nullptr;
  // Paged KV: k / v are pools (num_pages, page_size, Hkv, D) (k_sb / v_sb: the page stride)
  // and logical key j of batch b lives in page block_table[b * bt_sb + j / page_size], slot
  // j % page_size. nullptr: k / v are (B, Lk, Hkv, D).
  const int32_t* block_table = nullptr;
  int64_t bt_sb = 0;
  int page_size = 0;
  int num_pages = 0;
  int G = 1;
  int rows = 1;
  int num_splits = 1;
  // decode_warp_split(rows) (at most 16 rows): each warp of a CTA takes its own keys of every
  // tile, and the warps' softmax states are merged at the end.
  bool warp_split = false;
  // num_splits > 1: per-split outputs (normalised within the split) and their lse, rows
  // (split, (b * Hkv + kv head) * rows + r), merged by the combine kernel.
  float* o_part = nullptr;
  float* lse_part = nullptr;
  // One mask / bias row serves every row of a CTA (per-key, and not per query head within
  // the group): the tile is loaded as that single row.
  bool mask_shared = false;
  bool bias_shared = false;
};

}  // namespace flash_dmattn
