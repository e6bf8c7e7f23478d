// A dense product of several rows by one weight, each row with the float operations of MLX's
// gemv in their order, every weight row loaded once for all of them.
//
// A lone decode step on CUDA multiplies its one row by a transposed weight with MLX's gemv
// (mlx/backend/cuda/gemms/gemv.cu): one warp per output, lane l summing the products of
// elements NPT l + j, + 32 NPT, ... in float (NPT = 4 where K % 128 == 0, 2 where K % 64 == 0,
// else 1, for aligned operands), then one warp reduction. The batched gemv that computes a
// batch's rows that way reads the whole weight once per row. Here each warp holds its output's
// weight chunk and feeds it to up to 8 rows' sums at once, each sum taking its products in
// gemv's order, so each row gets its lone step's bits while the weight is read once per 8 rows
// from the cache. The caller (src/model/rows_gemv.rs) checks once per process and shape that
// this matches MLX's own call before trusting it.
#pragma once

namespace verity_mlx {

inline constexpr const char* ROWS_GEMV = R"cuda(
  namespace cg = cooperative_groups;
  constexpr int LANES = 32;
  constexpr int ROWS_AT_ONCE = 8;
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<LANES>(block);
  const int lane = warp.thread_rank();
  const int n = blockIdx.x * 8 + warp.meta_group_rank();
  if (n >= N) {
    return;
  }
  const int rows = n_rows[0];
  const T* mat = w + (long)n * K;
  for (int first = 0; first < rows; first += ROWS_AT_ONCE) {
    const int count = min(ROWS_AT_ONCE, rows - first);
    float sums[ROWS_AT_ONCE];
    for (int r = 0; r < ROWS_AT_ONCE; r++) {
      sums[r] = 0.f;
    }
    for (int col = NPT * lane; col < K; col += LANES * NPT) {
      T m[NPT];
      for (int j = 0; j < NPT; j++) {
        m[j] = mat[col + j];
      }
      for (int r = 0; r < ROWS_AT_ONCE; r++) {
        if (r < count) {
          const T* v = x + (long)(first + r) * K + col;
          for (int j = 0; j < NPT; j++) {
            sums[r] += static_cast<float>(m[j]) * static_cast<float>(v[j]);
          }
        }
      }
    }
    for (int r = 0; r < ROWS_AT_ONCE; r++) {
      if (r < count) {
        float sum = cg::reduce(warp, sums[r], cg::plus<float>());
        if (lane == 0) {
          out[(long)(first + r) * N + n] = static_cast<T>(sum);
        }
      }
    }
  }
)cuda";

inline constexpr const char* ROWS_GEMV_HEADER = R"cuda(
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
)cuda";

}  // namespace verity_mlx
