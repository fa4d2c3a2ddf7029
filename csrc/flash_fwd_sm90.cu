// Hopper forward (sm_90a): picks the kernel of a call -- its walk (key tiles, gathered key
// lists or key intervals), soft cap and dropout -- and launches it.
//
// The kernel and its design are flash_dmattn/fwd_sm90_kernel.cuh, its configuration
// flash_dmattn/fwd_sm90_config.cuh over flash_dmattn/fwd_sm90_launch.h. Its instances are
// compiled by flash_fwd_sm90_{dense,gather,intervals}[_dropout][_softcap].cu, one kernel each,
// so that a build compiles them in parallel rather than all in one translation unit; this file
// sees only the launcher's declaration and the kernel's shape (fwd_sm90_launch.h: no CuTe).
//
// Built only when the module targets sm_90a (the JIT passes -DFLASH_DMATTN_SM90=1 there).
#include "flash_dmattn/params.h"

#if FLASH_DMATTN_SM90

#include "flash_dmattn/fwd_sm90_launch.h"

namespace flash_dmattn {

// The kernels of one walk: with dropout where the call draws a mask (only modules built with
// dropout have those), each with and without a soft cap.
template <bool kGather, bool kIntervals>
static cudaError_t launch_walk_sm90(const FwdParams& p, cudaStream_t stream) {
  if constexpr (FLASH_DMATTN_DROPOUT) {
    if (p.drop.rng != nullptr) {
      return p.softcap > 0.f ? launch_fwd_sm90<true, kGather, kIntervals, true>(p, stream)
                             : launch_fwd_sm90<false, kGather, kIntervals, true>(p, stream);
    }
  }
  return p.softcap > 0.f ? launch_fwd_sm90<true, kGather, kIntervals, false>(p, stream)
                         : launch_fwd_sm90<false, kGather, kIntervals, false>(p, stream);
}

cudaError_t run_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  // The list walks: dense-batch modules with a mask (kHasMask && !kPacked), the macro that also
  // guards their sources.
  if constexpr (FLASH_DMATTN_FWD_GATHER) {
    if (p.intervals) return launch_walk_sm90<true, true>(p, stream);
    if (p.gather) return launch_walk_sm90<true, false>(p, stream);
  }
  return launch_walk_sm90<false, false>(p, stream);
}

int fwd_sm90_block_m() { return Sm90FwdShape<kHeadDimBucket>::kBlockM; }
int fwd_sm90_block_n() { return Sm90FwdShape<kHeadDimBucket>::kBlockN; }

}  // namespace flash_dmattn

#endif  // FLASH_DMATTN_SM90
