// The ONNX Runtime custom-op plumbing every kvforge.cpu op shares: the callbacks whose answer is the same for all
// of them (CPU provider, default memory, no aliasing, opset 1 onwards) and the OrtCustomOp they start from.
#pragma once

#include <onnxruntime_c_api.h>

#include <climits>
#include <cstring>

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

}  // namespace kvforge_ort
