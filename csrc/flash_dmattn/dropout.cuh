// Attention dropout inside the kernels: the keep-mask of flash_dmattn/dropout.py, regenerated
// from its coordinates wherever a kernel needs it, so nothing of size (Lq, Lk) is stored and
// the forward, the backward and every other implementation draw the same mask bit for bit.
//
// Entry (b, h, i, j) -- batch (sequence), query head, query row and key position, rows and
// keys counted from the start of the sequence -- reads byte i % 4 (low first) of word
// (i % 16) / 4 of Philox4x32-7 (kPhiloxRounds) keyed by the call's 64-bit seed at counter
// (j, i / 16, b * H + h, offset), and is kept iff that byte reaches the threshold
// round(256 p). The stream is key-major: one evaluation serves the 16 query rows of a 16-row
// group for one key (keep_bits16), whichever keys a walk visits, so a dense key tile, a
// gathered list and scattered key-interval picks all cost one evaluation per (16-row group,
// key) of the tile.
//
// How a kernel shares the evaluations between the threads of its wgmma accumulator fragments
// (a warp holds 16 consecutive rows of the tile; lane l holds rows l / 4 and l / 4 + 8 of
// them and the column pairs (c, c + 1), c = 8 g + 2 (l % 4), of every 8-column block g):
// * rows = queries, columns = keys (forward and dQ tiles, dense or listed keys):
//   dropout_query_rows_bits -- the warp's rows are one 16-row group, so each column needs
//   one evaluation, which gives both of a thread's rows. The 8 lanes of one l % 4 need the
//   same columns: each evaluates kCols / 32 of them and an 8 x 8 transpose over those lanes
//   (three shuffles) hands every lane its rows' bits;
// * rows = keys, columns = 64 consecutive queries (dK / dV tiles): dropout_key_rows_bits --
//   a thread's key needs the evaluations of the 4 query groups of the columns; the quad's
//   four lanes (same keys) take one group each and a 4 x 4 transpose over the quad (two
//   shuffles) hands every lane its columns' bits. Keys may be any (key-interval blocks).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "params.h"

