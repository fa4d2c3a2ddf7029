// Torch binding of one kernel specialisation (head-dim bucket, dtype, mask / bias presence are
// fixed at compile time, see flash_dmattn/backends/cuda/spec.py). The Python backend
// (flash_dmattn/backends/cuda/kernels.py) validates inputs and builds the live-tile lists;
// these functions only check what would make a kernel read out of bounds.
//
//   fwd(q, k, v, mask, bias, out, softmax_scale, is_causal, softcap, tiles..., packed...)
//       -> [out, lse]
//   fwd_gathered(q, k, v, out, softmax_scale, is_causal, softcap, idx, cnt, hdiv, bits,
//                bits_hdiv, gbias, gbias_hdiv) -> [out, lse]   (gathered key lists; modules
//       with a mask, dense batches, sm_90 -- fwd_gathers() says whether this module has it)
//   bwd(dout, q, k, v, mask, bias, out, lse, softmax_scale, is_causal, softcap, ..., packed...,
//       gathered lists..., key_bits, key_bits_hdiv) -> [dq, dk, dv, dbias]   (gathered lists:
//       the forward's, for a dQ kernel over them -- bwd_gathers() says whether this module has
//       it; key bits: a per-query mask's, from the mask summary -- bwd_key_bits())
//   fwd_intervals(q, k, v, out, bias, bounds, tile_start, tile_len, tile_full, keys,
//                 softmax_scale, is_causal, softcap) -> [out, lse]
//   bwd_intervals(dout, q, k, v, bias, out, lse, bounds, blk_keys, blk_qlo, blk_qhi,
//                 blocks_per_row, segment_rows, softmax_scale, is_causal, softcap, need_dq,
//                 need_dkv, need_dbias) -> [dq, dk fp32, dv fp32, dbias (B, H, Lk) fp32]
//       (key-interval masks, see KeyIntervalLists in params.h; intervals() says whether this
//       module has them: a mask, dense batches, sm_90, head dim <= 128)
//   decode(q, k, v, mask, bias, cache_seqlens, block_table, softmax_scale, is_causal, softcap,
//          num_splits, poison) -> [out, lse]      (split-KV, forward only; k / v may be pools)
// fwd, fwd_gathered, bwd, fwd_intervals and bwd_intervals end with the attention dropout
// (see Dropout in params.h): drop_rng (the call's int64 (seed, offset[, batch]) tensor, or
// None: no dropout), drop_threshold, drop_scale, drop_b0, drop_h0, drop_heads (0: H). Only
// the sm_90 kernels of dense-batch modules with head dim <= 128 have it (dropout() says
// whether this module's do); the gathered dQ kernel has none.
// Packed sequences (cu_seqlens_q / cu_seqlens_k given): q / k / v are the packed
// (total, heads, D) tensors viewed as batch 1, a mask / bias is per key (1, Hm, 1, width)
// with sequence b's keys from cu_aux[b] (or cu_seqlens_k[b] without cu_aux), lse is
// (H, total_q) and per-key dbias partials (H, total_k).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <optional>
#include <vector>

#include "flash_dmattn/params.h"

namespace flash_dmattn {
cudaError_t run_fwd(const FwdParams& p, cudaStream_t stream);
bool fwd_gathers();
cudaError_t run_bwd(const BwdParams& p, cudaStream_t stream);
cudaError_t run_decode(const DecodeParams& p, cudaStream_t stream);
int decode_max_rows();
bool decode_warp_split(int rows);
int decode_block_n();
int fwd_block_m();
int fwd_block_n();
int bwd_block_m();
int bwd_block_n();
bool bwd_fused_dq();
bool bwd_gathers();
bool bwd_key_bits();
}  // namespace flash_dmattn

namespace {

using flash_dmattn::Bcast;
using flash_dmattn::BwdParams;
using flash_dmattn::DecodeParams;
using flash_dmattn::FwdParams;
using flash_dmattn::KeyGather;
using flash_dmattn::TileList;
using OptT = std::optional<at::Tensor>;

constexpr int kBucket = FLASH_DMATTN_HEADDIM;
const at::ScalarType kDtype = FLASH_DMATTN_IS_BF16 ? at::kBFloat16 : at::kHalf;

int64_t bstride(const at::Tensor& t, int d) { return t.size(d) == 1 ? 0 : t.stride(d); }

bool aligned16(int64_t elems, int64_t elem_size) { return (elems * elem_size) % 16 == 0; }

void check_qkv(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == kDtype, name, " has dtype ", t.scalar_type(),
              "; this kernel module was built for ", kDtype);
  TORCH_CHECK(t.dim() == 4, name, " must be 4-D (B, L, H, D)");
  TORCH_CHECK(t.stride(3) == 1, name, " must have a contiguous last dim");
  TORCH_CHECK(t.size(3) <= kBucket && t.size(3) % 8 == 0, name, " head dim ", t.size(3),
              " does not fit bucket ", kBucket, " (needs a multiple of 8)");
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK(t.size(d) == 1 || t.stride(d) % 8 == 0, name,
                " strides must be multiples of 8 elements (16-byte rows)");
  }
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must be 16-byte aligned");
}

Bcast make_bcast(const OptT& t, int64_t H, bool expected, const char* name,
                 at::ScalarType dtype) {
  Bcast p;
  TORCH_CHECK(t.has_value() == expected, "this kernel module was built ",
              expected ? "with " : "without ", "a ", name);
  if (!t.has_value()) return p;
  const at::Tensor& x = *t;
  TORCH_CHECK(x.is_cuda() && x.dim() == 4, name, " must be a 4-D CUDA tensor");
  TORCH_CHECK(x.scalar_type() == dtype, name, " has dtype ", x.scalar_type(), ", expected ",
              dtype);
  TORCH_CHECK(H % x.size(1) == 0, name, " heads must divide the query heads");
  p.ptr = x.data_ptr();
  p.sb = bstride(x, 0);
  p.sh = bstride(x, 1);
  p.sq = bstride(x, 2);
  p.sk = bstride(x, 3);
  p.hdiv = static_cast<int>(H / x.size(1));
  const int64_t es = x.element_size();
  p.vec = p.sk == 1 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
          aligned16(p.sb, es) && aligned16(p.sh, es) && aligned16(p.sq, es);
  return p;
}

