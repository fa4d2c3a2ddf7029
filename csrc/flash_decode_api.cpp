// Torch binding of the split-KV decode of one kernel specialisation (see flash_fwd_api.cpp):
// an extension module of its own with flash_decode.cu, so that a decode-only caller compiles
// neither the forward nor the backward kernels.
//
//   decode(q, k, v, mask, bias, cache_seqlens, block_table, softmax_scale, is_causal, softcap,
//          num_splits, poison) -> [out, lse]      (split-KV, forward only; k / v may be pools)
//   decode_sizes() -> (decode_max_rows, decode_block_n)
// The Tensor class, the per-operator headers of the factories used here, c10's CUDA stream and
// guard and torch's pybind11 casters -- not torch/extension.h (the whole C++ frontend),
// ATen/ATen.h (every operator) or ATen/cuda/CUDAContext.h (cuBLAS, cuSPARSE and cuSOLVER
// headers): this file's compile time is on the path of a first-use build.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#include "flash_dmattn/binding.h"

namespace flash_dmattn {
cudaError_t run_decode(const DecodeParams& p, cudaStream_t stream);
int decode_max_rows();
bool decode_warp_split(int rows);
int decode_block_n();
}  // namespace flash_dmattn

namespace {

using namespace flash_dmattn::binding;
using flash_dmattn::DecodeParams;

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
  cudaError_t err = flash_dmattn::run_decode(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flash_dmattn cuda decode: ", cudaGetErrorString(err));
  return {out, lse};
}

std::vector<int64_t> decode_sizes() {
  return {flash_dmattn::decode_max_rows(), flash_dmattn::decode_block_n()};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  def_module_doc(m, "decode");
  m.def("decode", &decode, "split-KV decode forward (KV cache, paged or not) -> [out, lse]");
  m.def("decode_sizes", &decode_sizes, "(decode_max_rows, decode_block_n)");
}
