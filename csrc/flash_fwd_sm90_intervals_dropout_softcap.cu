// Hopper forward kernel: the key-interval lists with dropout, with a soft cap. The instance of
// launch_fwd_sm90 (flash_dmattn/fwd_sm90_kernel.cuh) that run_fwd_sm90 (flash_fwd_sm90.cu) calls
// for it; each kernel has a source of its own, so that a build compiles the forward's kernels in
// parallel.
//
// Compiled only into the modules that have this kernel (the guard's macros: params.h), read
// before anything else is included so that other modules compile this file to nothing.
#include "flash_dmattn/params.h"

#if FLASH_DMATTN_FWD_GATHER && FLASH_DMATTN_DROPOUT

#include "flash_dmattn/fwd_sm90_kernel.cuh"

namespace flash_dmattn {

template cudaError_t launch_fwd_sm90<true, true, true, true>(const FwdParams&, cudaStream_t);

}  // namespace flash_dmattn

#endif  // FLASH_DMATTN_FWD_GATHER && FLASH_DMATTN_DROPOUT