TileList make_list(const OptT& idx, const OptT& cnt, int64_t hdiv) {
  TileList l;
  if (!idx.has_value()) return l;
  TORCH_CHECK(cnt.has_value(), "tile list counts missing");
  const at::Tensor& i = *idx;
  const at::Tensor& c = *cnt;
  TORCH_CHECK(i.scalar_type() == at::kInt && c.scalar_type() == at::kInt && i.dim() == 4 &&
                  c.dim() == 4 && c.size(3) == 2 && c.stride(3) == 1 && i.stride(3) == 1,
              "tile lists must be int32 (B, H, T, n) / (B, H, T, 2)");
  l.idx = i.data_ptr<int32_t>();
  l.cnt = c.data_ptr<int32_t>();
  l.idx_sb = bstride(i, 0);
  l.idx_sh = bstride(i, 1);
  l.idx_st = bstride(i, 2);
  l.cnt_sb = bstride(c, 0);
  l.cnt_sh = bstride(c, 1);
  l.cnt_st = bstride(c, 2);
  l.hdiv = static_cast<int>(hdiv);
  return l;
}

// A packed call: B becomes the number of sequences with batch strides 0, Lq / Lk the longest
// lengths (they size the grid; the kernels read each sequence's rows from cu_q / cu_k).
void fill_packed(FwdParams& p, const OptT& cu_q, const OptT& cu_k, const OptT& cu_aux,
                 int64_t max_q, int64_t max_k) {
  TORCH_CHECK(cu_q.has_value() == cu_k.has_value(), "pass both cu_seqlens or neither");
  p.lse_sb = int64_t(p.H) * p.Lq;
  p.lse_sh = p.Lq;
  TORCH_CHECK(cu_q.has_value() == bool(FLASH_DMATTN_PACKED), "this kernel module was built for ",
              FLASH_DMATTN_PACKED ? "packed sequences (cu_seqlens)" : "dense batches");
  if (!cu_q.has_value()) return;
  const at::Tensor& cq = *cu_q;
  const at::Tensor& ck = *cu_k;
  for (const at::Tensor* c : {&cq, &ck, cu_aux.has_value() ? &*cu_aux : &ck}) {
    TORCH_CHECK(c->is_cuda() && c->scalar_type() == at::kInt && c->dim() == 1 &&
                    c->is_contiguous(),
                "cu_seqlens must be contiguous int32 CUDA vectors");
  }
  TORCH_CHECK(cq.numel() == ck.numel() && cq.numel() >= 1, "cu_seqlens_q / _k lengths differ");
  TORCH_CHECK(!cu_aux.has_value() || cu_aux->numel() >= cq.numel(), "cu_aux too short");
  TORCH_CHECK(p.B == 1, "packed q / k / v are passed as batch 1");
  p.cu_q = cq.data_ptr<int32_t>();
  p.cu_k = ck.data_ptr<int32_t>();
  p.total_q = p.Lq;
  p.lse_sb = 0;
  p.lse_sh = p.Lq;  // (H, total_q)
  p.B = static_cast<int>(cq.numel() - 1);
  p.Lq = static_cast<int>(max_q);
  p.Lk = static_cast<int>(max_k);
  p.q_sb = p.k_sb = p.v_sb = 0;
  if (cu_aux.has_value()) {
    p.cu_aux = cu_aux->data_ptr<int32_t>();
  } else {
    // Sequences start at arbitrary keys: per-key rows are read element by element.
    p.mask.vec = false;
    p.bias.vec = false;
  }
}

// paged: k / v are page pools (num_pages, page_size, Hkv, D), not batches.
// Calls with nothing to compute need no kernel: no queries, or no keys (every row fully
// masked: zero output, lse -inf). Returns whether out / lse are final.
bool finished_without_keys(const FwdParams& p, at::Tensor& out, at::Tensor& lse) {
  if (int64_t(p.B) * p.H * p.Lq == 0) return true;
  if (p.Lk > 0) return false;
  out.zero_();
  lse.fill_(-INFINITY);
  return true;
}

bool dropout_built() { return FLASH_DMATTN_DROPOUT; }

// The call's dropout (see Dropout in params.h and the list above).
void fill_dropout(FwdParams& p, const at::Tensor& q, const OptT& rng, int64_t threshold, double scale, int64_t b0,
                  int64_t h0, int64_t heads) {
  if (!rng.has_value()) return;
  TORCH_CHECK(dropout_built(), "this kernel module has no dropout (it needs sm_90, dense batches "
              "and head dim <= 128)");
  const at::Tensor& r = *rng;
  TORCH_CHECK(r.is_cuda() && r.device() == q.device() && r.scalar_type() == at::kLong &&
                  r.dim() == 1 && (r.numel() == 2 || r.numel() == 3) && r.is_contiguous(),
              "drop_rng must be a contiguous int64 (seed, offset[, batch]) tensor on q's device");
  TORCH_CHECK(threshold >= 0 && threshold <= 256 && scale >= 1.0,
              "drop_threshold must be in [0, 256] and drop_scale >= 1");
  p.drop.rng = r.data_ptr<int64_t>();
  p.drop.rng_batch = r.numel() == 3;
  p.drop.threshold = static_cast<uint32_t>(threshold);
  p.drop.scale = static_cast<float>(scale);
  p.drop.b0 = b0;
  p.drop.h0 = static_cast<int>(h0);
  p.drop.heads = static_cast<int>(heads > 0 ? heads : p.H);
}

