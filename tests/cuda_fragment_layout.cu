// Host program (tests/test_cuda_dropout_lanes.py builds and runs it; no GPU needed): checks
// that the sm_90 kernels' accumulator fragments place values where the dropout helpers of
// csrc/flash_dmattn/dropout.cuh assume -- thread t of a consumer warpgroup tile holds rows
// 16 (t / 32) + (t % 32) / 4 + 8 r and columns 8 g + 2 (t % 4) + e at value (e, r, g) -- for
// the forward's S tile (MmaQK, both consumer warpgroups) and the backward's S / S^T tiles
// (MmaScores, one warpgroup). Exit status 0 iff every value matches.
#include "flash_dmattn/params.h"
#include "flash_dmattn/fwd_sm90_config.cuh"
#include "flash_dmattn/bwd_sm90_config.cuh"

#include <cstdio>

using namespace flash_dmattn;
using namespace cute;

template <class Mma, int M, int N, bool kNested>
int check(const char* name, int n_threads) {
  Mma mma;
  int bad = 0;
  for (int tid = 0; tid < n_threads; ++tid) {
    auto thr = mma.get_thread_slice(tid);
    Tensor cS = thr.partition_C(make_identity_tensor(Shape<Int<M>, Int<N>>{}));
    constexpr int kGroups = decltype(size<0, 2>(cS))::value;
    if (int(size(cS)) != 4 * kGroups || 8 * kGroups != N) {
      printf("%s: %d values a thread, %d column blocks\n", name, int(size(cS)), kGroups);
      return 1;
    }
    const int lane = tid % 32, warp = tid / 32;
    for (int r = 0; r < 2; ++r) {
      for (int g = 0; g < kGroups; ++g) {
        for (int e = 0; e < 2; ++e) {
          int row, col;
          if constexpr (kNested) {
            row = get<0>(cS(make_coord(make_coord(e, r, g), 0, 0)));
            col = get<1>(cS(make_coord(make_coord(e, r, g), 0, 0)));
          } else {
            row = get<0>(cS(make_coord(e, r, g), 0, 0));
            col = get<1>(cS(make_coord(e, r, g), 0, 0));
          }
          const int want_row = 16 * warp + lane / 4 + 8 * r;
          const int want_col = 8 * g + 2 * (lane % 4) + e;
          if (row != want_row || col != want_col) {
            if (bad < 5) {
              printf("%s thread %d value (%d, %d, %d): (%d, %d), assumed (%d, %d)\n", name, tid,
                     e, r, g, row, col, want_row, want_col);
            }
            ++bad;
          }
        }
      }
    }
  }
  printf("%s: %d threads %s\n", name, n_threads, bad ? "MISMATCH" : "ok");
  return bad;
}

int main() {
  using F = Sm90FwdConfig<kHeadDimBucket>;
  using B = Sm90BwdConfig<kHeadDimBucket>;
  int bad = check<typename F::MmaQK, F::kBlockM, F::kBlockN, false>("forward S", F::kConsumerThreads);
  bad += check<typename B::MmaScores, 64, 64, true>("backward S / S^T", 128);
  return bad != 0;
}