namespace flash_dmattn {

// The stream's Philox rounds: flash_dmattn.dropout.ROUNDS, which says why 7.
constexpr int kPhiloxRounds = 7;

// Philox4x32 (kPhiloxRounds rounds) with key (k0, k1) at counter c: round multipliers and the
// key's Weyl sequence of Salmon et al. (as Triton's tl.philox and torch's reimplementation in
// dropout.py).
__device__ __forceinline__ uint4 philox4x32(uint32_t k0, uint32_t k1, uint4 c) {
#pragma unroll
  for (int round = 0; round < kPhiloxRounds; ++round) {
    const uint32_t lo_a = c.x * 0xD2511F53u, hi_a = __umulhi(c.x, 0xD2511F53u);
    const uint32_t lo_b = c.z * 0xCD9E8D57u, hi_b = __umulhi(c.z, 0xCD9E8D57u);
    c = make_uint4(hi_b ^ c.y ^ k0, lo_b, hi_a ^ c.w ^ k1, lo_a);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// One call's dropout as a kernel uses it: the Philox key, the counter words that do not vary
// within a (batch, head) and the threshold's two constants of keep_high_bits. Read from the
// rng tensor in the kernel (no host sync: CUDA graphs replay a capture with the rng tensor's
// new contents).
struct DropoutKey {
  uint32_t k0 = 0, k1 = 0;  // seed, low word first
  uint32_t bh = 0;          // counter word 2: batch * heads + head
  uint32_t offset = 0;      // counter word 3
  uint32_t lo_add = 0;      // 128 - t % 128 in each byte; 0 for t = 256 (see keep_high_bits)
  uint32_t sel = 0;         // 0x80808080 if t < 128, else 0
};

__device__ __forceinline__ DropoutKey dropout_key(const Dropout& d, int b, int h) {
  DropoutKey key;
  const uint64_t seed = static_cast<uint64_t>(d.rng[0]);
  key.k0 = static_cast<uint32_t>(seed);
  key.k1 = static_cast<uint32_t>(seed >> 32);
  key.offset = static_cast<uint32_t>(static_cast<uint64_t>(d.rng[1]));
  int64_t batch = int64_t(b) + d.b0;
  if (d.rng_batch) batch += d.rng[2];
  key.bh = static_cast<uint32_t>(batch * d.heads + h + d.h0);
  const uint32_t t = d.threshold;  // 0..256
  key.lo_add = t > 255u ? 0u : (128u - (t & 127u)) * 0x01010101u;
  key.sel = t < 128u ? 0x80808080u : 0u;
  return key;
}

// Whether each byte of a Philox word reaches the threshold t, four bytes at a time: bit
// 8 i + 7 of the result is set iff byte i >= t (the other bits are unspecified).
//
// With a byte b = 128 b_hi + b_lo and t = 128 t_hi + t_lo (t <= 255): b >= t iff b_hi >
// t_hi, or b_hi == t_hi and b_lo >= t_lo. The sum s = b_lo + (128 - t_lo) stays within its
// byte (at most 255) and has its high bit set iff b_lo >= t_lo; so the test is b_hi OR s_hi
// for t_hi = 0 and b_hi AND s_hi for t_hi = 1: the majority of (b, s, sel) in the high bit,
// sel's high bit being NOT t_hi. For t = 256 (p rounds to 1: nothing kept) lo_add = 0 and
// sel = 0: s_hi is never set, so nothing passes. Three instructions a word (AND, ADD, LOP3).
__host__ __device__ __forceinline__ uint32_t keep_high_bits(uint32_t word, uint32_t lo_add,
                                                            uint32_t sel) {
  const uint32_t s = (word & 0x7f7f7f7fu) + lo_add;
  return (word & s) | ((word | s) & sel);
}

// Bits 24..31: the high bits of each byte of keep_high_bits' a (bits 24..27) then b (28..31),
// byte 0 first. a's high bits move to 8 i + 3 beside b's at 8 i + 7; the product with
// 2^0 + 2^7 + 2^14 + 2^21 sends 8 i + 7 to 28 + i and 8 i + 3 to 24 + i, and its partial
// products never share a bit (no carries reach the top byte).
__host__ __device__ __forceinline__ uint32_t gather_high_bits(uint32_t a, uint32_t b) {
  return ((b & 0x80808080u) | ((a >> 4) & 0x08080808u)) * 0x00204081u;
}

// Bit t (t < 16) says whether query row 16 grp + t keeps key j: one evaluation.
__device__ __forceinline__ uint32_t keep_bits16(const DropoutKey& key, uint32_t j, uint32_t grp) {
  const uint4 w = philox4x32(key.k0, key.k1, make_uint4(j, grp, key.bh, key.offset));
  // Rows 0-7 (words x, y) in bits 24..31 of r0, rows 8-15 (words z, w) in those of r1.
  const uint32_t r0 = gather_high_bits(keep_high_bits(w.x, key.lo_add, key.sel),
                                       keep_high_bits(w.y, key.lo_add, key.sel));
  const uint32_t r1 = gather_high_bits(keep_high_bits(w.z, key.lo_add, key.sel),
                                       keep_high_bits(w.w, key.lo_add, key.sel));
  return (r0 >> 24) | ((r1 >> 16) & 0xff00u);
}

// One step of a transpose between lanes and bit positions (see the callers): this lane and
// its partner (lane ^ lane_xor) swap the bits where this lane's index bit (`upper`) differs
// from the positions' bit of kMask (the positions whose that bit is set; kSh is its value).
// One word per lane.
template <int kSh, uint32_t kMask>
__device__ __forceinline__ void transpose_step(uint32_t& a, bool upper, int lane_xor) {
  const uint32_t send = upper ? ((a << kSh) & kMask) : ((a >> kSh) & ~kMask);
  const uint32_t recv = __shfl_xor_sync(0xffffffffu, send, lane_xor);
  a = (a & (upper ? kMask : ~kMask)) | recv;
}

// transpose_step of two words a and b at once, in one shuffle: the half of a that moves is
// sent shifted into the other half's positions, with the half of b that moves in place.
template <int kSh, uint32_t kMask>
__device__ __forceinline__ void transpose_step2(uint32_t& a, uint32_t& b, bool upper,
                                                int lane_xor) {
  const uint32_t send = upper ? (((a << kSh) & kMask) | (b & ~kMask))
                              : (((a >> kSh) & ~kMask) | (b & kMask));
  const uint32_t recv = __shfl_xor_sync(0xffffffffu, send, lane_xor);
  if (upper) {
    a = (a & kMask) | (recv & ~kMask);
    b = (b & kMask) | ((recv & kMask) >> kSh);
  } else {
    a = (a & ~kMask) | (recv & kMask);
    b = (b & ~kMask) | ((recv & ~kMask) << kSh);
  }
}

// Keep bits of a thread's accumulator values when rows are queries and columns keys: the
// warp's 16 rows are the 16-row group grp (this thread's rows 16 grp + lane / 4 and that + 8,
// as in wgmma's accumulators of a 16-row-aligned tile) and column c (kCols of them) is key
// key_of(c), any key. Bit 2 g + e of out[0] (out[1]) says whether the first (second) row
// keeps column 8 g + 2 (lane % 4) + e, g < kCols / 8.
//
// Lane l = 4 s + q (s < 8) evaluates the columns 32 e + 8 (s / 2) + 2 q + s % 2, e <
// kCols / 32 -- together the 8 lanes of one q cover the kCols / 4 columns each of them holds
// -- and puts rows 0-7 of evaluation e in byte e of one word, rows 8-15 in byte e of another:
// bit 8 e + d is row d (d + 8). Bit position 8 e + d of lane s is then exactly what lane d
// needs at bit position 8 e + s, which is bit 2 g + e' of its columns' order (g = 4 e + s /
// 2, e' = s % 2): an 8 x 8 transpose of (lane s, position bits 0-2) over those lanes, three
// steps that each swap one lane bit with one position bit.
template <int kCols, class KeyOf>
__device__ __forceinline__ void dropout_query_rows_bits(const DropoutKey& key, uint32_t grp,
                                                        int lane, const KeyOf& key_of,
                                                        uint32_t (&out)[2]) {
  static_assert(kCols % 32 == 0 && kCols <= 128, "whole evaluations per lane, bytes of a word");
  const int s = lane >> 2, q = lane & 3;
  uint32_t lo = 0u, hi = 0u;
  // Two evaluations at a time: two independent Philox chains in flight, and no more state
  // live beside the accumulators (four at once spill in the forward).
#pragma unroll 2
  for (int e = 0; e < kCols / 32; ++e) {
    const int c = 32 * e + 8 * (s >> 1) + 2 * q + (s & 1);
    const uint32_t bits = keep_bits16(key, uint32_t(key_of(c)), grp);
    lo |= (bits & 0xffu) << (8 * e);
    hi |= (bits >> 8) << (8 * e);
  }
  // Lane bit 0 of s (lane ^ 4) with position bit 0, bit 1 (lane ^ 8) with position bit 1,
  // bit 2 (lane ^ 16) with position bit 2.
  transpose_step2<1, 0xaaaaaaaau>(lo, hi, (s & 1) != 0, 4);
  transpose_step2<2, 0xccccccccu>(lo, hi, (s & 2) != 0, 8);
  transpose_step2<4, 0xf0f0f0f0u>(lo, hi, (s & 4) != 0, 16);
  out[0] = lo;
  out[1] = hi;
}

// Bit of dropout_key_rows_bits' words for the accumulator column 8 g + 2 (lane % 4) + e.
__host__ __device__ constexpr int key_rows_bit(int g, int e) {
  return 8 * (g & 1) + 2 * (g >> 1) + e;
}

// Keep bits of a dK / dV thread's accumulator values when rows are keys and columns queries:
// this thread's two keys j0 and j1 (any keys: a key tile's or a key-interval block's) and the
// 64 consecutive queries from q0 (a multiple of 16). Bit key_rows_bit(g, e) of out[r] says
// whether key j_r is kept by query q0 + 8 g + 2 (lane % 4) + e, g < 8.
//
// The four lanes of a quad hold the same keys; lane q' evaluates query group q0 / 16 + q' of
// both (key r's 16 bits at bit 16 r of one word). Bit 16 r + 8 h + 2 q + e of lane q' is query
// q0 + 16 q' + 8 h + 2 q + e, which lane q needs at bit 16 r + 8 h + 2 q' + e: a 4 x 4
// transpose of (lane q', position bits 1-2) over the quad, two steps.
__device__ __forceinline__ void dropout_key_rows_bits(const DropoutKey& key, int j0, int j1,
                                                      int q0, int lane, uint32_t (&out)[2]) {
  const int q = lane & 3;
  const uint32_t grp = uint32_t(q0 >> 4) + uint32_t(q);
  uint32_t w = keep_bits16(key, uint32_t(j0), grp) | (keep_bits16(key, uint32_t(j1), grp) << 16);
  // Lane bit 0 (lane ^ 1) with position bit 1, lane bit 1 (lane ^ 2) with position bit 2.
  transpose_step<2, 0xccccccccu>(w, (q & 1) != 0, 1);
  transpose_step<4, 0xf0f0f0f0u>(w, (q & 2) != 0, 2);
  out[0] = w & 0xffffu;
  out[1] = w >> 16;
}

}  // namespace flash_dmattn