void fill_common(FwdParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const OptT& mask, const OptT& bias, double scale, bool causal, double softcap,
                 bool paged = false, bool aux = true) {
  check_qkv(q, "q");
  check_qkv(k, "k");
  check_qkv(v, "v");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have the same shape");
  TORCH_CHECK((paged || q.size(0) == k.size(0)) && q.size(3) == k.size(3),
              "q/k batch or head dim differ");
  TORCH_CHECK(q.size(2) % k.size(2) == 0, "kv heads must divide query heads");
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_sb = q.stride(0), p.q_sl = q.stride(1), p.q_sh = q.stride(2);
  p.k_sb = k.stride(0), p.k_sl = k.stride(1), p.k_sh = k.stride(2);
  p.v_sb = v.stride(0), p.v_sl = v.stride(1), p.v_sh = v.stride(2);
  p.B = q.size(0);
  p.Lq = q.size(1);
  p.H = q.size(2);
  p.D = q.size(3);
  p.Lk = k.size(1);
  p.Hkv = k.size(2);
  if (aux) {
    p.mask = make_bcast(mask, p.H, FLASH_DMATTN_HAS_MASK, "mask", at::kBool);
    p.bias = make_bcast(bias, p.H, FLASH_DMATTN_HAS_BIAS, "bias", kDtype);
  }
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  p.causal = causal;
}

std::vector<at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const OptT& mask, const OptT& bias, const OptT& out_,
                            double softmax_scale, bool is_causal, double softcap,
                            const OptT& list_idx, const OptT& list_cnt, int64_t list_hdiv,
                            const OptT& cu_q, const OptT& cu_k, const OptT& cu_aux,
                            int64_t max_q, int64_t max_k,
    const OptT& drop_rng, int64_t drop_threshold, double drop_scale, int64_t drop_b0,
    int64_t drop_h0, int64_t drop_heads) {
  c10::cuda::CUDAGuard guard(q.device());
  FwdParams p;
  fill_common(p, q, k, v, mask, bias, softmax_scale, is_causal, softcap);
  fill_dropout(p, q, drop_rng, drop_threshold, drop_scale, drop_b0, drop_h0, drop_heads);
  const bool packed = cu_q.has_value();
  // Packed rows past cu_seqlens_q[-1] belong to no sequence: zero output, lse -inf.
  at::Tensor out = out_.has_value() ? *out_
                   : packed       ? at::zeros_like(q, at::MemoryFormat::Contiguous)
                                  : at::empty_like(q, at::MemoryFormat::Contiguous);
  check_qkv(out, "out");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  at::Tensor lse = packed ? at::full({p.H, p.Lq}, -INFINITY, q.options().dtype(at::kFloat))
                          : at::empty({p.B, p.H, p.Lq}, q.options().dtype(at::kFloat));
  p.out = out.data_ptr();
  p.o_sb = out.stride(0), p.o_sl = out.stride(1), p.o_sh = out.stride(2);
  fill_packed(p, cu_q, cu_k, cu_aux, max_q, max_k);
  if (packed) p.o_sb = 0;
  p.lse = lse.data_ptr<float>();
  p.use_list = list_idx.has_value();
  p.list = make_list(list_idx, list_cnt, list_hdiv);
  if (finished_without_keys(p, out, lse)) return {out, lse};
  cudaError_t err = flash_dmattn::run_fwd(p, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flash_dmattn cuda fwd: ", cudaGetErrorString(err));
  return {out, lse};
}

// The gathered key lists of a call (see KeyGather in params.h): idx (Bm, Hm, nQ, >= Lk) int32,
// cnt (Bm, Hm, nQ) int32, bits (Bm, Hm, nQ * block_m, W) int64, gbias (Bg, Hg, nQ, width) in
// q's dtype or none; nQ = ceil(Lq / block_m) at the forward's block_m (the gathered dQ kernel
// uses the same query tiles). Broadcast dims have size 1 (or stride 0). Without bits (the dQ
// kernel only) the lists are a per-key mask's live keys, each row 16-byte aligned: every
// listed key is visible up to causality.
void fill_gather(FwdParams& p, const at::Tensor& idx, const at::Tensor& cnt, int64_t hdiv,
                 const OptT& bits_, int64_t bits_hdiv, const OptT& gbias,
                 int64_t gbias_hdiv) {
  TORCH_CHECK(gbias.has_value() == bool(FLASH_DMATTN_HAS_BIAS), "this kernel module was built ",
              FLASH_DMATTN_HAS_BIAS ? "with" : "without", " a bias");
  const int64_t n_q = (p.Lq + flash_dmattn::fwd_block_m() - 1) / flash_dmattn::fwd_block_m();
  TORCH_CHECK(idx.is_cuda() && idx.scalar_type() == at::kInt && idx.dim() == 4 &&
                  idx.stride(3) == 1 && idx.size(2) == n_q && idx.size(3) >= p.Lk,
              "gather idx must be int32 (B, H, ceil(Lq / block_m), >= Lk)");
  TORCH_CHECK(cnt.is_cuda() && cnt.scalar_type() == at::kInt && cnt.dim() == 3 &&
                  cnt.size(2) == n_q,
              "gather cnt must be int32 (B, H, ceil(Lq / block_m))");
  if (bits_.has_value()) {
    const at::Tensor& bits = *bits_;
    TORCH_CHECK(bits.is_cuda() && bits.scalar_type() == at::kLong && bits.dim() == 4 &&
                    bits.stride(3) == 1 && bits.size(2) >= n_q * flash_dmattn::fwd_block_m() &&
                    bits.size(3) * 64 >= p.Lk,
                "gather bits must be int64 (B, H, ceil(Lq / block_m) * block_m, ceil(Lk / 64))");
  } else {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(idx.data_ptr()) % 16 == 0 &&
                    idx.stride(0) % 4 == 0 && idx.stride(1) % 4 == 0 && idx.stride(2) % 4 == 0,
                "gather idx rows without bits must be 16-byte aligned");
  }
  for (const at::Tensor* t : {&idx, &cnt}) {
    TORCH_CHECK((t->size(0) == 1 || t->size(0) == p.B) && p.H % t->size(1) == 0,
                "gather lists must broadcast to the batch and divide the heads");
  }
  if (bits_.has_value()) {
    TORCH_CHECK((bits_->size(0) == 1 || bits_->size(0) == p.B) && p.H % bits_->size(1) == 0,
                "gather lists must broadcast to the batch and divide the heads");
  }
  p.gather = true;
  KeyGather& g = p.g;
  g.idx = idx.data_ptr<int32_t>();
  g.idx_sb = bstride(idx, 0), g.idx_sh = bstride(idx, 1), g.idx_sm = idx.stride(2);
  g.cnt = cnt.data_ptr<int32_t>();
  g.cnt_sb = bstride(cnt, 0), g.cnt_sh = bstride(cnt, 1), g.cnt_sm = cnt.stride(2);
  g.hdiv = static_cast<int>(hdiv);
  if (bits_.has_value()) {
    const at::Tensor& bits = *bits_;
    g.bits = reinterpret_cast<const uint64_t*>(bits.data_ptr<int64_t>());
    g.bits_sb = bstride(bits, 0), g.bits_sh = bstride(bits, 1), g.bits_sq = bits.stride(2);
    g.bits_hdiv = static_cast<int>(bits_hdiv);
  }
  if (gbias.has_value()) {
    const at::Tensor& gb = *gbias;
    TORCH_CHECK(gb.is_cuda() && gb.scalar_type() == kDtype && gb.dim() == 4 &&
                    gb.stride(3) == 1 && gb.size(2) == n_q && gb.size(3) % 64 == 0 &&
                    gb.size(3) >= p.Lk && p.H % gb.size(1) == 0 &&
                    reinterpret_cast<uintptr_t>(gb.data_ptr()) % 16 == 0 &&
                    aligned16(gb.stride(0), 2) && aligned16(gb.stride(1), 2) &&
                    aligned16(gb.stride(2), 2),
                "gathered bias must be (B, H, ceil(Lq / block_m), width % 64 == 0) in q's dtype "
                "with 16-byte aligned rows");
    g.bias = gb.data_ptr();
    g.bias_sb = bstride(gb, 0), g.bias_sh = bstride(gb, 1), g.bias_sm = gb.stride(2);
    g.bias_hdiv = static_cast<int>(gbias_hdiv);
    g.bias_width = static_cast<int>(gb.size(3));
  }
}

