// One-query attention of several rows in one call, each row over the first `extents[row]` keys
// of its own slot of a shared (slots, kv_heads, capacity, head_dim) cache.
//
// A lone decode step on CUDA attends its one query with MLX's vector kernels
// (mlx/backend/cuda/scaled_dot_product_attention.cu): one pass (kernel_sdpav_1pass) up to 1024
// keys, two passes beyond (kernel_sdpav_2pass_1 and _2). The kernels here perform the same float
// operations in the same order for each row: in one pass, 32 warps, warp w taking keys w, w + 32,
// ...; in two, 32 blocks of 8 warps taking keys 8 b + w, + 256, ..., whose partial outputs a
// second kernel combines; a running max and sum per warp in base 2 and the same cross-warp
// reductions. So each row gets the bits of its lone step, whatever rows surround it and however
// long their keys are. Each kernel leaves the rows of the other length alone; the combining
// kernel copies the one-pass rows' outputs through. The caller (src/model/layers/rows_kernel.rs)
// checks once per process that they match MLX's own call before trusting them. At head_dim 32,
// which MLX's vector kernels do not take, verity's own decode steps attend through these kernels
// alone as well (a lane holds one element of the query and of the output).
#pragma once

namespace verity_mlx {

inline constexpr const char* ROWS_ATTENTION_HEADER = R"cuda(
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>

// A lane's share of the query, times the scale in base 2, and its output zeroed.
template <typename T, int D, typename Warp>
__device__ void start_query(Warp& warp, const T* Q, float scale_log2, float* qr, float* o) {
  constexpr int PER_LANE = D / 32;
  const int lane = warp.thread_rank();
  for (int i = 0; i < PER_LANE; i++) {
    qr[i] = scale_log2 * static_cast<float>(Q[PER_LANE * lane + i]);
  }
  for (int i = 0; i < PER_LANE; i++) {
    o[i] = 0.f;
  }
}

// One warp's online softmax over keys first, first + stride, ... below extent (the loop of MLX's
// vector kernels): each lane holds D / 32 of the query (already times the scale in base 2) and
// of the output, and `max_score` and `sum_exp_score` carry the warp's running max and sum.
template <typename T, int D, typename Warp>
__device__ void attend_keys(Warp& warp, const T* K, const T* V, const float* qr, float* o,
                            float& max_score, float& sum_exp_score, int first, int extent,
                            int stride) {
  constexpr int PER_LANE = D / 32;
  const int lane = warp.thread_rank();
  float kr[PER_LANE];
  for (int i = first; i < extent; i += stride) {
    for (int j = 0; j < PER_LANE; j++) {
      kr[j] = K[PER_LANE * lane + j];
    }
    float score = 0.f;
    for (int j = 0; j < PER_LANE; j++) {
      score += qr[j] * kr[j];
    }
    score = cooperative_groups::reduce(warp, score, cooperative_groups::plus<float>());
    float new_max = max(max_score, score);
    float factor = exp2f(max_score - new_max);
    float exp_score = exp2f(score - new_max);
    max_score = new_max;
    sum_exp_score = sum_exp_score * factor + exp_score;
    for (int j = 0; j < PER_LANE; j++) {
      o[j] = o[j] * factor +
          exp_score * static_cast<float>(V[PER_LANE * lane + j]);
    }
    K += stride * D;
    V += stride * D;
  }
}

// The last step of MLX's one-pass kernel and of its two-pass combine, for a block of 32 warps:
// lane l brings warp (or first-pass block) l's running max and sum, each warp its output `o`;
// their weighted sum, normalized, is written to `out` (this row and head's D values).
template <typename T, int D, typename Block, typename Warp>
__device__ void combine_warps(Block& block, Warp& warp, float (*outputs)[33], float* o,
                              float max_score, float sum_exp_score, T* out) {
  constexpr int PER_LANE = D / 32;
  const int lane = warp.thread_rank();
  const int w = warp.meta_group_rank();
  float new_max = cooperative_groups::reduce(warp, max_score, cooperative_groups::greater<float>());
  float factor = exp2f(max_score - new_max);
  sum_exp_score =
      cooperative_groups::reduce(warp, sum_exp_score * factor, cooperative_groups::plus<float>());
  sum_exp_score = sum_exp_score == 0 ? 0 : __frcp_rn(sum_exp_score);
  for (int i = 0; i < PER_LANE; i++) {
    outputs[lane][w] = o[i];
    block.sync();
    float ot = outputs[w][lane] * factor;
    o[i] = cooperative_groups::reduce(warp, ot, cooperative_groups::plus<float>()) * sum_exp_score;
    block.sync();
  }
  if (lane == 0) {
    for (int i = 0; i < PER_LANE; i++) {
      out[PER_LANE * w + i] = static_cast<T>(o[i]);
    }
  }
}
)cuda";

