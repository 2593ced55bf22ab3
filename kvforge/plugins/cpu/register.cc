// RegisterCustomOps, the library's one ONNX Runtime entry: resolves the API table and adds the kvforge.cpu ops, one
// file each (paged_attention.cc, paged_attention_rope.cc, matmul_blocks.cc, swiglu.cc). The library links no
// libonnxruntime; which compiled target the ops run is cpu_target.cc's.

#include <onnxruntime_c_api.h>

#include "attention.h"

#include <string>

namespace kvforge_attention {
OrtStatus* add_ops(OrtCustomOpDomain* domain);       // paged_attention.cc: PagedAttention
OrtStatus* add_rope_ops(OrtCustomOpDomain* domain);  // paged_attention_rope.cc: PagedAttentionRope
}  // namespace kvforge_attention
namespace kvforge_matmul {
OrtStatus* add_ops(OrtCustomOpDomain* domain, const OrtApi* api);  // matmul_blocks.cc: MatMulBlocks
}
namespace kvforge_swiglu {
OrtStatus* add_ops(OrtCustomOpDomain* domain, const OrtApi* api);  // swiglu.cc: SwiGLU
}

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  using kvforge_attention::g_api;
  g_api = api_base->GetApi(ORT_API_VERSION);
  if (!g_api) {
    // An older runtime: its version-1 table (the C API only ever appends) still builds the error status.
    const OrtApi* oldest = api_base->GetApi(1);
    const std::string message = "kvforge.cpu needs ONNX Runtime C API version " + std::to_string(ORT_API_VERSION) +
                                ", this runtime is " + api_base->GetVersionString();
    return oldest ? oldest->CreateStatus(ORT_FAIL, message.c_str()) : nullptr;
  }
  kvforge_attention::ensure_fp8_table();
  OrtCustomOpDomain* domain = nullptr;  // must outlive every session using it, so it is never released
  KVF_TRY(g_api->CreateCustomOpDomain("kvforge.cpu", &domain));
  KVF_TRY(kvforge_attention::add_ops(domain));
  KVF_TRY(kvforge_attention::add_rope_ops(domain));
  KVF_TRY(kvforge_matmul::add_ops(domain, g_api));
  KVF_TRY(kvforge_swiglu::add_ops(domain, g_api));
  return g_api->AddCustomOpDomain(options, domain);
}
