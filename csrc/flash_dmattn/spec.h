// The module's compile-time specialisation as plain C++ constants (no CuTe): the head-dim
// bucket, whether it reads a mask and a bias, whether its calls are packed, and the element
// size. spec.cuh adds the element type and CuTe; host code that only needs the constants (the
// Hopper forward's dispatcher and launchers: fwd_sm90_launch.h) includes this header alone.
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace flash_dmattn {

constexpr int kHeadDimBucket = FLASH_DMATTN_HEADDIM;
constexpr bool kHasMask = FLASH_DMATTN_HAS_MASK;
constexpr bool kHasBias = FLASH_DMATTN_HAS_BIAS;
constexpr bool kPacked = FLASH_DMATTN_PACKED;
// Bytes of an element of q / k / v / out (and of a bias): bf16 or fp16.
constexpr int kElemBytes = 2;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

}  // namespace flash_dmattn