// The output (``out_`` or a new contiguous tensor like q) and the (B, H, Lq) fp32 lse of a
// dense-batch forward, wired into p.
std::pair<at::Tensor, at::Tensor> dense_out_lse(FwdParams& p, const at::Tensor& q,
                                                const OptT& out_) {
  at::Tensor out = out_.has_value() ? *out_ : at::empty_like(q, at::MemoryFormat::Contiguous);
  check_qkv(out, "out");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  at::Tensor lse = at::empty({p.B, p.H, p.Lq}, q.options().dtype(at::kFloat));
  p.out = out.data_ptr();
  p.o_sb = out.stride(0), p.o_sl = out.stride(1), p.o_sh = out.stride(2);
  p.lse = lse.data_ptr<float>();
  p.lse_sb = int64_t(p.H) * p.Lq;
  p.lse_sh = p.Lq;
  return {out, lse};
}

// The forward over gathered key lists (see KeyGather in params.h): idx (Bm, Hm, nQ, >= Lk)
// int32, cnt (Bm, Hm, nQ) int32, bits (Bm, Hm, nQ * block_m, W) int64, gbias (Bg, Hg, nQ,
// width) in q's dtype or none; nQ = ceil(Lq / block_m). Broadcast dims have size 1.
std::vector<at::Tensor> fwd_gathered(const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const OptT& out_, double softmax_scale,
                                     bool is_causal, double softcap, const at::Tensor& idx,
                                     const at::Tensor& cnt, int64_t hdiv, const at::Tensor& bits,
                                     int64_t bits_hdiv, const OptT& gbias, int64_t gbias_hdiv,
    const OptT& drop_rng, int64_t drop_threshold, double drop_scale, int64_t drop_b0,
    int64_t drop_h0, int64_t drop_heads) {
  c10::cuda::CUDAGuard guard(q.device());
  TORCH_CHECK(flash_dmattn::fwd_gathers(), "this kernel module has no gathered forward (it needs "
              "a mask, dense batches and sm_90)");
  FwdParams p;
  fill_common(p, q, k, v, std::nullopt, std::nullopt, softmax_scale, is_causal, softcap,
              /*paged=*/false, /*aux=*/false);
  auto [out, lse] = dense_out_lse(p, q, out_);
  fill_gather(p, idx, cnt, hdiv, bits, bits_hdiv, gbias, gbias_hdiv);
  fill_dropout(p, q, drop_rng, drop_threshold, drop_scale, drop_b0, drop_h0, drop_heads);
  if (finished_without_keys(p, out, lse)) return {out, lse};
  cudaError_t err = flash_dmattn::run_fwd(p, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flash_dmattn cuda fwd_gathered: ", cudaGetErrorString(err));
  return {out, lse};
}

// The gradient outputs' pointers and strides (dq like q; dk / dv like k / v, or their fp32
// accumulators).
void set_grads(BwdParams& p, const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv) {
  p.dq = dq.data_ptr();
  p.dq_sb = dq.stride(0), p.dq_sl = dq.stride(1), p.dq_sh = dq.stride(2);
  p.dk = dk.data_ptr();
  p.dk_sb = dk.stride(0), p.dk_sl = dk.stride(1), p.dk_sh = dk.stride(2);
  p.dv = dv.data_ptr();
  p.dv_sb = dv.stride(0), p.dv_sl = dv.stride(1), p.dv_sh = dv.stride(2);
}

// Key-interval masks (see KeyIntervalLists in params.h). bounds: contiguous int32
// (2, B, R, Lk) with R = Hkv (or H when H == Hkv); a bias is per key (Bx, Hb, 1, Lk) in q's
// dtype; tile lists are the planner's (B * R, ceil(Lq / fwd_block_m)) int32.
bool intervals_built() { return flash_dmattn::fwd_gathers() && flash_dmattn::bwd_gathers(); }

void fill_intervals(FwdParams& p, const OptT& bias, const at::Tensor& bounds) {
  TORCH_CHECK(intervals_built(), "this kernel module has no key-interval kernels (they need a "
              "mask, dense batches, sm_90 and head dim <= 128)");
  TORCH_CHECK(bias.has_value() == bool(FLASH_DMATTN_HAS_BIAS), "this kernel module was built ",
              FLASH_DMATTN_HAS_BIAS ? "with" : "without", " a bias");
  TORCH_CHECK(bounds.is_cuda() && bounds.scalar_type() == at::kInt && bounds.is_contiguous() &&
                  bounds.dim() == 4 && bounds.size(0) == 2 && bounds.size(1) == p.B &&
                  bounds.size(3) == p.Lk && p.H % bounds.size(2) == 0 &&
                  bounds.size(2) % p.Hkv == 0 && bounds.size(2) <= p.Hkv,
              "key-interval bounds must be contiguous int32 (2, B, Hkv, Lk)");
  p.intervals = true;
  flash_dmattn::KeyIntervalLists& iv = p.iv;
  iv.bounds = bounds.data_ptr<int32_t>();
  iv.bounds_plane = bounds[0].numel();
  iv.row_heads = static_cast<int>(bounds.size(2));
  iv.hdiv = static_cast<int>(p.H / bounds.size(2));
  if (bias.has_value()) {
    const at::Tensor& x = *bias;
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == kDtype && x.dim() == 4 && x.size(2) == 1 &&
                    (x.size(0) == 1 || x.size(0) == p.B) && p.H % x.size(1) == 0 &&
                    (x.size(3) == 1 || x.size(3) == p.Lk),
                "a bias with key intervals must be per key (B, H, 1, Lk) in q's dtype");
    iv.bias = x.data_ptr();
    iv.bias_sb = bstride(x, 0);
    iv.bias_sh = bstride(x, 1);
    iv.bias_sk = bstride(x, 3);
    iv.bias_hdiv = static_cast<int>(p.H / x.size(1));
  }
}

