// Attention dropout inside the kernels: the keep-mask of flash_dmattn/dropout.py, regenerated
// from its coordinates wherever a kernel needs it, so nothing of size (Lq, Lk) is stored and
// the forward, the backward and every other implementation draw the same mask bit for bit.
//
// Entry (b, h, i, j) -- batch (sequence), query head, query row and key position, rows and
// keys counted from the start of the sequence -- reads byte j % 4 (low first) of word
// (j / 4) % 4 of Philox4x32-10 keyed by the call's 64-bit seed at counter
// (j / 16, i, b * H + h, offset), and is kept iff that byte reaches the threshold
// round(256 p). One evaluation serves the 16 keys of a group (keep_bits16).
//
// How a kernel shares the evaluations between the threads of its wgmma accumulator fragments
// (a thread holds column pairs (c, c + 1), c even, of two rows 8 apart; the four threads of a
// quad hold the same rows and columns c % 8 = 0, 2, 4, 6):
// * rows = queries, consecutive keys (forward and dQ tiles): DropoutRowBits -- a row's
//   evaluations are split over the quad's four threads and exchanged with shuffles;
// * rows = keys of one 16-key group, columns = queries (dK / dV tiles): dropout_key_rows_bits
//   -- the warp's 64 queries are split over its 32 lanes, exchanged with shuffles;
// * keys by list index (gathered and key-interval walks): dropout_listed_bits, one evaluation
//   per (row, group) a thread meets in the list, reused while the listed keys stay in it.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "params.h"

namespace flash_dmattn {

// Philox4x32-10 with key (k0, k1) at counter c: round multipliers and the key's Weyl sequence
// of Salmon et al. (as Triton's tl.philox and torch's reimplementation in dropout.py).
__device__ __forceinline__ uint4 philox4x32_10(uint32_t k0, uint32_t k1, uint4 c) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t lo_a = c.x * 0xD2511F53u, hi_a = __umulhi(c.x, 0xD2511F53u);
    const uint32_t lo_b = c.z * 0xCD9E8D57u, hi_b = __umulhi(c.z, 0xCD9E8D57u);
    c = make_uint4(hi_b ^ c.y ^ k0, lo_b, hi_a ^ c.w ^ k1, lo_a);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// One call's dropout as a kernel uses it: the Philox key, the counter words that do not vary
// within a (batch, head) and the threshold. Read from the rng tensor in the kernel (no host
// sync: CUDA graphs replay a capture with the rng tensor's new contents).
struct DropoutKey {
  uint32_t k0 = 0, k1 = 0;  // seed, low word first
  uint32_t bh = 0;          // counter word 2: batch * heads + head
  uint32_t offset = 0;      // counter word 3
  uint32_t thresh4 = 0;     // the threshold in each byte (thresholds <= 255)
  bool drop_all = false;    // threshold 256: no byte reaches it
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
  key.drop_all = d.threshold > 255u;
  key.thresh4 = (d.threshold & 0xffu) * 0x01010101u;
  return key;
}

// The 4 bits of one Philox word: bit i says whether byte i (low first) reaches the threshold.
__device__ __forceinline__ uint32_t keep_bits4(uint32_t word, uint32_t thresh4) {
  const uint32_t ge = __vcmpgeu4(word, thresh4) & 0x01010101u;  // 1 in each kept byte
  // Gather bytes' low bits into bits 24..27 (the partial products never carry into them).
  return (ge * 0x01020408u) >> 24;
}

// Bit t (t < 16) says whether key 16 g + t of query row `row` is kept.
__device__ __forceinline__ uint32_t keep_bits16(const DropoutKey& key, uint32_t g,
                                                uint32_t row) {
  const uint4 w = philox4x32_10(key.k0, key.k1, make_uint4(g, row, key.bh, key.offset));
  const uint32_t bits = keep_bits4(w.x, key.thresh4) | (keep_bits4(w.y, key.thresh4) << 4) |
                        (keep_bits4(w.z, key.thresh4) << 8) | (keep_bits4(w.w, key.thresh4) << 12);
  return key.drop_all ? 0u : bits;
}

// Keep bits of a thread's accumulator values in one of its rows when rows are queries and the
// kCols columns are consecutive keys from key0 (a multiple of 16): columns 8 g + 2 (lane % 4)
// + {0, 1} for g < kCols / 8. The quad's kCols / 16 evaluations of the row (one per 16-key
// group) are split over its four threads, each packing its groups' bits two to a 32-bit word,
// which the quad then exchanges. A row at a time keeps few words live beside the
// accumulators.
template <int kCols>
struct DropoutRowBits {
  static_assert(kCols % 64 == 0, "each thread of a quad takes whole groups");
  static constexpr int kGroups = kCols / 16;        // 16-key groups of the row
  static constexpr int kPerThread = kGroups / 4;    // groups a thread evaluates
  static constexpr int kOwn = (kPerThread + 1) / 2;  // words a thread packs them into
  // Word o * kOwn + j / 2 holds group o * kPerThread + j (half j % 2), shifted right by this
  // thread's first column within 8.
  uint32_t words[4 * kOwn];