// Rows of at most 1024 keys. Inputs q (rows, HQ, 1, D), k and v (slots, HKV, capacity, D),
// slots and extents (rows) int32, capacity () int32, scale_log2 () float32 (the scale times the
// double log2(e), rounded to float, as MLX's one-pass kernel computes it); output out.
inline constexpr const char* ROWS_ATTENTION_ONE_PASS = R"cuda(
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
  if (extent > 1024) {
    return;
  }
  const U scale = scale_log2[0];
  const T* Q = q + ((long)row * HQ + head) * D;
  const T* K = k + (kv_base + w) * D;
  const T* V = v + (kv_base + w) * D;
  U qr[PER_LANE];
  U o[PER_LANE];
  start_query<T, D>(warp, Q, scale, qr, o);
  U max_score = -3.40282346638528859812e+38F;
  U sum_exp_score = 0.f;
  attend_keys<T, D>(warp, K, V, qr, o, max_score, sum_exp_score, w, extent, WARPS);
  if (lane == 0) {
    max_scores[w] = max_score;
    sum_exp_scores[w] = sum_exp_score;
  }
  block.sync();
  combine_warps<T, D>(block, warp, outputs, o, max_scores[lane], sum_exp_scores[lane],
                      out + ((long)row * HQ + head) * D);
)cuda";

// Rows of more than 1024 keys, first pass: block b of a (row, head) takes keys 8 b + w, + 256,
// ... in its 8 warps. Inputs as above but scale_log2 (the scale times the float log2(e), as
// MLX's two-pass kernel computes it); outputs partials (rows, HQ, 32, D), sums and maxs
// (rows, HQ, 32), all float32.
inline constexpr const char* ROWS_ATTENTION_PARTIALS = R"cuda(
  namespace cg = cooperative_groups;
  constexpr int WARPS = 8;
  constexpr int LANES = 32;
  constexpr int BLOCKS = 32;
  constexpr int PER_LANE = D / LANES;
  typedef float U;
  __shared__ U outputs[WARPS][LANES + 1];
  __shared__ U max_scores[WARPS];
  __shared__ U sum_exp_scores[WARPS];
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int lane = warp.thread_rank();
  const int w = warp.meta_group_rank();
  const int row = blockIdx.z / BLOCKS;
  const int b = blockIdx.z % BLOCKS;
  const int head = blockIdx.x;
  const int extent = extents[row];
  if (extent <= 1024) {
    return;
  }
  const long kv_base = ((long)slots[row] * HKV + head / (HQ / HKV)) * (long)capacity[0];
  const U scale = scale_log2[0];
  const T* Q = q + ((long)row * HQ + head) * D;
  const T* K = k + (kv_base + b * WARPS + w) * D;
  const T* V = v + (kv_base + b * WARPS + w) * D;
  const long p = ((long)row * HQ + head) * BLOCKS + b;
  U qr[PER_LANE];
  U o[PER_LANE];
  start_query<T, D>(warp, Q, scale, qr, o);
  U max_score = -3.40282346638528859812e+38F;
  U sum_exp_score = 0.f;
  attend_keys<T, D>(warp, K, V, qr, o, max_score, sum_exp_score, b * WARPS + w, extent,
                    BLOCKS * WARPS);
  if (lane == 0) {
    max_scores[w] = max_score;
    sum_exp_scores[w] = sum_exp_score;
  }
  block.sync();
  max_score = (lane < WARPS) ? max_scores[lane] : -1e9f;
  U new_max = cg::reduce(warp, max_score, cg::greater<U>());
  U factor = exp2f(max_score - new_max);
  sum_exp_score = (lane < WARPS) ? sum_exp_scores[lane] : 0.f;
  sum_exp_score = cg::reduce(warp, sum_exp_score * factor, cg::plus<U>());
  if (w == 0) {
    sums[p] = sum_exp_score;
    maxs[p] = new_max;
  }
  U ff = exp2f(max_scores[w] - new_max);
  for (int i = 0; i < PER_LANE; i++) {
    outputs[w][lane] = o[i] * ff;
    block.sync();
    if (w == 0) {
      U ot = outputs[0][lane];
      for (int j = 1; j < WARPS; j++) {
        ot += outputs[j][lane];
        warp.sync();
      }
      o[i] = ot;
    }
    block.sync();
  }
  if (w == 0) {
    for (int i = 0; i < PER_LANE; i++) {
      partials[p * D + PER_LANE * lane + i] = o[i];
    }
  }
)cuda";

// Rows of more than 1024 keys, second pass: the 32 blocks' partial outputs combined; the other
// rows' one-pass outputs copied through. Inputs partials, sums, maxs, one_pass (rows, HQ, 1, D)
// and extents; output out.
inline constexpr const char* ROWS_ATTENTION_COMBINE = R"cuda(
  namespace cg = cooperative_groups;
  constexpr int WARPS = 32;
  constexpr int LANES = 32;
  constexpr int BLOCKS = 32;
  constexpr int PER_LANE = D / LANES;
  typedef float U;
  __shared__ U outputs[WARPS][LANES + 1];
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int lane = warp.thread_rank();
  const int w = warp.meta_group_rank();
  const int row = blockIdx.z;
  const int head = blockIdx.x;
  const long o_base = ((long)row * HQ + head) * D;
  if (extents[row] <= 1024) {
    const int t = w * LANES + lane;
    if (t < D) {
      out[o_base + t] = one_pass[o_base + t];
    }
    return;
  }
  const long p = ((long)row * HQ + head) * BLOCKS;
  U o[PER_LANE];
  for (int i = 0; i < PER_LANE; i++) {
    o[i] = partials[(p + w) * D + PER_LANE * lane + i];
  }
  combine_warps<T, D>(block, warp, outputs, o, maxs[p + lane], sums[p + lane], out + o_base);
)cuda";

}  // namespace verity_mlx
