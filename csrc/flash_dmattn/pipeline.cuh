// Producer / consumer stages of the warp-specialised Hopper kernels (sm_90a): a producer
// warpgroup fills a shared-memory stage with cp.async copies and signals its "full" mbarrier;
// consumer warps signal its "empty" mbarrier once they stopped reading it.
#pragma once
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

namespace flash_dmattn {

using cutlass::arch::ClusterBarrier;

// Producer side of a stage: arrive on `bar` once this thread's cp.async copies issued so far
// have landed (the async arrive) and its plain shared-memory stores are visible (the arrive
// releases them); the phase completes when all producer threads did both.
__device__ __forceinline__ void stage_filled(uint64_t* bar) {
  cutlass::arch::cpasync_barrier_arrive(bar);
  ClusterBarrier::arrive(bar);
}

// Consumer side: this warp is done reading the stage (warpgroup MMAs reading it waited for).
__device__ __forceinline__ void stage_released(uint64_t* bar) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) ClusterBarrier::arrive(bar);
}

}  // namespace flash_dmattn
