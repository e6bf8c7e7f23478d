#include "mlx/include/shim.h"
#include "mlx/include/rows_attention.h"
#include "mlx/include/row_products.h"

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "mlx/compile_impl.h"
#include "mlx/src/ffi.rs.h"

namespace mx = mlx::core;

namespace verity_mlx {
namespace {

// Dtype codes are the positions in mx::Dtype::Val (see Dtype in array.rs).
const mx::Dtype kDtypes[] = {mx::bool_,   mx::uint8,   mx::uint16,  mx::uint32, mx::uint64,
                             mx::int8,    mx::int16,   mx::int32,   mx::int64,  mx::float16,
                             mx::float32, mx::float64, mx::bfloat16, mx::complex64};

mx::Dtype to_dtype(uint8_t code) {
  if (code >= sizeof(kDtypes) / sizeof(kDtypes[0])) {
    throw std::invalid_argument("unknown dtype code " + std::to_string(code));
  }
  return kDtypes[code];
}

uint8_t from_dtype(mx::Dtype dtype) { return static_cast<uint8_t>(dtype.val()); }

mx::Shape to_shape(I32s s) { return mx::Shape(s.begin(), s.end()); }
std::vector<int> to_ints(I32s s) { return std::vector<int>(s.begin(), s.end()); }

ArrayPtr wrap(mx::array a) { return std::make_unique<Array>(Array{std::move(a)}); }

ListPtr wrap_list(std::vector<mx::array> items) {
  return std::make_unique<ArrayList>(ArrayList{std::move(items)});
}

std::optional<mx::array> opt(const Array* a) {
  if (a == nullptr) return std::nullopt;
  return a->inner;
}

// An empty axis list means every axis, as a Python call without `axis` does.
std::vector<int> axes_or_all(I32s axes, const mx::array& a) {
  auto out = to_ints(axes);
  if (out.empty()) {
    for (int i = 0; i < static_cast<int>(a.ndim()); ++i) out.push_back(i);
  }
  return out;
}

// ---- compiled kernels: each mirrors one mx.compile'd Python function, expression for
// expression, because fused kernels may round differently from unfused ops (docs/parity-notes.md, G3 and G4).

// mlx.nn.silu: `x * mx.sigmoid(x)`, compiled shapeless.
std::vector<mx::array> silu_fn(const std::vector<mx::array>& in) {
  return {mx::multiply(in[0], mx::sigmoid(in[0]))};
}

// mlx_lm.models.activations.swiglu: `nn.silu(gate) * x`, compiled shapeless.
std::vector<mx::array> swiglu_fn(const std::vector<mx::array>& in) {
  const auto& g = in[0];
  return {mx::multiply(mx::multiply(g, mx::sigmoid(g)), in[1])};
}

// mlx.nn.gelu_approx: `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`.
std::vector<mx::array> gelu_approx_fn(const std::vector<mx::array>& in) {
  const auto& x = in[0];
  auto dt = x.dtype();
  auto c = mx::array(0.7978845608028654f, dt);  // math.sqrt(2 / math.pi) as a weak scalar
  auto inner = mx::multiply(c, mx::add(x, mx::multiply(mx::array(0.044715f, dt),
                                                           mx::power(x, mx::array(3, dt)))));
  return {mx::multiply(mx::multiply(mx::array(0.5f, dt), x),
                       mx::add(mx::array(1.0f, dt), mx::tanh(inner)))};
}

// mlx_lm.models.gemma4_text.geglu(gate, x): `nn.gelu_approx(gate) * x`, compiled shapeless
// (the nested compiled gelu_approx is traced into the same graph).
std::vector<mx::array> geglu_fn(const std::vector<mx::array>& in) {
  return {mx::multiply(gelu_approx_fn({in[0]})[0], in[1])};
}

// mlx_lm.models.gemma4_text.logit_softcap(softcap, x): `mx.tanh(x / softcap) * softcap`,
// compiled shapeless; the Python float softcap arrives as a scalar in x's dtype (what the
// weak scalar becomes).
std::vector<mx::array> logit_softcap_fn(const std::vector<mx::array>& in) {
  const auto &x = in[0], &cap = in[1];
  return {mx::multiply(mx::tanh(mx::divide(x, cap)), cap)};
}

// mlx.nn.softplus: `mx.logaddexp(x, 0)`.
std::vector<mx::array> softplus_fn(const std::vector<mx::array>& in) {
  return {mx::logaddexp(in[0], mx::array(0.0f, in[0].dtype()))};
}

// mlx.nn.sigmoid: `mx.sigmoid(x)`.
std::vector<mx::array> sigmoid_fn(const std::vector<mx::array>& in) {
  return {mx::sigmoid(in[0])};
}

// mlx_lm.models.activations.precise_swiglu(h, gate, x): silu and product in f32, cast to h's
// dtype.
std::vector<mx::array> precise_swiglu_fn(const std::vector<mx::array>& in) {
  auto g = mx::astype(in[1], mx::float32);
  g = mx::multiply(g, mx::sigmoid(g));
  auto x = mx::astype(in[2], mx::float32);
  return {mx::astype(mx::multiply(g, x), in[0].dtype())};
}

// mlx_lm.models.gated_delta.compute_g(A_log, a, dt_bias):
// `exp(-exp(A_log.astype(f32)) * softplus(a + dt_bias))`.
std::vector<mx::array> compute_g_fn(const std::vector<mx::array>& in) {
  auto decay = mx::negative(mx::exp(mx::astype(in[0], mx::float32)));
  auto x = mx::add(in[1], in[2]);
  auto softplus = mx::logaddexp(x, mx::array(0.0f, x.dtype()));
  return {mx::exp(mx::multiply(decay, softplus))};
}

// mlx_lm.models.gated_delta._gated_delta_step_ops(q, k, v, g, beta, state) for a scalar gate
// per head (g: [B, H]) and no mask: one step of the gated delta rule.
std::vector<mx::array> gated_delta_step_fn(const std::vector<mx::array>& in) {
  const auto &q = in[0], &k = in[1], &v = in[2], &g = in[3], &beta = in[4];
  auto state = mx::multiply(in[5], mx::expand_dims(g, {-1, -2}));
  auto k_row = mx::expand_dims(k, -2);
  auto kv_mem = mx::sum(mx::multiply(state, k_row), -1);
  auto delta = mx::multiply(mx::subtract(v, kv_mem), mx::expand_dims(beta, -1));
  state = mx::add(state, mx::multiply(k_row, mx::expand_dims(delta, -1)));
  auto y = mx::sum(mx::multiply(state, mx::expand_dims(q, -2)), -1);
  return {mx::astype(y, q.dtype()), state};
}

// mlx_lm.models.glm4_moe.group_expert_select(gates, e_score_correction_bias, top_k, n_group,
// topk_group, routed_scaling_factor, norm_topk_prob), `@mx.compile` without shapeless: the
// Python scalars are compile constants, so each setting is its own trace.
std::vector<mx::array> group_expert_select_fn(const std::vector<mx::array>& in, int top_k,
                                              int n_group, int topk_group,
                                              float routed_scaling_factor, bool norm_topk_prob) {
  auto scores = mx::sigmoid(mx::astype(in[0], mx::float32));
  auto orig_scores = scores;
  scores = mx::add(scores, in[1]);
  if (n_group > 1) {
    scores = mx::unflatten(scores, -1, {n_group, -1});
    auto group_scores = mx::sum(mx::topk(scores, 2, -1), -1, true);
    int k = n_group - topk_group;
    auto group_idx = mx::argpartition(group_scores, k - 1, -2);
    auto stop = group_idx.shape();
    stop[stop.size() - 2] = k;
    group_idx = mx::slice(group_idx, mx::Shape(stop.size(), 0), stop);
    scores = mx::put_along_axis(scores, mx::stop_gradient(group_idx), mx::array(0.0f), -2);
    scores = mx::flatten(scores, -2, -1);
  }
  auto inds = mx::argpartition(mx::negative(scores), top_k - 1, -1);
  auto stop = inds.shape();
  stop.back() = top_k;
  inds = mx::stop_gradient(mx::slice(inds, mx::Shape(stop.size(), 0), stop));
  scores = mx::take_along_axis(orig_scores, inds, -1);
  if (top_k > 1 && norm_topk_prob) {
    scores = mx::divide(scores, mx::sum(scores, -1, true));
  }
  scores = mx::multiply(scores, mx::array(routed_scaling_factor, scores.dtype()));
  return {inds, scores};
}

using CompiledFn = std::function<std::vector<mx::array>(const std::vector<mx::array>&)>;

// MLX keeps compile caches per thread; these handles are per thread too, so a kernel traced on
// the engine thread is never called from another one.
const CompiledFn& kernel_fn(Kernel kernel) {
  thread_local std::unordered_map<uint8_t, CompiledFn> fns;
  auto key = static_cast<uint8_t>(kernel);
  auto it = fns.find(key);
  if (it != fns.end()) return it->second;
  CompiledFn fn;
  switch (kernel) {
    case Kernel::Silu: fn = mx::compile(silu_fn, true); break;
    case Kernel::Swiglu: fn = mx::compile(swiglu_fn, true); break;
    case Kernel::GeluApprox: fn = mx::compile(gelu_approx_fn, true); break;
    case Kernel::Softplus: fn = mx::compile(softplus_fn, true); break;
    case Kernel::Sigmoid: fn = mx::compile(sigmoid_fn, true); break;
    case Kernel::PreciseSwiglu: fn = mx::compile(precise_swiglu_fn, true); break;
    case Kernel::ComputeG: fn = mx::compile(compute_g_fn, true); break;
    case Kernel::Geglu: fn = mx::compile(geglu_fn, true); break;
    case Kernel::LogitSoftcap: fn = mx::compile(logit_softcap_fn, true); break;
    // `@mx.compile` without shapeless: retraced per shape, as in Python.
    case Kernel::GatedDeltaStep: fn = mx::compile(gated_delta_step_fn, false); break;
    default: throw std::invalid_argument("unknown compiled kernel");
  }
  return fns.emplace(key, std::move(fn)).first->second;
}

}  // namespace

ListPtr list_new() { return std::make_unique<ArrayList>(); }
void list_push(ArrayList& list, const Array& a) { list.items.push_back(a.inner); }
size_t list_len(const ArrayList& list) { return list.items.size(); }
ArrayPtr list_get(const ArrayList& list, size_t i) { return wrap(list.items.at(i)); }

ArrayPtr from_bytes(rust::Slice<const uint8_t> data, I32s shape, uint8_t dtype) {
  auto dt = to_dtype(dtype);
  auto s = to_shape(shape);
  size_t n = 1;
  for (auto d : s) {
    if (d < 0) throw std::invalid_argument("negative dimension in shape");
    n *= static_cast<size_t>(d);
  }
  if (n * dt.size() != data.size()) {
    throw std::invalid_argument("data holds " + std::to_string(data.size()) + " bytes, shape needs " +
                                std::to_string(n * dt.size()));
  }
  // MLX adopts (or copies, then frees) this buffer; the caller's slice is never aliased.
  void* copy = std::malloc(data.size() == 0 ? 1 : data.size());
  if (copy == nullptr) throw std::bad_alloc();
  std::memcpy(copy, data.data(), data.size());
  return wrap(mx::array(copy, std::move(s), dt, [](void* p) { std::free(p); }));
}

ArrayPtr scalar_float(float value, uint8_t dtype) { return wrap(mx::array(value, to_dtype(dtype))); }
ArrayPtr scalar_int(int64_t value, uint8_t dtype) {
  return wrap(mx::astype(mx::array(value, mx::int64), to_dtype(dtype)));
}
ArrayPtr full(I32s shape, const Array& value, uint8_t dtype) {
  return wrap(mx::full(to_shape(shape), value.inner, to_dtype(dtype)));
}
ArrayPtr zeros(I32s shape, uint8_t dtype) { return wrap(mx::zeros(to_shape(shape), to_dtype(dtype))); }
ArrayPtr arange(double start, double stop, double step, uint8_t dtype) {
  return wrap(mx::arange(start, stop, step, to_dtype(dtype)));
}
ArrayPtr clone_array(const Array& a) { return wrap(a.inner); }

rust::Vec<int32_t> shape(const Array& a) {
  rust::Vec<int32_t> out;
  for (auto d : a.inner.shape()) out.push_back(d);
  return out;
}
uint8_t dtype(const Array& a) { return from_dtype(a.inner.dtype()); }

rust::Vec<uint8_t> to_bytes(const Array& a) {
  // Wait for the array itself, then copy only when its layout needs it: a copy op enqueued
  // behind work already in flight (the decode loop's next step) would wait for all of it.
  auto x = a.inner;
  x.eval();
  if (!x.flags().row_contiguous) {
    x = mx::contiguous(x);
    x.eval();
  }
  rust::Vec<uint8_t> out;
  out.reserve(x.nbytes());
  auto p = x.data<uint8_t>();
  for (size_t i = 0; i < x.nbytes(); ++i) out.push_back(p[i]);
  return out;
}

rust::String describe(const Array& a) {
  std::ostringstream os;
  os << "array(shape=" << a.inner.shape() << ", dtype=" << a.inner.dtype() << ")";
  return os.str();
}

void eval(const ArrayList& list) { mx::eval(list.items); }
void async_eval(const ArrayList& list) { mx::async_eval(list.items); }
size_t peak_memory() { return mx::get_peak_memory(); }
void reset_peak_memory() { mx::reset_peak_memory(); }
void clear_cache() { mx::clear_cache(); }
rust::String version() { return mx::version(); }
void use_cpu() { mx::set_default_device(mx::Device::cpu); }
void use_gpu() { mx::set_default_device(mx::Device::gpu); }
bool default_is_cpu() { return mx::default_device() == mx::Device::cpu; }
bool gpu_available() { return mx::is_available(mx::Device::gpu); }
bool cuda_available() { return mx::cu::is_available(); }
bool metal_available() { return mx::metal::is_available(); }

ArrayPtr unary(UnaryOp op, const Array& a) {
  const auto& x = a.inner;
  switch (op) {
    case UnaryOp::Negative: return wrap(mx::negative(x));
    case UnaryOp::Abs: return wrap(mx::abs(x));
    case UnaryOp::Exp: return wrap(mx::exp(x));
    case UnaryOp::Expm1: return wrap(mx::expm1(x));
    case UnaryOp::Log: return wrap(mx::log(x));
    case UnaryOp::Log1p: return wrap(mx::log1p(x));
    case UnaryOp::Sqrt: return wrap(mx::sqrt(x));
    case UnaryOp::Rsqrt: return wrap(mx::rsqrt(x));
    case UnaryOp::Square: return wrap(mx::square(x));
    case UnaryOp::Reciprocal: return wrap(mx::reciprocal(x));
    case UnaryOp::Sigmoid: return wrap(mx::sigmoid(x));
    case UnaryOp::Tanh: return wrap(mx::tanh(x));
    case UnaryOp::Sin: return wrap(mx::sin(x));
    case UnaryOp::Cos: return wrap(mx::cos(x));
    case UnaryOp::Erf: return wrap(mx::erf(x));
    case UnaryOp::Floor: return wrap(mx::floor(x));
    case UnaryOp::Ceil: return wrap(mx::ceil(x));
    case UnaryOp::Round: return wrap(mx::round(x));
    case UnaryOp::Sign: return wrap(mx::sign(x));
    case UnaryOp::LogicalNot: return wrap(mx::logical_not(x));
    case UnaryOp::IsNan: return wrap(mx::isnan(x));
    case UnaryOp::StopGradient: return wrap(mx::stop_gradient(x));
    case UnaryOp::Contiguous: return wrap(mx::contiguous(x));
  }
  throw std::invalid_argument("unknown unary op");
}

ArrayPtr binary(BinaryOp op, const Array& a, const Array& b) {
  const auto& x = a.inner;
  const auto& y = b.inner;
  switch (op) {
    case BinaryOp::Add: return wrap(mx::add(x, y));
    case BinaryOp::Subtract: return wrap(mx::subtract(x, y));
    case BinaryOp::Multiply: return wrap(mx::multiply(x, y));
    case BinaryOp::Divide: return wrap(mx::divide(x, y));
    case BinaryOp::Power: return wrap(mx::power(x, y));
    case BinaryOp::Maximum: return wrap(mx::maximum(x, y));
    case BinaryOp::Minimum: return wrap(mx::minimum(x, y));
    case BinaryOp::Remainder: return wrap(mx::remainder(x, y));
    case BinaryOp::FloorDivide: return wrap(mx::floor_divide(x, y));
    case BinaryOp::LogAddExp: return wrap(mx::logaddexp(x, y));
    case BinaryOp::Equal: return wrap(mx::equal(x, y));
    case BinaryOp::NotEqual: return wrap(mx::not_equal(x, y));
    case BinaryOp::Less: return wrap(mx::less(x, y));
    case BinaryOp::LessEqual: return wrap(mx::less_equal(x, y));
    case BinaryOp::Greater: return wrap(mx::greater(x, y));
    case BinaryOp::GreaterEqual: return wrap(mx::greater_equal(x, y));
    case BinaryOp::LogicalAnd: return wrap(mx::logical_and(x, y));
    case BinaryOp::LogicalOr: return wrap(mx::logical_or(x, y));
    case BinaryOp::Matmul: return wrap(mx::matmul(x, y));
  }
  throw std::invalid_argument("unknown binary op");
}

ArrayPtr reduce(ReduceOp op, const Array& a, I32s axes_in, bool keepdims) {
  auto axes = axes_or_all(axes_in, a.inner);
  const auto& x = a.inner;
  switch (op) {
    case ReduceOp::Sum: return wrap(mx::sum(x, axes, keepdims));
    case ReduceOp::Mean: return wrap(mx::mean(x, axes, keepdims));
    case ReduceOp::Prod: return wrap(mx::prod(x, axes, keepdims));
    case ReduceOp::Max: return wrap(mx::max(x, axes, keepdims));
    case ReduceOp::Min: return wrap(mx::min(x, axes, keepdims));
    case ReduceOp::LogSumExp: return wrap(mx::logsumexp(x, axes, keepdims));
    case ReduceOp::All: return wrap(mx::all(x, axes, keepdims));
    case ReduceOp::Any: return wrap(mx::any(x, axes, keepdims));
    case ReduceOp::Std: return wrap(mx::std(x, axes, keepdims));
  }
  throw std::invalid_argument("unknown reduction");
}

ArrayPtr argmax(const Array& a, int32_t axis, bool keepdims) {
  return wrap(mx::argmax(a.inner, axis, keepdims));
}
ArrayPtr argmin(const Array& a, int32_t axis, bool keepdims) {
  return wrap(mx::argmin(a.inner, axis, keepdims));
}
ArrayPtr where_(const Array& cond, const Array& x, const Array& y) {
  return wrap(mx::where(cond.inner, x.inner, y.inner));
}
ArrayPtr clip(const Array& a, const Array* lo, const Array* hi) {
  return wrap(mx::clip(a.inner, opt(lo), opt(hi)));
}
ArrayPtr astype(const Array& a, uint8_t dtype) { return wrap(mx::astype(a.inner, to_dtype(dtype))); }
ArrayPtr softmax(const Array& a, I32s axes_in, bool precise) {
  auto axes = axes_or_all(axes_in, a.inner);
  return wrap(mx::softmax(a.inner, axes, precise));
}
ArrayPtr cumsum(const Array& a, int32_t axis, bool reverse, bool inclusive) {
  return wrap(mx::cumsum(a.inner, axis, reverse, inclusive));
}
ArrayPtr addmm(const Array& c, const Array& a, const Array& b, float alpha, float beta) {
  return wrap(mx::addmm(c.inner, a.inner, b.inner, alpha, beta));
}

ArrayPtr reshape(const Array& a, I32s shape) { return wrap(mx::reshape(a.inner, to_shape(shape))); }
ArrayPtr transpose(const Array& a, I32s axes) {
  if (axes.empty()) return wrap(mx::transpose(a.inner));
  return wrap(mx::transpose(a.inner, to_ints(axes)));
}
ArrayPtr expand_dims(const Array& a, I32s axes) { return wrap(mx::expand_dims(a.inner, to_ints(axes))); }
ArrayPtr squeeze(const Array& a, I32s axes) {
  if (axes.empty()) return wrap(mx::squeeze(a.inner));
  return wrap(mx::squeeze(a.inner, to_ints(axes)));
}
ArrayPtr broadcast_to(const Array& a, I32s shape) {
  return wrap(mx::broadcast_to(a.inner, to_shape(shape)));
}
ArrayPtr flatten(const Array& a, int32_t start, int32_t end) {
  return wrap(mx::flatten(a.inner, start, end));
}
ArrayPtr moveaxis(const Array& a, int32_t source, int32_t destination) {
  return wrap(mx::moveaxis(a.inner, source, destination));
}
ArrayPtr slice(const Array& a, I32s start, I32s stop, I32s strides) {
  return wrap(mx::slice(a.inner, to_shape(start), to_shape(stop), to_shape(strides)));
}
ArrayPtr slice_update(const Array& src, const Array& update, I32s start, I32s stop, I32s strides) {
  return wrap(mx::slice_update(src.inner, update.inner, to_shape(start), to_shape(stop),
                               to_shape(strides)));
}
ArrayPtr concatenate(const ArrayList& list, int32_t axis) {
  return wrap(mx::concatenate(list.items, axis));
}
ArrayPtr depends(const Array& input, const Array& dependency) {
  return wrap(mx::depends({input.inner}, {dependency.inner})[0]);
}
ArrayPtr stack(const ArrayList& list, int32_t axis) { return wrap(mx::stack(list.items, axis)); }
ListPtr split_sections(const Array& a, I32s indices, int32_t axis) {
  return wrap_list(mx::split(a.inner, to_shape(indices), axis));
}
ListPtr split_equal(const Array& a, int32_t parts, int32_t axis) {
  return wrap_list(mx::split(a.inner, parts, axis));
}
ArrayPtr repeat(const Array& a, int32_t repeats, int32_t axis) {
  return wrap(mx::repeat(a.inner, repeats, axis));
}
ArrayPtr pad(const Array& a, I32s axes, I32s low, I32s high, const Array& value) {
  return wrap(mx::pad(a.inner, to_ints(axes), to_shape(low), to_shape(high), value.inner));
}
ArrayPtr take(const Array& a, const Array& indices, int32_t axis) {
  return wrap(mx::take(a.inner, indices.inner, axis));
}
ArrayPtr take_along_axis(const Array& a, const Array& indices, int32_t axis) {
  return wrap(mx::take_along_axis(a.inner, indices.inner, axis));
}
ArrayPtr put_along_axis(const Array& a, const Array& indices, const Array& values, int32_t axis) {
  return wrap(mx::put_along_axis(a.inner, indices.inner, values.inner, axis));
}
ArrayPtr scatter(const Array& a, const ArrayList& indices, const Array& updates, I32s axes,
                 bool add) {
  if (add) return wrap(mx::scatter_add(a.inner, indices.items, updates.inner, to_ints(axes)));
  return wrap(mx::scatter(a.inner, indices.items, updates.inner, to_ints(axes)));
}
ArrayPtr sort(const Array& a, int32_t axis) { return wrap(mx::sort(a.inner, axis)); }
ArrayPtr argsort(const Array& a, int32_t axis) { return wrap(mx::argsort(a.inner, axis)); }
ArrayPtr argpartition(const Array& a, int32_t kth, int32_t axis) {
  return wrap(mx::argpartition(a.inner, kth, axis));
}
ArrayPtr topk(const Array& a, int32_t k, int32_t axis) { return wrap(mx::topk(a.inner, k, axis)); }
ArrayPtr tril(const Array& a, int32_t k) { return wrap(mx::tril(a.inner, k)); }

ArrayPtr conv1d(const Array& input, const Array& weight, int32_t stride, int32_t padding,
                int32_t dilation, int32_t groups) {
  return wrap(mx::conv1d(input.inner, weight.inner, stride, padding, dilation, groups));
}
ListPtr quantize(const Array& w, int32_t group_size, int32_t bits, rust::Str mode) {
  return wrap_list(mx::quantize(w.inner, group_size, bits, std::string(mode)));
}
ArrayPtr dequantize(const Array& w, const Array& scales, const Array* biases, int32_t group_size,
                    int32_t bits, rust::Str mode) {
  return wrap(mx::dequantize(w.inner, scales.inner, opt(biases), group_size, bits,
                             std::string(mode)));
}
ArrayPtr quantized_matmul(const Array& x, const Array& w, const Array& scales, const Array* biases,
                          bool transpose, int32_t group_size, int32_t bits, rust::Str mode) {
  return wrap(mx::quantized_matmul(x.inner, w.inner, scales.inner, opt(biases), transpose,
                                   group_size, bits, std::string(mode)));
}

ArrayPtr gather_qmm(const Array& x, const Array& w, const Array& scales, const Array* biases,
                    const Array& rhs_indices, bool transpose, int32_t group_size, int32_t bits,
                    rust::Str mode, bool sorted_indices) {
  return wrap(mx::gather_qmm(x.inner, w.inner, scales.inner, opt(biases), std::nullopt,
                             rhs_indices.inner, transpose, group_size, bits, std::string(mode),
                             std::nullopt, sorted_indices));
}
ArrayPtr gather_mm(const Array& a, const Array& b, const Array& rhs_indices,
                   bool sorted_indices) {
  return wrap(mx::gather_mm(a.inner, b.inner, std::nullopt, rhs_indices.inner, sorted_indices));
}

ArrayPtr rms_norm(const Array& x, const Array* weight, float eps) {
  return wrap(mx::fast::rms_norm(x.inner, opt(weight), eps));
}
ArrayPtr layer_norm(const Array& x, const Array* weight, const Array* bias, float eps) {
  return wrap(mx::fast::layer_norm(x.inner, opt(weight), opt(bias), eps));
}
ArrayPtr rope(const Array& x, int32_t dims, bool traditional, float base, float scale,
              int32_t offset, const Array* freqs) {
  std::optional<float> b = freqs == nullptr ? std::optional<float>(base) : std::nullopt;
  return wrap(mx::fast::rope(x.inner, dims, traditional, b, scale, offset, opt(freqs)));
}
ArrayPtr rope_at(const Array& x, int32_t dims, bool traditional, float base, float scale,
                 const Array& offsets, const Array* freqs) {
  std::optional<float> b = freqs == nullptr ? std::optional<float>(base) : std::nullopt;
  return wrap(mx::fast::rope(x.inner, dims, traditional, b, scale, offsets.inner, opt(freqs)));
}
ArrayPtr scaled_dot_product_attention(const Array& queries, const Array& keys,
                                      const Array& values, float scale, rust::Str mask_mode,
                                      const Array* mask, const Array* sinks) {
  return wrap(mx::fast::scaled_dot_product_attention(queries.inner, keys.inner, values.inner,
                                                     scale, std::string(mask_mode), opt(mask),
                                                     opt(sinks)));
}

ArrayPtr rows_attention(const Array& queries, const Array& keys, const Array& values,
                        const Array& slots, const Array& extents, float one_pass_scale_log2,
                        float two_pass_scale_log2, bool two_pass) {
  const std::vector<std::string> cache_inputs = {"q",       "k",        "v",         "slots",
                                                 "extents", "capacity", "scale_log2"};
  static const auto one_pass =
      mx::fast::cuda_kernel("verity_rows_attention_one_pass", cache_inputs, {"out"},
                            ROWS_ATTENTION_ONE_PASS, ROWS_ATTENTION_HEADER);
  static const auto partials =
      mx::fast::cuda_kernel("verity_rows_attention_partials", cache_inputs,
                            {"partials", "sums", "maxs"}, ROWS_ATTENTION_PARTIALS,
                            ROWS_ATTENTION_HEADER);
  static const auto combine = mx::fast::cuda_kernel(
      "verity_rows_attention_combine", {"partials", "sums", "maxs", "one_pass", "extents"},
      {"out"}, ROWS_ATTENTION_COMBINE, ROWS_ATTENTION_HEADER);
  const auto& q = queries.inner;
  const auto& k = keys.inner;
  int rows = q.shape(0), q_heads = q.shape(1), kv_heads = k.shape(1), head_dim = q.shape(3);
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> tmpl = {
      {"T", q.dtype()}, {"D", head_dim}, {"HQ", q_heads}, {"HKV", kv_heads}};
  auto capacity = mx::array(k.shape(2), mx::int32);
  auto inputs = [&](float scale_log2) {
    return std::vector<mx::array>{q,       k, values.inner, slots.inner,
                                  extents.inner, capacity, mx::array(scale_log2, mx::float32)};
  };
  auto first = one_pass(inputs(one_pass_scale_log2), {q.shape()}, {q.dtype()},
                        {q_heads * 1024, 1, rows}, {1024, 1, 1}, tmpl, std::nullopt, false, {});
  if (!two_pass) {
    return wrap(first.at(0));
  }
  auto parts = partials(inputs(two_pass_scale_log2),
                        {{rows, q_heads, 32, head_dim}, {rows, q_heads, 32}, {rows, q_heads, 32}},
                        {mx::float32, mx::float32, mx::float32}, {q_heads * 256, 1, rows * 32},
                        {256, 1, 1}, tmpl, std::nullopt, false, {});
  auto out = combine({parts.at(0), parts.at(1), parts.at(2), first.at(0), extents.inner},
                     {q.shape()}, {q.dtype()}, {q_heads * 1024, 1, rows}, {1024, 1, 1}, tmpl,
                     std::nullopt, false, {});
  return wrap(out.at(0));
}

// Each warp computes one output for `rows` rows (include/row_products.h): 8 warps a block,
// one block row per `rows` rows.
ArrayPtr rows_qmv(const Array& x, const Array& w, const Array& scales, const Array& biases,
                  int32_t group_size, int32_t bits, int32_t rows, int32_t ahead) {
  static const auto kernel =
      mx::fast::cuda_kernel("verity_rows_qmv", {"x", "w", "scales", "biases"}, {"out"},
                            ROWS_QMV, ROWS_QMV_HEADER);
  const auto& a = x.inner;
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> tmpl = {
      {"T", a.dtype()}, {"BITS", bits}, {"GROUP", group_size}, {"ROWS", rows}, {"AHEAD", ahead}};
  const int n = w.inner.shape(0);
  std::tuple<int, int, int> grid = {(n + 7) / 8 * 256, (a.shape(0) + rows - 1) / rows, 1};
  auto out = kernel({a, w.inner, scales.inner, biases.inner}, {{a.shape(0), n}}, {a.dtype()}, grid,
                    {256, 1, 1}, tmpl, std::nullopt, false, {});
  return wrap(out.at(0));
}

ArrayPtr random_key(uint64_t seed) { return wrap(mx::random::key(seed)); }
ArrayPtr random_split(const Array& key, int32_t num) {
  return wrap(mx::random::split(key.inner, num));
}
ArrayPtr random_uniform(I32s shape, uint8_t dtype, const Array& key) {
  return wrap(mx::random::uniform(to_shape(shape), to_dtype(dtype), key.inner));
}
ArrayPtr random_normal(I32s shape, uint8_t dtype, const Array& key) {
  return wrap(mx::random::normal(to_shape(shape), to_dtype(dtype), 0.0f, 1.0f, key.inner));
}
ArrayPtr random_gumbel(I32s shape, uint8_t dtype, const Array& key) {
  return wrap(mx::random::gumbel(to_shape(shape), to_dtype(dtype), key.inner));
}
ArrayPtr random_categorical(const Array& logits, int32_t axis, const Array& key) {
  return wrap(mx::random::categorical(logits.inner, axis, key.inner));
}

ListPtr load_safetensors(rust::Str path, rust::Vec<rust::String>& names,
                         rust::Vec<rust::String>& meta_keys,
                         rust::Vec<rust::String>& meta_values) {
  auto [arrays, metadata] = mx::load_safetensors(std::string(path));
  std::vector<std::string> keys;
  for (auto& kv : arrays) keys.push_back(kv.first);
  std::sort(keys.begin(), keys.end());
  auto out = std::make_unique<ArrayList>();
  for (auto& k : keys) {
    names.push_back(rust::String(k));
    out->items.push_back(arrays.at(k));
  }
  std::vector<std::string> mkeys;
  for (auto& kv : metadata) mkeys.push_back(kv.first);
  std::sort(mkeys.begin(), mkeys.end());
  for (auto& k : mkeys) {
    meta_keys.push_back(rust::String(k));
    meta_values.push_back(rust::String(metadata.at(k)));
  }
  return out;
}

void save_safetensors(rust::Str path, rust::Slice<const rust::String> names,
                      const ArrayList& arrays, rust::Slice<const rust::String> meta_keys,
                      rust::Slice<const rust::String> meta_values) {
  if (names.size() != arrays.items.size() || meta_keys.size() != meta_values.size()) {
    throw std::invalid_argument("save_safetensors: names and arrays differ in length");
  }
  std::unordered_map<std::string, mx::array> map;
  for (size_t i = 0; i < names.size(); ++i) map.emplace(std::string(names[i]), arrays.items[i]);
  std::unordered_map<std::string, std::string> meta;
  for (size_t i = 0; i < meta_keys.size(); ++i) {
    meta.emplace(std::string(meta_keys[i]), std::string(meta_values[i]));
  }
  mx::save_safetensors(std::string(path), std::move(map), std::move(meta));
}

ListPtr call_kernel(Kernel kernel, const ArrayList& inputs) {
  return wrap_list(kernel_fn(kernel)(inputs.items));
}

ListPtr group_expert_select(const Array& gates, const Array& bias, int32_t top_k, int32_t n_group,
                            int32_t topk_group, float routed_scaling_factor, bool norm_topk_prob) {
  // Python keys its compile cache on the function and its non-array arguments; so does this.
  uint32_t scale_bits;
  std::memcpy(&scale_bits, &routed_scaling_factor, sizeof(scale_bits));
  std::vector<uint64_t> constants = {static_cast<uint64_t>(top_k), static_cast<uint64_t>(n_group),
                                     static_cast<uint64_t>(topk_group), scale_bits,
                                     static_cast<uint64_t>(norm_topk_prob)};
  auto fn = [=](const std::vector<mx::array>& in) {
    return group_expert_select_fn(in, top_k, n_group, topk_group, routed_scaling_factor,
                                  norm_topk_prob);
  };
  auto id = reinterpret_cast<std::uintptr_t>(&group_expert_select_fn);
  return wrap_list(mx::detail::compile(fn, id, false, constants)({gates.inner, bias.inner}));
}

}  // namespace verity_mlx