void check_list(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kInt && t.is_contiguous(), name,
              " must be a contiguous int32 CUDA tensor");
}

std::vector<at::Tensor> fwd_intervals(const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, const OptT& out_, const OptT& bias,
                                      const at::Tensor& bounds, const at::Tensor& tile_start,
                                      const at::Tensor& tile_len, const at::Tensor& tile_full,
                                      const at::Tensor& keys, double softmax_scale,
                                      bool is_causal, double softcap,
    const OptT& drop_rng, int64_t drop_threshold, double drop_scale, int64_t drop_b0,
    int64_t drop_h0, int64_t drop_heads) {
  c10::cuda::CUDAGuard guard(q.device());
  FwdParams p;
  fill_common(p, q, k, v, std::nullopt, std::nullopt, softmax_scale, is_causal, softcap,
              /*paged=*/false, /*aux=*/false);
  fill_packed(p, std::nullopt, std::nullopt, std::nullopt, 0, 0);
  fill_intervals(p, bias, bounds);
  fill_dropout(p, q, drop_rng, drop_threshold, drop_scale, drop_b0, drop_h0, drop_heads);
  const int64_t n_tiles = (p.Lq + flash_dmattn::fwd_block_m() - 1) / flash_dmattn::fwd_block_m();
  check_list(tile_start, "tile_start");
  check_list(tile_len, "tile_len");
  check_list(tile_full, "tile_full");
  check_list(keys, "keys");
  TORCH_CHECK(tile_start.dim() == 2 && tile_start.size(0) == p.B * p.iv.row_heads &&
                  tile_start.size(1) == n_tiles && tile_len.sizes() == tile_start.sizes() &&
                  tile_full.sizes() == tile_start.sizes(),
              "tile lists must be (B * bounds heads, ceil(Lq / fwd_block_m))");
  p.iv.tile_start = tile_start.data_ptr<int32_t>();
  p.iv.tile_len = tile_len.data_ptr<int32_t>();
  p.iv.tile_full = tile_full.data_ptr<int32_t>();
  p.iv.keys = keys.data_ptr<int32_t>();
  p.iv.n_tiles = static_cast<int>(n_tiles);
  auto [out, lse] = dense_out_lse(p, q, out_);
  if (finished_without_keys(p, out, lse)) return {out, lse};
  cudaError_t err = flash_dmattn::run_fwd(p, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flash_dmattn cuda fwd_intervals: ", cudaGetErrorString(err));
  return {out, lse};
}

std::vector<at::Tensor> bwd_intervals(const at::Tensor& dout, const at::Tensor& q,
                                      const at::Tensor& k, const at::Tensor& v, const OptT& bias,
                                      const at::Tensor& out, const at::Tensor& lse,
                                      const at::Tensor& bounds, const at::Tensor& blk_keys,
                                      const at::Tensor& blk_qlo, const at::Tensor& blk_qhi,
                                      int64_t blocks_per_row, int64_t segment_rows,
                                      double softmax_scale, bool is_causal, double softcap,
                                      bool need_dq, bool need_dkv, bool need_dbias,
    const OptT& drop_rng, int64_t drop_threshold, double drop_scale, int64_t drop_b0,
    int64_t drop_h0, int64_t drop_heads) {
  c10::cuda::CUDAGuard guard(q.device());
  BwdParams p;
  fill_common(p, q, k, v, std::nullopt, std::nullopt, softmax_scale, is_causal, softcap,
              /*paged=*/false, /*aux=*/false);
  fill_packed(p, std::nullopt, std::nullopt, std::nullopt, 0, 0);
  fill_intervals(p, bias, bounds);
  TORCH_CHECK(p.iv.row_heads == p.Hkv, "key-interval bounds of the backward must be per kv head");
  fill_dropout(p, q, drop_rng, drop_threshold, drop_scale, drop_b0, drop_h0, drop_heads);
  check_qkv(dout, "dout");
  check_qkv(out, "out");
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "dout/out shape");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 3,
              "lse must be contiguous fp32 (B, H, Lq)");
  check_list(blk_keys, "blk_keys");
  check_list(blk_qlo, "blk_qlo");
  check_list(blk_qhi, "blk_qhi");
  const int64_t n_blocks = blk_keys.size(0);
  TORCH_CHECK(blk_keys.dim() == 2 && blk_keys.size(1) == flash_dmattn::bwd_block_n() &&
                  blk_qlo.numel() == n_blocks && blk_qhi.numel() == n_blocks &&
                  blocks_per_row >= 1 && n_blocks == blocks_per_row * p.B * p.Hkv,
              "key blocks must be (B * Hkv * blocks_per_row, bwd_block_n)");
  TORCH_CHECK(segment_rows > 0 && segment_rows % flash_dmattn::bwd_block_m() == 0,
              "segment_rows must be a positive multiple of bwd_block_m");
  TORCH_CHECK(!need_dbias || bias.has_value(), "dbias needs a bias");
  p.iv.blk_keys = blk_keys.data_ptr<int32_t>();
  p.iv.blk_qlo = blk_qlo.data_ptr<int32_t>();
  p.iv.blk_qhi = blk_qhi.data_ptr<int32_t>();
  p.iv.n_blocks = static_cast<int>(n_blocks);
  p.iv.blocks_per_row = static_cast<int>(blocks_per_row);
  p.iv.segment_rows = static_cast<int>(segment_rows);
  p.out = out.data_ptr();
  p.o_sb = out.stride(0), p.o_sl = out.stride(1), p.o_sh = out.stride(2);
  p.lse = lse.data_ptr<float>();
  p.dout = dout.data_ptr();
  p.do_sb = dout.stride(0), p.do_sl = dout.stride(1), p.do_sh = dout.stride(2);
  at::Tensor delta = at::empty({p.B, p.H, p.Lq}, q.options().dtype(at::kFloat));
  p.delta = delta.data_ptr<float>();
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dq = at::empty_like(q, at::MemoryFormat::Contiguous);
  // dK / dV / dbias are sums over a block's query segments: zeroed fp32, added by atomics.
  at::Tensor dk = at::zeros({p.B, p.Lk, p.Hkv, p.D}, f32);
  at::Tensor dv = at::zeros({p.B, p.Lk, p.Hkv, p.D}, f32);
  set_grads(p, dq, dk, dv);
  p.need_dq = need_dq;
  p.need_dkv = need_dkv;
  at::Tensor dbias;
  if (need_dbias) {
    dbias = at::zeros({p.B, p.H, p.Lk}, f32);
    p.dbias_keys = dbias.data_ptr<float>();
  }
  at::Tensor dq_accum;
  if (need_dq) {
    const int64_t q_rows = (p.Lq + 63) / 64 * 64;
    dq_accum = at::zeros({p.B, p.H, q_rows, FLASH_DMATTN_HEADDIM}, f32);
    p.dq_accum = dq_accum.data_ptr<float>();
  }
  if (p.B * p.H == 0 || p.Lq == 0 || p.Lk == 0) {
    dq.zero_();
    return {dq, dk, dv, dbias};
  }
  cudaError_t err = flash_dmattn::run_bwd(p, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flash_dmattn cuda bwd_intervals: ", cudaGetErrorString(err));
  return {dq, dk, dv, dbias};
}

