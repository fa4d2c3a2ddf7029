// What a compiled module is specialised on, as compile-time constants: the head-dim bucket, the
// element type, whether it reads a mask and a bias, and whether its calls are packed (varlen).
// The build passes them as FLASH_DMATTN_* macros (backends/cuda/spec.py: KernelSpec); params.h
// has their defaults for editors and stand-alone compiles. The constants without CuTe are spec.h;
// this header adds the element type and CuTe.
#pragma once

#include <climits>

#include "spec.h"

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>
#include <cutlass/numeric_conversion.h>

namespace flash_dmattn {

using namespace cute;

#if FLASH_DMATTN_IS_BF16
using Elem = cutlass::bfloat16_t;
#else
using Elem = cutlass::half_t;
#endif
static_assert(sizeof(Elem) == kElemBytes, "spec.h's element size");

}  // namespace flash_dmattn
