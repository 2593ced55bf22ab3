// The ONNX Runtime custom-op plumbing every kvforge.cpu op shares: the callbacks whose answer is the same for all
// of them (CPU provider, default memory, no aliasing, opset 1 onwards) and the OrtCustomOp they start from.
#pragma once

#include <onnxruntime_c_api.h>

#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kvforge_ort {

inline const char* ORT_API_CALL cpu_provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
inline OrtMemType ORT_API_CALL default_memory(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }
inline int ORT_API_CALL variadic_arity(const OrtCustomOp*) { return 1; }
inline int ORT_API_CALL variadic_homogeneity(const OrtCustomOp*) { return 0; }
inline int ORT_API_CALL start_version(const OrtCustomOp*) { return 1; }
inline int ORT_API_CALL end_version(const OrtCustomOp*) { return INT_MAX; }
inline size_t ORT_API_CALL no_alias(int** inputs, int** outputs) {
  *inputs = nullptr;
  *outputs = nullptr;
  return 0;
}
inline void ORT_API_CALL release_alias(int*, int*) {}

// An op with those shared answers filled in; the caller sets its name, types, counts, kernel and compute.
inline OrtCustomOp base_op() {
  OrtCustomOp op;
  std::memset(&op, 0, sizeof op);
  op.version = ORT_API_VERSION;
  op.GetExecutionProviderType = cpu_provider;
  op.GetInputMemoryType = default_memory;
  op.GetVariadicInputMinArity = variadic_arity;
  op.GetVariadicInputHomogeneity = variadic_homogeneity;
  op.GetVariadicOutputMinArity = variadic_arity;
  op.GetVariadicOutputHomogeneity = variadic_homogeneity;
  op.GetStartVersion = start_version;
  op.GetEndVersion = end_version;
  op.GetMayInplace = no_alias;
  op.ReleaseMayInplace = release_alias;
  op.GetAliasMap = no_alias;
  op.ReleaseAliasMap = release_alias;
  return op;
}

// An optional int attribute of a kernel's node: `fallback` where the node does not have it.
inline int64_t optional_int(const OrtApi* api, const OrtKernelInfo* info, const char* name, int64_t fallback) {
  int64_t value = fallback;
  if (OrtStatus* st = api->KernelInfoGetAttribute_int64(info, name, &value)) {
    api->ReleaseStatus(st);
    return fallback;
  }
  return value;
}

// Output 0's type and shape for an op whose output is input 0's shape (float) but for the last dimension,
// `last(input's last dimension)`. Left unknown where input 0's rank is 0, a leading dimension is wholly unknown (no
// value, no name: written as -1 it would break inference downstream, as in paged_attention.cc), or `last` returns a
// negative value.
template <typename LastDim>
OrtStatus* infer_last_dim(const OrtApi* api, OrtShapeInferContext* ctx, LastDim last) {
  OrtTensorTypeAndShapeInfo* input = nullptr;
  if (OrtStatus* st = api->ShapeInferContext_GetInputTypeShape(ctx, 0, &input)) return st;
  size_t rank = 0;
  if (OrtStatus* st = api->GetDimensionsCount(input, &rank)) return st;
  if (rank == 0) return nullptr;
  std::vector<int64_t> dims(rank);
  std::vector<const char*> names(rank, nullptr);
  if (OrtStatus* st = api->GetDimensions(input, dims.data(), rank)) return st;
  if (OrtStatus* st = api->GetSymbolicDimensions(input, names.data(), rank)) return st;
  for (size_t i = 0; i + 1 < rank; ++i)
    if (dims[i] < 0 && (names[i] == nullptr || names[i][0] == '\0')) return nullptr;
  const int64_t width = last(dims[rank - 1]);
  if (width < 0) return nullptr;
  dims[rank - 1] = width;
  names[rank - 1] = "";
  OrtTensorTypeAndShapeInfo* output = nullptr;
  if (OrtStatus* st = api->CreateTensorTypeAndShapeInfo(&output)) return st;
  OrtStatus* st = api->SetTensorElementType(output, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  if (!st) st = api->SetDimensions(output, dims.data(), rank);
  if (!st) st = api->SetSymbolicDimensions(output, names.data(), rank);
  if (!st) st = api->ShapeInferContext_SetOutputTypeShape(ctx, 0, output);
  api->ReleaseTensorTypeAndShapeInfo(output);
  return st;
}

}  // namespace kvforge_ort
