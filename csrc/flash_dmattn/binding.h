// Argument checks and parameter filling shared by the Torch bindings of the three operations
// (flash_fwd_api.cpp, flash_bwd_api.cpp, flash_decode_api.cpp). Each operation of a kernel
// specialisation is an extension module of its own, built from its binding and its kernels
// only (flash_dmattn/backends/cuda/jit.py: OP_SOURCES), so a forward needs no backward compile.
// These functions only check what would make a kernel read out of bounds; the Python backend
// (flash_dmattn/backends/cuda/kernels.py) validates the rest.
//
// The bindings are compiled by the host compiler with the spec's macros but not the arch's
// (FLASH_DMATTN_SM90 and what derives from it are nvcc flags): whatever depends on the arch
// (tile sizes, which kernels exist) is asked of functions the kernel sources define.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "params.h"

namespace flash_dmattn::binding {

using OptT = std::optional<at::Tensor>;

constexpr int kBucket = FLASH_DMATTN_HEADDIM;
constexpr at::ScalarType kDtype = FLASH_DMATTN_IS_BF16 ? at::kBFloat16 : at::kHalf;

inline int64_t bstride(const at::Tensor& t, int d) { return t.size(d) == 1 ? 0 : t.stride(d); }

inline bool aligned16(int64_t elems, int64_t elem_size) { return (elems * elem_size) % 16 == 0; }

inline void check_qkv(const at::Tensor& t, const char* name) {
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

inline Bcast make_bcast(const OptT& t, int64_t H, bool expected, const char* name,
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

inline TileList make_list(const OptT& idx, const OptT& cnt, int64_t hdiv) {
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
inline void fill_packed(FwdParams& p, const OptT& cu_q, const OptT& cu_k, const OptT& cu_aux,
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
inline bool finished_without_keys(const FwdParams& p, at::Tensor& out, at::Tensor& lse) {
  if (int64_t(p.B) * p.H * p.Lq == 0) return true;
  if (p.Lk > 0) return false;
  out.zero_();
  lse.fill_(-INFINITY);
  return true;
}

// The call's attention dropout (Dropout in params.h): drop_rng is the call's int64 (seed,
// offset[, batch]) tensor on q's device, or None (no dropout); drop_heads 0 means H. `built`:
// whether this module's kernels take dropout (the kernel sources answer, see above).
inline void fill_dropout(FwdParams& p, bool built, const at::Tensor& q, const OptT& rng,
                         int64_t threshold, double scale, int64_t b0, int64_t h0,
                         int64_t heads) {
  if (!rng.has_value()) return;
  TORCH_CHECK(built, "this kernel module has no dropout (it needs sm_90 and "
              "head dim <= 128)");
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

inline void fill_common(FwdParams& p, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const OptT& mask, const OptT& bias, double scale,
                        bool causal, double softcap, bool paged = false, bool aux = true) {
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

// The gathered key lists of a call (see KeyGather in params.h): idx (Bm, Hm, nQ, >= Lk) int32,
// cnt (Bm, Hm, nQ) int32, bits (Bm, Hm, nQ * block_m, W) int64, gbias (Bg, Hg, nQ, width) in
// q's dtype or none; nQ = ceil(Lq / block_m) at the query tile of the kernel that walks them
// (the gathered forward's, which the gathered dQ kernel shares). Broadcast dims have size 1
// (or stride 0). Without bits (the dQ kernel only) the lists are a per-key mask's live keys,
// each row 16-byte aligned: every listed key is visible up to causality.
inline void fill_gather(FwdParams& p, int block_m, const at::Tensor& idx, const at::Tensor& cnt,
                        int64_t hdiv, const OptT& bits_, int64_t bits_hdiv, const OptT& gbias,
                        int64_t gbias_hdiv) {
  TORCH_CHECK(gbias.has_value() == bool(FLASH_DMATTN_HAS_BIAS), "this kernel module was built ",
              FLASH_DMATTN_HAS_BIAS ? "with" : "without", " a bias");
  const int64_t n_q = (p.Lq + block_m - 1) / block_m;
  TORCH_CHECK(idx.is_cuda() && idx.scalar_type() == at::kInt && idx.dim() == 4 &&
                  idx.stride(3) == 1 && idx.size(2) == n_q && idx.size(3) >= p.Lk,
              "gather idx must be int32 (B, H, ceil(Lq / block_m), >= Lk)");
  TORCH_CHECK(cnt.is_cuda() && cnt.scalar_type() == at::kInt && cnt.dim() == 3 &&
                  cnt.size(2) == n_q,
              "gather cnt must be int32 (B, H, ceil(Lq / block_m))");
  if (bits_.has_value()) {
    const at::Tensor& bits = *bits_;
    TORCH_CHECK(bits.is_cuda() && bits.scalar_type() == at::kLong && bits.dim() == 4 &&
                    bits.stride(3) == 1 && bits.size(2) >= n_q * block_m &&
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

// A call over key-interval masks (see KeyIntervalLists in params.h), forward or backward:
// q / k / v of a dense batch with no mask or bias of the other kinds, the interval bounds and
// the bias. bounds: contiguous int32 (2, B, R, Lk) with R = Hkv (or H when H == Hkv); a bias is
// per key (Bx, Hb, 1, Lk) in q's dtype; tile lists are the planner's (B * R, ceil(Lq /
// fwd_block_m)) int32. ``built``: whether the module has the key-interval kernels (its
// intervals()).
inline void fill_intervals(FwdParams& p, bool built, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const OptT& bias, const at::Tensor& bounds,
                           double scale, bool causal, double softcap) {
  fill_common(p, q, k, v, std::nullopt, std::nullopt, scale, causal, softcap, /*paged=*/false,
              /*aux=*/false);
  fill_packed(p, std::nullopt, std::nullopt, std::nullopt, 0, 0);
  TORCH_CHECK(built, "this kernel module has no key-interval kernels (they need a mask, dense "
              "batches, sm_90 and head dim <= 128)");
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

inline void check_list(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kInt && t.is_contiguous(), name,
              " must be a contiguous int32 CUDA tensor");
}

// Module definitions the bindings share. Module is pybind11::module_, a template parameter so
// that this header needs no pybind11 (the bindings include torch's).

// The docstring of an operation's module (op: forward, backward, decode).
template <class Module>
void def_module_doc(Module& m, const char* op) {
  m.doc() = std::string("flash_dmattn CUDA ") + op +
            " (one head-dim / dtype / mask / bias specialisation)";
}

// What the forward and the backward module say of their build: block_sizes() -> (block_m,
// block_n) of the operation's tiles, intervals() and dropout() -> whether its kernels have
// key-interval masks (the `op`_intervals function) and attention dropout (the drop_*
// arguments). op: fwd or bwd; tiles: how the docstring names the tiles.
template <class Module>
void def_build_queries(Module& m, const char* op, const char* tiles, int (*block_m)(),
                       int (*block_n)(), bool (*intervals)(), bool (*dropout)()) {
  m.def(
      "block_sizes",
      [block_m, block_n]() { return std::vector<int64_t>{block_m(), block_n()}; },
      (std::string("(block_m, block_n) of the ") + tiles + " tiles").c_str());
  m.def("intervals", intervals,
        (std::string("whether ") + op + "_intervals (key-interval masks) is built in").c_str());
  m.def("dropout", dropout, "whether this module's kernels take dropout (the drop_* arguments)");
}

}  // namespace flash_dmattn::binding
