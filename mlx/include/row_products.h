// Products of several rows by one packed weight in one call, each row with the float
// operations of the kernel MLX runs for a lone row, in their order, every weight row loaded once
// for ROWS rows.
//
// A lone decode step on CUDA multiplies its one row by an affine-quantized weight with MLX's
// qmv (mlx/backend/cuda/quantized/qmm/qmv.cu): one warp per output, each lane accumulating its
// own tiles of K in a fixed order, then one warp reduction. The form that gives a batch's rows
// those bits through MLX's own calls (gather_qmm over 7 rows at a time) reads the whole weight
// once per row. Here each warp loads its output's weight tile once and feeds it to ROWS rows'
// sums, each sum taking its operations in qmv's order, so each row gets its lone step's bits
// while the weight is read once per ROWS rows. The caller (src/model/row_products.rs) checks
// once per process and shape that this matches MLX's own call before trusting it. The row
// count, K and N come from the operands' shapes (launch parameters): a scalar input made on the
// host would live in managed memory, which the GPU reads across the bus at every call.
#pragma once

namespace verity_mlx {

// Warp w of block (b, y) computes output 8 b + w for rows ROWS y to ROWS y + ROWS - 1 (as many
// as there are); its weight tiles are loaded AHEAD at a time, and a tile's slices of all its
// rows before any product, so that their loads are in flight together (templates ROWS, AHEAD).
//
// qmv's arithmetic for affine-quantized weights (template T, BITS 4 or 8, GROUP): a lane takes
// tiles of E consecutive elements (16 where T is 16 bits wide and BITS is 4, else 8), E apart
// per lane and 32 E apart per step, then one tile of the remainder; a tile's weight is
// dequantized in T (w * scale + bias, as cutlass's array operators compute it), and each of its
// E products is a fused multiply-add into its own accumulator, in T where BITS < 8, else in
// float; the E accumulators are then summed in float and reduced across the warp.
inline constexpr const char* ROWS_QMV = R"cuda(
  auto warp = cg::tiled_partition<32>(cg::this_thread_block());
  const int lane = warp.thread_rank();
  const int n = blockIdx.x * 8 + warp.meta_group_rank();
  const int k = x_shape[1];
  const int n_out = w_shape[0];
  if (n >= n_out) {
    return;
  }
  const int first = blockIdx.y * ROWS;
  const int count = min(ROWS, x_shape[0] - first);
  using CT = typename verity_rows::Cutlass<T>::type;
  using Q = typename verity_rows::Packed<BITS>::type;
  constexpr int E = (sizeof(T) <= 2 && BITS <= 4) ? 16 : 8;
  constexpr int STEP = 32 * E;
  using Acc = cuda::std::conditional_t<(BITS >= 8), float, CT>;
  const int groups = k / GROUP;
  const uint8_t* w_row = reinterpret_cast<const uint8_t*>(w) + (long)n * (k * BITS / 8);
  const CT* scale_row = reinterpret_cast<const CT*>(scales) + (long)n * groups;
  const CT* bias_row = reinterpret_cast<const CT*>(biases) + (long)n * groups;
  const CT* xs = reinterpret_cast<const CT*>(x) + (long)first * k;
  CT* outs = reinterpret_cast<CT*>(out);
  Acc sums[ROWS][E] = {};
  // A lane's tiles: every STEP from lane E while a whole step fits, then the remainder's.
  const int whole = k - k % STEP;
  auto tile_at = [&](int t) { return lane * E + (t * STEP < whole ? t * STEP : whole); };
  const int tiles = whole / STEP + (k % STEP != 0 && lane * E + whole < k ? 1 : 0);
  for (int t0 = 0; t0 < tiles; t0 += AHEAD) {
    cutlass::Array<Q, E> packed[AHEAD];
    CT scale[AHEAD], bias[AHEAD];
#pragma unroll
    for (int a = 0; a < AHEAD; a++) {
      if (t0 + a < tiles) {
        const int idx = tile_at(t0 + a);
        packed[a] = *reinterpret_cast<const cutlass::Array<Q, E>*>(w_row + idx * BITS / 8);
        scale[a] = scale_row[idx / GROUP];
        bias[a] = bias_row[idx / GROUP];
      }
    }
#pragma unroll
    for (int a = 0; a < AHEAD; a++) {
      if (t0 + a < tiles) {
        const int idx = tile_at(t0 + a);
        cutlass::Array<CT, E> xv[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
          if (r < count) {
            xv[r] = *reinterpret_cast<const cutlass::Array<CT, E>*>(xs + (long)r * k + idx);
          }
        }
        auto w_dq = verity_rows::dequantize(packed[a], scale[a], bias[a]);
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
          if (r < count) {
            verity_rows::multiply_add(xv[r], w_dq, sums[r]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; r++) {
    if (r < count) {
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < E; i++) {
        sum += sums[r][i];
      }
      sum = cg::reduce(warp, sum, cg::plus<float>());
      if (lane == 0) {
        outs[(long)(first + r) * n_out + n] = static_cast<CT>(sum);
      }
    }
  }
)cuda";

// MLX's own kernels include cutlass before the CUDA standard library; here the custom kernel's
// prelude has already included the latter, whose FP_* classification macros would break the
// enum cutlass declares under those names (and defines them again to the same values).
inline constexpr const char* ROWS_QMV_HEADER = R"cuda(
#include <cooperative_groups/reduce.h>
#undef FP_NAN
#undef FP_INFINITE
#undef FP_ZERO
#undef FP_SUBNORMAL
#undef FP_NORMAL
#include "mlx/backend/cuda/device/cute_dequant.cuh"

namespace verity_rows {

// The cutlass element type qmv computes in for MLX's CUDA element type.
template <typename T> struct Cutlass { using type = T; };
template <> struct Cutlass<__nv_bfloat16> { using type = cutlass::bfloat16_t; };
template <> struct Cutlass<__half> { using type = cutlass::half_t; };

// The packed element type of a BITS-wide affine quantization.
template <int BITS> struct Packed;
template <> struct Packed<4> { using type = cutlass::uint4b_t; };
template <> struct Packed<8> { using type = uint8_t; };

// One tile of N packed weights, dequantized in T as qmv does it.
template <int N, typename T, typename Q>
__device__ __forceinline__ cutlass::Array<T, N> dequantize(const cutlass::Array<Q, N>& packed,
                                                           T scale, T bias) {
  cutlass::NumericArrayConverter<T, Q, N> convert;
  cutlass::Array<T, N> w_dq = convert(packed);
  if constexpr (cuda::std::is_same_v<T, float>) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      w_dq[i] = w_dq[i] * T(scale) + bias;
    }
  } else {
    w_dq = w_dq * T(scale) + bias;
  }
  return w_dq;
}

// One row's N products with a dequantized tile, fused into its accumulators as qmv does it:
// in T, or in float after widening both operands.
template <int N, typename T, typename Acc>
__device__ __forceinline__ void multiply_add(const cutlass::Array<T, N>& x_vec,
                                             const cutlass::Array<T, N>& w_dq, Acc* sums) {
  auto* acc = reinterpret_cast<cutlass::Array<Acc, N>*>(sums);
  if constexpr (cuda::std::is_same_v<Acc, T>) {
    *acc = cutlass::fma(x_vec, w_dq, *acc);
  } else {
    cutlass::NumericArrayConverter<float, T, N> widen;
    *acc = cutlass::fma(widen(x_vec), widen(w_dq), *acc);
  }
}

}  // namespace verity_rows
)cuda";

}  // namespace verity_mlx