// dbias_mode: 0 none, 1 full (bias has every dim except possibly none broadcast: written as
// dS), 2 per-key partials (B, H, Lk) fp32 for a bias broadcast over queries.
std::vector<at::Tensor> bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const OptT& mask, const OptT& bias,
                            const at::Tensor& out, const at::Tensor& lse, double softmax_scale,
                            bool is_causal, double softcap, bool need_dq, bool need_dkv,
                            int64_t dbias_mode, const OptT& fwd_idx, const OptT& fwd_cnt,
                            const OptT& bwd_idx, const OptT& bwd_cnt, int64_t list_hdiv,
                            bool allow_fused_dq, const OptT& cu_q, const OptT& cu_k,
                            const OptT& cu_aux, int64_t max_q, int64_t max_k,
                            const OptT& gather_idx, const OptT& gather_cnt, int64_t gather_hdiv,
                            const OptT& gather_bits, int64_t gather_bits_hdiv,
                            const OptT& gather_bias, int64_t gather_bias_hdiv,
                            const OptT& key_bits, int64_t key_bits_hdiv,
    const OptT& drop_rng, int64_t drop_threshold, double drop_scale, int64_t drop_b0,
    int64_t drop_h0, int64_t drop_heads) {
  c10::cuda::CUDAGuard guard(q.device());
  BwdParams p;
  fill_common(p, q, k, v, mask, bias, softmax_scale, is_causal, softcap);
  fill_dropout(p, q, drop_rng, drop_threshold, drop_scale, drop_b0, drop_h0, drop_heads);
  check_qkv(dout, "dout");
  check_qkv(out, "out");
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "dout/out shape");
  const bool packed = cu_q.has_value();
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() &&
                  lse.dim() == (packed ? 2 : 3),
              "lse must be contiguous fp32 (B, H, Lq), or (H, total_q) for packed sequences");
  const int64_t total_k = k.size(1);
  p.out = out.data_ptr();
  p.o_sb = out.stride(0), p.o_sl = out.stride(1), p.o_sh = out.stride(2);
  p.lse = lse.data_ptr<float>();
  p.dout = dout.data_ptr();
  p.do_sb = dout.stride(0), p.do_sl = dout.stride(1), p.do_sh = dout.stride(2);
  at::Tensor delta = packed ? at::empty({p.H, p.Lq}, q.options().dtype(at::kFloat))
                            : at::empty({p.B, p.H, p.Lq}, q.options().dtype(at::kFloat));
  p.delta = delta.data_ptr<float>();
  // Packed rows past cu_seqlens[-1] belong to no sequence and are never written: zeros.
  auto grad_like = [&](const at::Tensor& t) {
    return packed ? at::zeros_like(t, at::MemoryFormat::Contiguous)
                  : at::empty_like(t, at::MemoryFormat::Contiguous);
  };
  at::Tensor dq = grad_like(q);
  at::Tensor dk = grad_like(k);
  at::Tensor dv = grad_like(v);
  set_grads(p, dq, dk, dv);
  p.need_dq = need_dq;
  p.need_dkv = need_dkv;
  at::Tensor dbias;
  if (dbias_mode == 1) {
    TORCH_CHECK(bias.has_value() && bias->size(0) == p.B && bias->size(1) == p.H &&
                    bias->size(2) == p.Lq && bias->size(3) == p.Lk,
                "full dbias needs a (B, H, Lq, Lk) bias");
    // Zeroed: the dQ kernel writes dS only on live tiles; dead tiles' gradient is 0.
    dbias = at::zeros({p.B, p.H, p.Lq, p.Lk}, q.options());
    p.dbias_full = dbias.data_ptr();
    p.dbf_sb = dbias.stride(0), p.dbf_sh = dbias.stride(1), p.dbf_sq = dbias.stride(2);
  } else if (dbias_mode == 2) {
    TORCH_CHECK(bias.has_value() && bias->size(2) == 1, "per-key dbias needs a (.., 1, ..) bias");
    dbias = packed ? at::zeros({p.H, total_k}, q.options().dtype(at::kFloat))
                   : at::empty({p.B, p.H, p.Lk}, q.options().dtype(at::kFloat));
    p.dbias_keys = dbias.data_ptr<float>();
    p.dbk_sb = packed ? 0 : int64_t(p.H) * p.Lk;
    p.dbk_sh = packed ? total_k : p.Lk;
  }
  TORCH_CHECK(!packed || dbias_mode != 1, "packed sequences take per-key biases only");
  // Gathered dQ: the forward's key lists (fwd_gathered) drive a dQ kernel that walks only the
  // query tile's live keys; dK / dV still walk key tiles with the mask itself.
  const bool gathered_dq = gather_idx.has_value();
  if (gathered_dq) {
    TORCH_CHECK(flash_dmattn::bwd_gathers(), "this kernel module has no gathered dQ kernel (it "
                "needs a mask, dense batches, sm_90 and head dim <= 128)");
    TORCH_CHECK(gather_cnt.has_value(), "gathered dQ needs the lists' idx and cnt");
    TORCH_CHECK(dbias_mode != 1 && !packed,
                "gathered dQ takes per-key biases of dense batches only");
    TORCH_CHECK(p.drop.rng == nullptr, "the gathered dQ kernel has no dropout");
    fill_gather(p, *gather_idx, *gather_cnt, gather_hdiv, gather_bits, gather_bits_hdiv,
                gather_bias, gather_bias_hdiv);
  }
  if (key_bits.has_value()) {
    // The mask summary's key bits (see BwdParams::kbits): read 16 bytes at a time from key
    // tile starts, so rows must be 16-byte aligned and long enough for the last tile.
    const at::Tensor& kb = *key_bits;
    const int64_t padded_k = (p.Lk + 127) / 128 * 128;
    TORCH_CHECK(flash_dmattn::bwd_key_bits() && mask.has_value() && p.mask.sq != 0 && !packed,
                "key bits go with a per-query mask of a dense batch");
    TORCH_CHECK(kb.is_cuda() && kb.scalar_type() == at::kLong && kb.dim() == 4 &&
                    kb.stride(3) == 1 && kb.size(2) == (p.Lq + 63) / 64 &&
                    kb.size(3) >= padded_k && p.H % kb.size(1) == 0 &&
                    p.H / kb.size(1) == key_bits_hdiv &&
                    (kb.size(0) == 1 || kb.size(0) == p.B) &&
                    reinterpret_cast<uintptr_t>(kb.data_ptr()) % 16 == 0 &&
                    aligned16(kb.stride(0), 8) && aligned16(kb.stride(1), 8) &&
                    aligned16(kb.stride(2), 8),
                "key bits must be int64 (B, H / hdiv, ceil(Lq / 64), >= Lk rounded up to 128) "
                "with 16-byte aligned rows");
    p.kbits = reinterpret_cast<const uint64_t*>(kb.data_ptr<int64_t>());
    p.kbits_sb = bstride(kb, 0), p.kbits_sh = bstride(kb, 1), p.kbits_sw = kb.stride(2);
    p.kbits_hdiv = static_cast<int>(key_bits_hdiv);
  }
  at::Tensor dq_accum;
  // Fused dQ: the dK/dV kernel adds dS K into a zeroed fp32 accumulator with atomics (not
  // bitwise reproducible, so only when the caller allows it); a full per-element dbias still
  // needs the dQ kernel, which writes it.
  // Not for packed calls: the accumulator would be padded to the longest sequence.
  if (allow_fused_dq && need_dq && dbias_mode != 1 && !packed && !gathered_dq &&
      flash_dmattn::bwd_fused_dq()) {
    const int64_t q_rows = (p.Lq + 63) / 64 * 64;
    dq_accum = at::zeros({p.B, p.H, q_rows, FLASH_DMATTN_HEADDIM}, q.options().dtype(at::kFloat));
    p.dq_accum = dq_accum.data_ptr<float>();
  }
  p.use_list = fwd_idx.has_value();
  // A packed call passes its sequences' key-tile lists once (both kernels walk them).
  TORCH_CHECK(packed ? !bwd_idx.has_value() : p.use_list == bwd_idx.has_value(),
              "pass both tile lists or neither (packed calls: the key-tile lists only)");
  p.list = make_list(fwd_idx, fwd_cnt, list_hdiv);
  p.bwd_list = make_list(bwd_idx, bwd_cnt, list_hdiv);
  fill_packed(p, cu_q, cu_k, cu_aux, max_q, max_k);
  if (packed) p.o_sb = p.do_sb = p.dq_sb = p.dk_sb = p.dv_sb = 0;
  if (p.B * p.H == 0 || p.Lq == 0 || p.Lk == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    if (dbias.defined()) dbias.zero_();
    return {dq, dk, dv, dbias};
  }
  cudaError_t err = flash_dmattn::run_bwd(p, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flash_dmattn cuda bwd: ", cudaGetErrorString(err));
  return {dq, dk, dv, dbias};
}

