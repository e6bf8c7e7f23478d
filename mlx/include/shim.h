// The C++ side of the verity MLX binding: thin wrappers that adapt mlx::core's API to what cxx
// can pass (slices, enums, raw pointers for optional arrays). No logic lives here beyond that,
// except the compiled kernels, which mirror functions mlx-lm wraps in mx.compile.
#pragma once

#include <memory>
#include <vector>

#include "mlx/mlx.h"
#include "rust/cxx.h"

namespace verity_mlx {

struct Array {
  mlx::core::array inner;
};

struct ArrayList {
  std::vector<mlx::core::array> items;
};

enum class UnaryOp : uint8_t;
enum class BinaryOp : uint8_t;
enum class ReduceOp : uint8_t;
enum class Kernel : uint8_t;

using ArrayPtr = std::unique_ptr<Array>;
using ListPtr = std::unique_ptr<ArrayList>;
using I32s = rust::Slice<const int32_t>;

ListPtr list_new();
void list_push(ArrayList& list, const Array& a);
size_t list_len(const ArrayList& list);
ArrayPtr list_get(const ArrayList& list, size_t i);

ArrayPtr from_bytes(rust::Slice<const uint8_t> data, I32s shape, uint8_t dtype);
ArrayPtr scalar_float(float value, uint8_t dtype);
ArrayPtr scalar_int(int64_t value, uint8_t dtype);
ArrayPtr full(I32s shape, const Array& value, uint8_t dtype);
ArrayPtr zeros(I32s shape, uint8_t dtype);
ArrayPtr arange(double start, double stop, double step, uint8_t dtype);
ArrayPtr clone_array(const Array& a);
rust::Vec<int32_t> shape(const Array& a);
uint8_t dtype(const Array& a);
rust::Vec<uint8_t> to_bytes(const Array& a);
rust::String describe(const Array& a);

void eval(const ArrayList& list);
void async_eval(const ArrayList& list);
size_t peak_memory();
void reset_peak_memory();
void clear_cache();
rust::String version();
void use_cpu();
void use_gpu();
bool default_is_cpu();
bool gpu_available();
bool cuda_available();
bool metal_available();

ArrayPtr unary(UnaryOp op, const Array& a);
ArrayPtr binary(BinaryOp op, const Array& a, const Array& b);
ArrayPtr reduce(ReduceOp op, const Array& a, I32s axes, bool keepdims);
ArrayPtr argmax(const Array& a, int32_t axis, bool keepdims);
ArrayPtr argmin(const Array& a, int32_t axis, bool keepdims);
ArrayPtr where_(const Array& cond, const Array& x, const Array& y);
ArrayPtr clip(const Array& a, const Array* lo, const Array* hi);
ArrayPtr astype(const Array& a, uint8_t dtype);
ArrayPtr softmax(const Array& a, I32s axes, bool precise);
ArrayPtr cumsum(const Array& a, int32_t axis, bool reverse, bool inclusive);
ArrayPtr addmm(const Array& c, const Array& a, const Array& b, float alpha, float beta);

ArrayPtr reshape(const Array& a, I32s shape);
ArrayPtr transpose(const Array& a, I32s axes);
ArrayPtr expand_dims(const Array& a, I32s axes);
ArrayPtr squeeze(const Array& a, I32s axes);
ArrayPtr broadcast_to(const Array& a, I32s shape);
ArrayPtr flatten(const Array& a, int32_t start, int32_t end);
ArrayPtr moveaxis(const Array& a, int32_t source, int32_t destination);
ArrayPtr slice(const Array& a, I32s start, I32s stop, I32s strides);
ArrayPtr slice_update(const Array& src, const Array& update, I32s start, I32s stop, I32s strides);
ArrayPtr concatenate(const ArrayList& list, int32_t axis);
ArrayPtr depends(const Array& input, const Array& dependency);
ArrayPtr stack(const ArrayList& list, int32_t axis);
ListPtr split_sections(const Array& a, I32s indices, int32_t axis);
ListPtr split_equal(const Array& a, int32_t parts, int32_t axis);
ArrayPtr repeat(const Array& a, int32_t repeats, int32_t axis);
ArrayPtr pad(const Array& a, I32s axes, I32s low, I32s high, const Array& value);
ArrayPtr take(const Array& a, const Array& indices, int32_t axis);
ArrayPtr take_along_axis(const Array& a, const Array& indices, int32_t axis);
ArrayPtr put_along_axis(const Array& a, const Array& indices, const Array& values, int32_t axis);
ArrayPtr scatter(const Array& a, const ArrayList& indices, const Array& updates, I32s axes, bool add);
ArrayPtr sort(const Array& a, int32_t axis);
ArrayPtr argsort(const Array& a, int32_t axis);
ArrayPtr argpartition(const Array& a, int32_t kth, int32_t axis);
ArrayPtr topk(const Array& a, int32_t k, int32_t axis);
ArrayPtr tril(const Array& a, int32_t k);

ArrayPtr conv1d(const Array& input, const Array& weight, int32_t stride, int32_t padding,
                int32_t dilation, int32_t groups);
ListPtr quantize(const Array& w, int32_t group_size, int32_t bits, rust::Str mode);
ArrayPtr dequantize(const Array& w, const Array& scales, const Array* biases, int32_t group_size,
                    int32_t bits, rust::Str mode);
ArrayPtr quantized_matmul(const Array& x, const Array& w, const Array& scales, const Array* biases,
                          bool transpose, int32_t group_size, int32_t bits, rust::Str mode);
ArrayPtr gather_qmm(const Array& x, const Array& w, const Array& scales, const Array* biases,
                    const Array& rhs_indices, bool transpose, int32_t group_size, int32_t bits,
                    rust::Str mode, bool sorted_indices);
ArrayPtr gather_mm(const Array& a, const Array& b, const Array& rhs_indices,
                   bool sorted_indices);

ArrayPtr rms_norm(const Array& x, const Array* weight, float eps);
ArrayPtr layer_norm(const Array& x, const Array* weight, const Array* bias, float eps);
ArrayPtr rope(const Array& x, int32_t dims, bool traditional, float base, float scale,
              int32_t offset, const Array* freqs);
ArrayPtr rope_at(const Array& x, int32_t dims, bool traditional, float base, float scale,
                 const Array& offsets, const Array* freqs);
ArrayPtr scaled_dot_product_attention(const Array& queries, const Array& keys,
                                      const Array& values, float scale, rust::Str mask_mode,
                                      const Array* mask, const Array* sinks);

ArrayPtr rows_attention(const Array& queries, const Array& keys, const Array& values,
                        const Array& slots, const Array& extents, float one_pass_scale_log2,
                        float two_pass_scale_log2, bool two_pass);
ArrayPtr rows_qmv(const Array& x, const Array& w, const Array& scales, const Array& biases,
                  int32_t group_size, int32_t bits, int32_t rows, int32_t ahead);

ArrayPtr random_key(uint64_t seed);
ArrayPtr random_split(const Array& key, int32_t num);
ArrayPtr random_uniform(I32s shape, uint8_t dtype, const Array& key);
ArrayPtr random_normal(I32s shape, uint8_t dtype, const Array& key);
ArrayPtr random_gumbel(I32s shape, uint8_t dtype, const Array& key);
ArrayPtr random_categorical(const Array& logits, int32_t axis, const Array& key);

ListPtr load_safetensors(rust::Str path, rust::Vec<rust::String>& names,
                         rust::Vec<rust::String>& meta_keys,
                         rust::Vec<rust::String>& meta_values);
void save_safetensors(rust::Str path, rust::Slice<const rust::String> names,
                      const ArrayList& arrays, rust::Slice<const rust::String> meta_keys,
                      rust::Slice<const rust::String> meta_values);

ListPtr call_kernel(Kernel kernel, const ArrayList& inputs);
ListPtr group_expert_select(const Array& gates, const Array& bias, int32_t top_k, int32_t n_group,
                            int32_t topk_group, float routed_scaling_factor, bool norm_topk_prob);

}  // namespace verity_mlx