  __device__ __forceinline__ void compute(const DropoutKey& key, int row, int key0, int lane) {
    const int t = lane % 4;
    uint32_t own[kOwn];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const uint32_t bits = keep_bits16(key, uint32_t(key0 / 16 + t * kPerThread + j), uint32_t(row));
      if (j % 2 == 0) {
        own[j / 2] = bits;
      } else {
        own[j / 2] |= bits << 16;
      }
    }
    const int base = lane & ~3;
    const int shift = 2 * t;
#pragma unroll
    for (int o = 0; o < 4; ++o) {
#pragma unroll
      for (int w = 0; w < kOwn; ++w) {
        words[o * kOwn + w] = __shfl_sync(0xffffffffu, own[w], base + o) >> shift;
      }
    }
  }

  // Bits 0 and 1: whether columns 8 g + 2 (lane % 4) and the next one are kept.
  __device__ __forceinline__ uint32_t pair(int g) const {
    const int grp = g / 2, o = grp / kPerThread, j = grp % kPerThread;
    return (words[o * kOwn + j / 2] >> (16 * (j % 2) + 8 * (g % 2))) & 3u;
  }
};

// Keep bits of a dK / dV thread's accumulator values when rows are keys and columns queries:
// the warp's 16 keys share the group `grp` (they are keys of one 16-key group, this thread's
// two at positions pos0 and pos1 within it) and columns are the 64 consecutive queries from
// q0. Lane l evaluates queries q0 + l and q0 + l + 32; the thread then gathers its 16
// queries' words. Bit 2 g + c2 of result r: query q0 + 8 g + 2 (lane % 4) + c2, key pos_r.
__device__ __forceinline__ void dropout_key_rows_bits(const DropoutKey& key, uint32_t grp,
                                                      int q0, int pos0, int pos1, int lane,
                                                      uint32_t (&out)[2]) {
  const uint32_t mine = keep_bits16(key, grp, uint32_t(q0 + lane)) |
                        (keep_bits16(key, grp, uint32_t(q0 + lane + 32)) << 16);
  out[0] = out[1] = 0u;
#pragma unroll
  for (int g = 0; g < 4; ++g) {
#pragma unroll
    for (int c2 = 0; c2 < 2; ++c2) {
      // Queries 8 g + 2 (lane % 4) + c2 (low half) and that + 32 (group g + 4, high half).
      const uint32_t w = __shfl_sync(0xffffffffu, mine, 8 * g + 2 * (lane % 4) + c2);
      out[0] |= ((w >> pos0) & 1u) << (2 * g + c2);
      out[1] |= ((w >> pos1) & 1u) << (2 * g + c2);
      out[0] |= ((w >> (16 + pos0)) & 1u) << (2 * (g + 4) + c2);
      out[1] |= ((w >> (16 + pos1)) & 1u) << (2 * (g + 4) + c2);
    }
  }
}

// Keep bit of one entry: query row `row`, key position `col`, one evaluation.
__device__ __forceinline__ uint32_t keep_bit(const DropoutKey& key, int row, int col) {
  return (keep_bits16(key, uint32_t(col) >> 4, uint32_t(row)) >> (col & 15)) & 1u;
}

// Keep bits of a thread's accumulator values when rows are queries and columns listed keys
// (gathered and key-interval walks): column c of the step is key keys[c] for c < n (columns
// past the list are invisible; their bits are 0). Columns 8 g + 2 (lane % 4) + e, g <
// kGroups; bit 2 g + e of out[r] for row r (rows row0, row1). Listed keys ascend, so a
// thread's consecutive columns mostly share a 16-key group: one evaluation per row and group
// met, reused while the group lasts (a rolled loop: one copy of the Philox code).
template <int kGroups>
__device__ __forceinline__ void dropout_listed_bits(const DropoutKey& key, const int32_t* keys,
                                                    int n, int row0, int row1, int lane,
                                                    uint32_t (&out)[2]) {
  static_assert(kGroups <= 16, "a row's bits fit one word");
  uint32_t cur = 0xffffffffu, bits0 = 0u, bits1 = 0u;
  out[0] = out[1] = 0u;
  const int first = 2 * (lane % 4);
#pragma unroll 1
  for (int s = 0; s < 2 * kGroups; ++s) {
    const int c = 8 * (s / 2) + first + (s % 2);
    if (c >= n) break;  // columns ascend: the rest lie past the list too
    const int j = keys[c];
    const uint32_t grp = uint32_t(j) >> 4;
    if (grp != cur) {
      cur = grp;
      bits0 = keep_bits16(key, grp, uint32_t(row0));
      bits1 = keep_bits16(key, grp, uint32_t(row1));
    }
    out[0] |= ((bits0 >> (j & 15)) & 1u) << s;
    out[1] |= ((bits1 >> (j & 15)) & 1u) << s;
  }
}

}  // namespace flash_dmattn
