// kvforge.cpu.SwiGLU: a gated MLP's activation on the packed gate/up projection in one node.
//
// The contract is kvforge/plugins/ops.py CPU_SWIGLU; the semantics are kvforge/plugins/reference.py swiglu.
// Y [..., I] = silu(X[..., :I]) * X[..., I:], silu(g) = g * sigmoid(g), for X [..., 2I] (the export packs gate and
// up into one matmul). The graph's form is Split, Sigmoid, Mul and Mul (four nodes a layer after ONNX Runtime's
// own fusions: Split, QuickGelu and Mul, plus the Split's second output); one node saves three of a decode call's
// ~340 node launches per layer and the round trips of the split halves. Element by element, so a row's result is
// the same whatever the row count (verification rows equal decode rows). sigmoid(g) = 1 / (1 + exp(-g)) with the
// attention kernel's exp (vector_exp.h), then (g * sigmoid(g)) * u, the graph's order of products.
//
// Compiled per target (Highway's foreach_target, cpu_target.h says which runs): AVX-512 keeps its intrinsics, the
// other targets share one Highway loop with vector_exp.h's Exp. A tail shorter than a vector uses std::exp.

#ifndef KVFORGE_SWIGLU_COMMON
#define KVFORGE_SWIGLU_COMMON
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <onnxruntime_c_api.h>

#include "cpu_target.h"
#include "ort_op.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace kvforge_swiglu {
namespace {

const OrtApi* g_api = nullptr;

constexpr int64_t kParallelElements = 1 << 16;  // below this many outputs one thread is faster than a fork/join

#define KVF_SG_TRY(expr)                     \
  do {                                       \
    if (OrtStatus* _st = (expr)) return _st; \
  } while (0)

OrtStatus* error(const std::string& message) {
  return g_api->CreateStatus(ORT_INVALID_ARGUMENT, ("kvforge.cpu.SwiGLU: " + message).c_str());
}

struct Call {
  const float* x;  // [rows, 2 * width]
  float* y;        // [rows, width]
  int64_t width;
  int64_t rows;
};

}  // namespace
}  // namespace kvforge_swiglu
#endif  // KVFORGE_SWIGLU_COMMON

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "swiglu.cc"
#include <hwy/foreach_target.h>  // re-includes this file once per target
#include <hwy/highway.h>

#include "vector_exp.h"

HWY_BEFORE_NAMESPACE();
namespace kvforge_swiglu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

void swiglu_row(const float* gate, const float* up, float* out, int64_t width) {
  int64_t i = 0;
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= width; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = kvforge_simd::HWY_NAMESPACE::exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 sigmoid = _mm512_div_ps(one, _mm512_add_ps(one, e));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), _mm512_loadu_ps(up + i)));
  }
#else
  const hn::CappedTag<float, 16> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const auto one = hn::Set(d, 1.0f);
  for (; i + N <= width; i += N) {
    const auto g = hn::LoadU(d, gate + i);
    const auto sigmoid = hn::Div(one, hn::Add(one, kvforge_simd::HWY_NAMESPACE::Exp(d, hn::Neg(g))));
    hn::StoreU(hn::Mul(hn::Mul(g, sigmoid), hn::LoadU(d, up + i)), d, out + i);
  }
#endif
  for (; i < width; ++i) {
    const float sigmoid = 1.0f / (1.0f + std::exp(-gate[i]));
    out[i] = (gate[i] * sigmoid) * up[i];
  }
}

void row_item(void* data, size_t row) {
  const Call& c = *static_cast<const Call*>(data);
  const float* x = c.x + static_cast<int64_t>(row) * 2 * c.width;
  swiglu_row(x, x + c.width, c.y + static_cast<int64_t>(row) * c.width, c.width);
}