// Split-KV decode: rows = (H / Hkv) * Lq <= decode_max_rows(). cache_seqlens (B,) int32 limits
// each batch's keys; block_table (B, P) int32 makes k / v page pools of P * page_size logical
// keys per batch. num_splits > 1 writes fp32 partials that a second kernel merges. poison fills
// every kernel-written buffer with NaN first (tests: unwritten elements show).
std::vector<at::Tensor> decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const OptT& mask, const OptT& bias, const OptT& cache_seqlens,
                               const OptT& block_table, double softmax_scale, bool is_causal,
                               double softcap, int64_t num_splits, bool poison) {
  c10::cuda::CUDAGuard guard(q.device());
  TORCH_CHECK(!FLASH_DMATTN_PACKED, "decode runs in the dense module of a spec, not -varlen");
  DecodeParams p;
  const bool paged = block_table.has_value();
  fill_common(p, q, k, v, mask, bias, softmax_scale, is_causal, softcap, paged);
  if (paged) {
    const at::Tensor& bt = *block_table;
    TORCH_CHECK(bt.is_cuda() && bt.scalar_type() == at::kInt && bt.dim() == 2 &&
                    bt.size(0) == q.size(0) && bt.stride(1) == 1,
                "block_table must be an int32 CUDA (B, pages) tensor with contiguous rows");
    p.block_table = bt.data_ptr<int32_t>();
    p.bt_sb = bt.stride(0);
    p.page_size = static_cast<int>(k.size(1));
    p.num_pages = static_cast<int>(k.size(0));
    TORCH_CHECK(p.page_size > 0 && p.page_size % 16 == 0, "page size must be a multiple of 16");
    p.Lk = static_cast<int>(bt.size(1) * k.size(1));  // logical keys per batch
  }
  if (cache_seqlens.has_value()) {
    const at::Tensor& cs = *cache_seqlens;
    TORCH_CHECK(cs.is_cuda() && cs.scalar_type() == at::kInt && cs.dim() == 1 &&
                    cs.size(0) == q.size(0) && cs.is_contiguous(),
                "cache_seqlens must be a contiguous int32 CUDA (B,) tensor");
    p.seqused = cs.data_ptr<int32_t>();
  }
  p.G = p.H / p.Hkv;
  p.rows = p.G * p.Lq;
  TORCH_CHECK(p.rows <= flash_dmattn::decode_max_rows(), "decode takes (H / Hkv) * Lq <= ",
              flash_dmattn::decode_max_rows(), " rows, got ", p.rows);
  TORCH_CHECK(int64_t(p.B) * p.Hkv <= 65535, "decode grid: B * Hkv must be <= 65535");
  // Broadcast masks / biases whose row is the same for every row of a CTA (one query row or
  // Lq == 1, and one head per group) load one row per tile.
  auto shared_rows = [&](const OptT& t) {
    return t.has_value() && (t->size(2) == 1 || p.Lq == 1) && (t->size(1) != p.H || p.G == 1);
  };
  p.mask_shared = shared_rows(mask);
  p.bias_shared = shared_rows(bias);
  auto fresh = [&](at::IntArrayRef shape, at::ScalarType dtype) {
    auto opts = q.options().dtype(dtype);
    return poison ? at::full(shape, NAN, opts) : at::empty(shape, opts);
  };
  at::Tensor out = fresh(q.sizes(), q.scalar_type());
  at::Tensor lse = fresh({p.B, p.H, p.Lq}, at::kFloat);
  p.out = out.data_ptr();
  p.o_sb = out.stride(0), p.o_sl = out.stride(1), p.o_sh = out.stride(2);
  p.lse = lse.data_ptr<float>();
  if (finished_without_keys(p, out, lse)) return {out, lse};
  p.num_splits = static_cast<int>(std::max<int64_t>(1, num_splits));
  p.warp_split = flash_dmattn::decode_warp_split(p.rows);
  at::Tensor o_part, lse_part;
  if (p.num_splits > 1) {
    const int64_t part_rows = int64_t(p.B) * p.Hkv * p.rows;
    o_part = fresh({p.num_splits, part_rows, p.D}, at::kFloat);
    lse_part = fresh({p.num_splits, part_rows}, at::kFloat);
    p.o_part = o_part.data_ptr<float>();
    p.lse_part = lse_part.data_ptr<float>();
  }
  cudaError_t err = flash_dmattn::run_decode(p, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flash_dmattn cuda decode: ", cudaGetErrorString(err));
  return {out, lse};
}

std::vector<int64_t> decode_sizes() {
  return {flash_dmattn::decode_max_rows(), flash_dmattn::decode_block_n()};
}

std::vector<int64_t> block_sizes() {
  return {flash_dmattn::fwd_block_m(), flash_dmattn::fwd_block_n(),
          flash_dmattn::bwd_block_m(), flash_dmattn::bwd_block_n()};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_dmattn CUDA kernels (one head-dim / dtype / mask / bias specialisation)";
  m.def("fwd", &fwd, "attention forward -> [out, lse]");
  m.def("fwd_gathered", &fwd_gathered, "attention forward over gathered key lists -> [out, lse]");
  m.def("fwd_gathers", &flash_dmattn::fwd_gathers, "whether fwd_gathered is built in");
  m.def("bwd_gathers", &flash_dmattn::bwd_gathers,
        "whether bwd takes gathered key lists (a gathered dQ kernel is built in)");
  m.def("bwd_key_bits", &flash_dmattn::bwd_key_bits,
        "whether bwd reads a per-query mask's key bits (the mask summary's, bwd(..., key_bits))");
  m.def("bwd", &bwd, "attention backward -> [dq, dk, dv, dbias]");
  m.def("intervals", &intervals_built,
        "whether fwd_intervals / bwd_intervals (key-interval masks) are built in");
  m.def("dropout", &dropout_built,
        "whether this module's kernels take dropout (the drop_* arguments)");
  m.def("fwd_intervals", &fwd_intervals, "attention forward over key-interval lists -> [out, lse]");
  m.def("bwd_intervals", &bwd_intervals,
        "attention backward over key-interval key blocks -> [dq, dk fp32, dv fp32, dbias fp32]");
  m.def("fused_dq", &flash_dmattn::bwd_fused_dq,
        "whether bwd(..., allow_fused_dq=True) computes dQ inside the dK/dV kernel (atomics)");
  m.def("block_sizes", &block_sizes, "(fwd_block_m, fwd_block_n, bwd_block_m, bwd_block_n)");
  m.def("decode", &decode, "split-KV decode forward (KV cache, paged or not) -> [out, lse]");
  m.def("decode_sizes", &decode_sizes, "(decode_max_rows, decode_block_n)");
}
