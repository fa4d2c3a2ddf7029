// Where a batch entry's rows are: a dense call's lengths, or a packed (varlen) call's sequence
// offsets and lengths from cu_seqlens; and the row offsets of what the backward reads and writes
// per (batch entry, head): Q, dO, lse, delta, the mask and bias slices, dbias partials.
#pragma once

#include "bcast_tile.cuh"
#include "params.h"

namespace flash_dmattn {

// Where batch entry b's rows are. Dense calls index batches by their strides: no row offset,
// the call's lengths. Packed (varlen) calls have batch strides 0 and take sequence b's first
// rows and lengths from cu_q / cu_k.
struct SeqRows {
  int64_t q_row0, k_row0;
  int64_t aux_row0;  // first key in the mask / bias
  int Lq, Lk;
};

__device__ __forceinline__ SeqRows seq_rows(const FwdParams& p, int b) {
  if constexpr (!kPacked) return {0, 0, 0, p.Lq, p.Lk};
  const int qs = p.cu_q[b], ks = p.cu_k[b];
  return {qs, ks, p.cu_aux != nullptr ? p.cu_aux[b] : ks, p.cu_q[b + 1] - qs, p.cu_k[b + 1] - ks};
}

// The sequence's lengths. Kernels call these where the length is used rather than copying it
// into a local: a dense call then reads the kernel parameter in place, which ptxas keeps in
// uniform registers; a local copy made it per-thread (a slower forward and Hopper dK/dV).
__device__ __forceinline__ int seq_lq(const FwdParams& p, const SeqRows& s) {
  if constexpr (kPacked) return s.Lq;
  return p.Lq;
}
__device__ __forceinline__ int seq_lk(const FwdParams& p, const SeqRows& s) {
  if constexpr (kPacked) return s.Lk;
  return p.Lk;
}

// lse (or delta, same layout) of (b, h) from the sequence's first row.
__device__ __forceinline__ int64_t lse_offset(const FwdParams& p, const SeqRows& s, int b, int h) {
  if constexpr (!kPacked) return (int64_t(b) * p.H + h) * p.Lq;
  return int64_t(b) * p.lse_sb + int64_t(h) * p.lse_sh + s.q_row0;
}

// What the backward reads of query head h of batch entry b (sequence b of a packed call): Q and
// dO from the sequence's first query row, its lse / delta rows, and the (b, h) slices of the
// mask and bias (nullptr where the module has none).
struct BwdHeadOperands {
  const Elem* q;
  const Elem* dout;
  const float* lse;
  const float* delta;
  const char* mask;
  const char* bias;
};

__device__ __forceinline__ BwdHeadOperands bwd_head_operands(const BwdParams& p, const SeqRows& sr,
                                                             int b, int h) {
  return {reinterpret_cast<const Elem*>(p.q) + int64_t(b) * p.q_sb + sr.q_row0 * p.q_sl +
              int64_t(h) * p.q_sh,
          reinterpret_cast<const Elem*>(p.dout) + int64_t(b) * p.do_sb + sr.q_row0 * p.do_sl +
              int64_t(h) * p.do_sh,
          p.lse + lse_offset(p, sr, b, h),
          p.delta + lse_offset(p, sr, b, h),
          kHasMask ? bcast_base<uint8_t>(p.mask, b, h, sr.aux_row0) : nullptr,
          kHasBias ? bcast_base<Elem>(p.bias, b, h, sr.aux_row0) : nullptr};
}

// Per-key dbias partials of (b, h) from the sequence's first key: dense (B, H, Lk), packed
// (H, total_k).
__device__ __forceinline__ int64_t dbias_key_offset(const BwdParams& p, const SeqRows& s, int b,
                                                    int h) {
  if constexpr (!kPacked) return (int64_t(b) * p.H + h) * p.Lk;
  return int64_t(b) * p.dbk_sb + int64_t(h) * p.dbk_sh + s.k_row0;
}

}  // namespace flash_dmattn