OrtStatus* Run(OrtKernelContext* ctx, const Call* call) {
  Call& c = *const_cast<Call*>(call);
  if (c.rows > 1 && c.rows * c.width >= kParallelElements)
    return g_api->KernelContext_ParallelFor(ctx, row_item, static_cast<size_t>(c.rows), 0, &c);
  for (int64_t row = 0; row < c.rows; ++row) row_item(&c, static_cast<size_t>(row));
  return nullptr;
}

}  // namespace HWY_NAMESPACE
}  // namespace kvforge_swiglu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvforge_swiglu {
HWY_EXPORT(Run);
namespace {

OrtStatus* ORT_API_CALL compute(void*, OrtKernelContext* ctx) {
  if (const char* why = kvforge_cpu::forced_target_problem()) return error(why);
  const OrtValue* input = nullptr;
  KVF_SG_TRY(g_api->KernelContext_GetInput(ctx, 0, &input));
  if (!input) return error("input X is missing");
  OrtTensorTypeAndShapeInfo* info = nullptr;
  KVF_SG_TRY(g_api->GetTensorTypeAndShape(input, &info));
  size_t rank = 0;
  std::vector<int64_t> shape;
  OrtStatus* st = g_api->GetDimensionsCount(info, &rank);
  if (!st) {
    shape.resize(rank);
    st = g_api->GetDimensions(info, shape.data(), rank);
  }
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  if (st) return st;
  if (rank == 0 || shape.back() % 2 != 0)
    return error("X's last dimension must be even (gate and up halves), got shape rank " + std::to_string(rank));
  const int64_t width = shape.back() / 2;
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < rank; ++i) rows *= shape[i];
  std::vector<int64_t> out_shape(shape);
  out_shape.back() = width;
  OrtValue* output = nullptr;
  KVF_SG_TRY(g_api->KernelContext_GetOutput(ctx, 0, out_shape.data(), out_shape.size(), &output));
  void* y = nullptr;
  KVF_SG_TRY(g_api->GetTensorMutableData(output, &y));
  const void* x = nullptr;
  KVF_SG_TRY(g_api->GetTensorData(input, &x));
  if (rows == 0 || width == 0) return nullptr;
  Call c{static_cast<const float*>(x), static_cast<float*>(y), width, rows};
  return HWY_DYNAMIC_DISPATCH(Run)(ctx, &c);
}

OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void** kernel) {
  *kernel = nullptr;  // stateless
  return nullptr;
}

void ORT_API_CALL destroy_kernel(void*) {}

const char* ORT_API_CALL op_name(const OrtCustomOp*) { return "SwiGLU"; }
size_t ORT_API_CALL one(const OrtCustomOp*) { return 1; }
ONNXTensorElementDataType ORT_API_CALL float_type(const OrtCustomOp*, size_t) {
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
OrtCustomOpInputOutputCharacteristic ORT_API_CALL required(const OrtCustomOp*, size_t) {
  return INPUT_OUTPUT_REQUIRED;
}

// Y has X's shape with the last dimension halved; left unknown where X's last dimension is not a known even number.
OrtStatus* ORT_API_CALL infer_shape(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  return kvforge_ort::infer_last_dim(g_api, ctx, [](int64_t width) { return width % 2 == 0 ? width / 2 : -1; });
}

OrtCustomOp make_op() {
  OrtCustomOp op = kvforge_ort::base_op();
  op.GetName = op_name;
  op.GetInputType = float_type;
  op.GetInputTypeCount = one;
  op.GetOutputType = float_type;
  op.GetOutputTypeCount = one;
  op.KernelDestroy = destroy_kernel;
  op.GetInputCharacteristic = required;
  op.GetOutputCharacteristic = required;
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  op.InferOutputShapeFn = infer_shape;
  return op;
}

OrtCustomOp g_swiglu = make_op();

}  // namespace

// Called by RegisterCustomOps (paged_attention.cc) with the API table it resolved.
OrtStatus* add_ops(OrtCustomOpDomain* domain, const OrtApi* api) {
  g_api = api;
  return api->CustomOpDomain_Add(domain, &g_swiglu);
}

}  // namespace kvforge_swiglu
#endif  // HWY_ONCE
