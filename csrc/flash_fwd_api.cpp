// Torch binding of the forward of one kernel specialisation (head-dim bucket, dtype, mask /
// bias presence and packing are fixed at compile time, see flash_dmattn/backends/cuda/spec.py):
// an extension module of its own with flash_fwd.cu and flash_fwd_sm90*.cu (the backward and the
// decode kernels are modules of their own, flash_bwd_api.cpp and flash_decode_api.cpp). The
// Python backend (flash_dmattn/backends/cuda/kernels.py) validates inputs and builds the
// live-tile lists; these functions only check what would make a kernel read out of bounds.
//
//   fwd(q, k, v, mask, bias, out, softmax_scale, is_causal, softcap, tiles..., packed...)
//       -> [out, lse]
//   fwd_gathered(q, k, v, out, softmax_scale, is_causal, softcap, idx, cnt, hdiv, bits,
//                bits_hdiv, gbias, gbias_hdiv) -> [out, lse]   (gathered key lists; modules
//       with a mask, dense batches, sm_90 -- fwd_gathers() says whether this module has it)
//   fwd_intervals(q, k, v, out, bias, bounds, tile_start, tile_len, tile_full, keys,
//                 softmax_scale, is_causal, softcap) -> [out, lse]
//       (key-interval masks, see KeyIntervalLists in params.h; intervals() says whether this
//       module has them: a mask, dense batches, sm_90, head dim <= 128)
//   block_sizes() -> (block_m, block_n) of the forward's tiles
// fwd, fwd_gathered and fwd_intervals end with the attention dropout (binding.h: fill_dropout):
// drop_rng, drop_threshold, drop_scale, drop_b0, drop_h0, drop_heads; dropout() says whether
// this module's kernels have it (sm_90, dense batches, head dim <= 128).
// Packed sequences (cu_seqlens_q / cu_seqlens_k given): q / k / v are the packed
// (total, heads, D) tensors viewed as batch 1, a mask / bias is per key (1, Hm, 1, width)
// with sequence b's keys from cu_aux[b] (or cu_seqlens_k[b] without cu_aux), lse is
// (H, total_q).
// The Tensor class, the per-operator headers of the factories used here, c10's CUDA stream and
// guard and torch's pybind11 casters -- not torch/extension.h (the whole C++ frontend),
// ATen/ATen.h (every operator) or ATen/cuda/CUDAContext.h (cuBLAS, cuSPARSE and cuSOLVER
// headers): this file's compile time is on the path of a first-use build.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros_like.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#include "flash_dmattn/binding.h"

namespace flash_dmattn {
cudaError_t run_fwd(const FwdParams& p, cudaStream_t stream);
bool fwd_gathers();
bool fwd_intervals();
bool fwd_dropout();
int fwd_block_m();
int fwd_block_n();
}  // namespace flash_dmattn

namespace {

using namespace flash_dmattn::binding;
using flash_dmattn::FwdParams;

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
  fill_dropout(p, flash_dmattn::fwd_dropout(), q, drop_rng, drop_threshold, drop_scale, drop_b0,
               drop_h0, drop_heads);
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
  cudaError_t err = flash_dmattn::run_fwd(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flash_dmattn cuda fwd: ", cudaGetErrorString(err));
  return {out, lse};
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
  fill_gather(p, flash_dmattn::fwd_block_m(), idx, cnt, hdiv, bits, bits_hdiv, gbias,
              gbias_hdiv);
  fill_dropout(p, flash_dmattn::fwd_dropout(), q, drop_rng, drop_threshold, drop_scale, drop_b0,
               drop_h0, drop_heads);
  if (finished_without_keys(p, out, lse)) return {out, lse};
  cudaError_t err = flash_dmattn::run_fwd(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flash_dmattn cuda fwd_gathered: ", cudaGetErrorString(err));
  return {out, lse};
}

// Key-interval kernels: flash_fwd.cu says for which specs (see binding.h on arch macros).
bool intervals_built() { return flash_dmattn::fwd_intervals(); }

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
  fill_intervals(p, intervals_built(), q, k, v, bias, bounds, softmax_scale, is_causal, softcap);
  fill_dropout(p, flash_dmattn::fwd_dropout(), q, drop_rng, drop_threshold, drop_scale, drop_b0,
               drop_h0, drop_heads);
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
  cudaError_t err = flash_dmattn::run_fwd(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flash_dmattn cuda fwd_intervals: ", cudaGetErrorString(err));
  return {out, lse};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  def_module_doc(m, "forward");
  m.def("fwd", &fwd, "attention forward -> [out, lse]");
  m.def("fwd_gathered", &fwd_gathered, "attention forward over gathered key lists -> [out, lse]");
  m.def("fwd_gathers", &flash_dmattn::fwd_gathers, "whether fwd_gathered is built in");
  m.def("fwd_intervals", &fwd_intervals, "attention forward over key-interval lists -> [out, lse]");
  def_build_queries(m, "fwd", "forward's", &flash_dmattn::fwd_block_m, &flash_dmattn::fwd_block_n,
                    &intervals_built, &flash_dmattn::fwd_dropout);
}
