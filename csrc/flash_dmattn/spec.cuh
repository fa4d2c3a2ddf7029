// What a compiled module is specialised on, as compile-time constants: the head-dim bucket, the
// element type, whether it reads a mask and a bias, and whether its calls are packed (varlen).
// The build passes them as FLASH_DMATTN_* macros (backends/cuda/spec.py: KernelSpec); params.h
// has their defaults for editors and stand-alone compiles.
#pragma once

#include <climits>
#include <cuda_runtime.h>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>
#include <cutlass/numeric_conversion.h>

#include "params.h"

namespace flash_dmattn {

using namespace cute;

constexpr int kHeadDimBucket = FLASH_DMATTN_HEADDIM;
constexpr bool kHasMask = FLASH_DMATTN_HAS_MASK;
constexpr bool kHasBias = FLASH_DMATTN_HAS_BIAS;
constexpr bool kPacked = FLASH_DMATTN_PACKED;
#if FLASH_DMATTN_IS_BF16
using Elem = cutlass::bfloat16_t;
#else
using Elem = cutlass::half_t;
#endif

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

}  // namespace flash_dmattn
