// Torch binding of the backward of one kernel specialisation (see flash_fwd_api.cpp): an
// extension module of its own with flash_bwd.cu, flash_bwd_sm90.cu and
// flash_dq_gathered_sm90.cu. It takes the forward's outputs (out, lse) and, for a gathered dQ,
// the forward's gathered key lists, but compiles no forward kernel.
//
//   bwd(dout, q, k, v, mask, bias, out, lse, softmax_scale, is_causal, softcap, ..., packed...,
//       gathered lists..., key_bits, key_bits_hdiv) -> [dq, dk, dv, dbias]   (gathered lists:
//       the forward's, for a dQ kernel over them -- bwd_gathers() says whether this module has
//       it; key bits: a per-query mask's, from the mask summary -- bwd_key_bits())
//   bwd_intervals(dout, q, k, v, bias, out, lse, bounds, blk_keys, blk_qlo, blk_qhi,
//                 blocks_per_row, segment_rows, softmax_scale, is_causal, softcap, need_dq,
//                 need_dkv, need_dbias) -> [dq, dk fp32, dv fp32, dbias (B, H, Lk) fp32]
//       (key-interval masks, see KeyIntervalLists in params.h; intervals() says whether this
//       module has them: a mask, dense batches, sm_90, head dim <= 128)
//   fused_dq() -> whether bwd(..., allow_fused_dq=True) computes dQ in the dK/dV kernel
// bwd and bwd_intervals end with the attention dropout (binding.h: fill_dropout): drop_rng,
// drop_threshold, drop_scale, drop_b0, drop_h0, drop_heads; dropout() says whether this module's
// kernels have it (sm_90, dense batches, head dim <= 128; the gathered dQ kernel has none).
//   block_sizes() -> (block_m, block_n) of the backward's tiles
// Packed sequences (cu_seqlens_q / cu_seqlens_k given): as in the forward; lse is
// (H, total_q) and per-key dbias partials (H, total_k).
// The Tensor class, the per-operator headers of the factories used here, c10's CUDA stream and
// guard and torch's pybind11 casters -- not torch/extension.h (the whole C++ frontend),
// ATen/ATen.h (every operator) or ATen/cuda/CUDAContext.h (cuBLAS, cuSPARSE and cuSOLVER
// headers): this file's compile time is on the path of a first-use build.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#include "flash_dmattn/binding.h"

namespace flash_dmattn {
cudaError_t run_bwd(const BwdParams& p, cudaStream_t stream);
int bwd_block_m();
int bwd_block_n();
bool bwd_fused_dq();
bool bwd_gathers();
bool bwd_key_bits();
bool bwd_dropout();
int bwd_gather_block_m();
}  // namespace flash_dmattn

namespace {

using namespace flash_dmattn::binding;
using flash_dmattn::BwdParams;

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

// Key-interval kernels: the gathered dQ kernel's specs (a mask, dense batches, the wgmma
// backward), whose forward has them too.
bool intervals_built() { return flash_dmattn::bwd_gathers(); }

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
  fill_intervals(p, intervals_built(), q, k, v, bias, bounds, softmax_scale, is_causal, softcap);
  TORCH_CHECK(p.iv.row_heads == p.Hkv, "key-interval bounds of the backward must be per kv head");
  fill_dropout(p, flash_dmattn::bwd_dropout(), q, drop_rng, drop_threshold, drop_scale, drop_b0,
               drop_h0, drop_heads);
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
  cudaError_t err = flash_dmattn::run_bwd(p, c10::cuda::getCurrentCUDAStream());
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
  fill_dropout(p, flash_dmattn::bwd_dropout(), q, drop_rng, drop_threshold, drop_scale, drop_b0,
               drop_h0, drop_heads);
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
    fill_gather(p, flash_dmattn::bwd_gather_block_m(), *gather_idx, *gather_cnt, gather_hdiv,
                gather_bits, gather_bits_hdiv, gather_bias, gather_bias_hdiv);
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
  cudaError_t err = flash_dmattn::run_bwd(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flash_dmattn cuda bwd: ", cudaGetErrorString(err));
  return {dq, dk, dv, dbias};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  def_module_doc(m, "backward");
  m.def("bwd", &bwd, "attention backward -> [dq, dk, dv, dbias]");
  m.def("bwd_gathers", &flash_dmattn::bwd_gathers,
        "whether bwd takes gathered key lists (a gathered dQ kernel is built in)");
  m.def("bwd_key_bits", &flash_dmattn::bwd_key_bits,
        "whether bwd reads a per-query mask's key bits (the mask summary's, bwd(..., key_bits))");
  m.def("bwd_intervals", &bwd_intervals,
        "attention backward over key-interval key blocks -> [dq, dk fp32, dv fp32, dbias fp32]");
  m.def("fused_dq", &flash_dmattn::bwd_fused_dq,
        "whether bwd(..., allow_fused_dq=True) computes dQ inside the dK/dV kernel (atomics)");
  def_build_queries(m, "bwd", "backward's", &flash_dmattn::bwd_block_m, &flash_dmattn::bwd_block_n,
                    &intervals_built, &flash_dmattn::bwd_dropout);
}
