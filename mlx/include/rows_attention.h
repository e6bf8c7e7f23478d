// One-query attention of several rows in one kernel, each row over the first `extents[row]`
// keys of its own slot of a shared (slots, kv_heads, capacity, head_dim) cache.
//
// A lone decode step on CUDA attends its one query with MLX's one-pass vector kernel
// (mlx/backend/cuda/scaled_dot_product_attention.cu, kernel_sdpav_1pass, for key lengths up to
// 1024). This kernel performs the same float operations in the same order for each row: 32
// warps, warp w taking keys w, w + 32, ...; a running max and sum per warp in base 2; the same
// cross-warp reductions; so each row gets the bits of its lone step, whatever rows surround it
// and however long their keys are. Rows past 1024 keys take MLX's two-pass kernel alone, and
// the caller sends them there.
#pragma once

namespace verity_mlx {

inline constexpr const char* ROWS_ATTENTION_HEADER = R"cuda(
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
)cuda";

inline constexpr const char* ROWS_ATTENTION_SOURCE = R"cuda(
  namespace cg = cooperative_groups;
  constexpr int WARPS = 32;
  constexpr int LANES = 32;
  constexpr int PER_LANE = D / LANES;
  typedef float U;
  __shared__ U outputs[WARPS][LANES + 1];
  __shared__ U max_scores[WARPS];
  __shared__ U sum_exp_scores[WARPS];
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int lane = warp.thread_rank();
  const int w = warp.meta_group_rank();
  const int row = blockIdx.z;
  const int head = blockIdx.x;
  const long kv_base = ((long)slots[row] * HKV + head / (HQ / HKV)) * (long)capacity[0];
  const int extent = extents[row];
  const U scale = scale_log2[0];
  const T* Q = q + ((long)row * HQ + head) * D;
  const T* K = k + (kv_base + w) * D;
  const T* V = v + (kv_base + w) * D;
  U qr[PER_LANE];
  U kr[PER_LANE];
  U o[PER_LANE];
  for (int i = 0; i < PER_LANE; i++) {
    qr[i] = scale * static_cast<U>(Q[PER_LANE * lane + i]);
  }
  for (int i = 0; i < PER_LANE; i++) {
    o[i] = 0.f;
  }
  U max_score = -3.40282346638528859812e+38F;
  U sum_exp_score = 0.f;
  for (int i = w; i < extent; i += WARPS) {
    for (int j = 0; j < PER_LANE; j++) {
      kr[j] = K[PER_LANE * lane + j];
    }
    U score = 0.f;
    for (int j = 0; j < PER_LANE; j++) {
      score += qr[j] * kr[j];
    }
    score = cg::reduce(warp, score, cg::plus<U>());
    U new_max = max(max_score, score);
    U factor = exp2f(max_score - new_max);
    U exp_score = exp2f(score - new_max);
    max_score = new_max;
    sum_exp_score = sum_exp_score * factor + exp_score;
    for (int j = 0; j < PER_LANE; j++) {
      o[j] = o[j] * factor +
          exp_score * static_cast<U>(V[PER_LANE * lane + j]);
    }
    K += WARPS * D;
    V += WARPS * D;
  }
  if (lane == 0) {
    max_scores[w] = max_score;
    sum_exp_scores[w] = sum_exp_score;
  }
  block.sync();
  max_score = max_scores[lane];
  U new_max = cg::reduce(warp, max_score, cg::greater<U>());
  U factor = exp2f(max_score - new_max);
  sum_exp_score = cg::reduce(warp, sum_exp_scores[lane] * factor, cg::plus<U>());
  sum_exp_score = sum_exp_score == 0 ? 0 : __frcp_rn(sum_exp_score);
  for (int i = 0; i < PER_LANE; i++) {
    outputs[lane][w] = o[i];
    block.sync();
    U ot = outputs[w][lane] * factor;
    o[i] = cg::reduce(warp, ot, cg::plus<U>()) * sum_exp_score;
    block.sync();
  }
  if (lane == 0) {
    for (int i = 0; i < PER_LANE; i++) {
      out[(long)row * HQ * D + (long)head * D + PER_LANE * w + i] = static_cast<T>(o[i]);
    }
  }
)cuda";

}  // namespace verity_mlx
