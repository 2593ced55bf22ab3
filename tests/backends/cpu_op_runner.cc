// A stand-alone runner of the kvforge.cpu ops without ONNX Runtime, so the kernels can run where no onnxruntime is
// installed: an aarch64 build under qemu-user (tests/backends/test_cpu_kernel_arm.py). It implements the part of
// ONNX Runtime's C API table (OrtApi) the ops call, registers the library's ops through RegisterCustomOps as ONNX
// Runtime would, and for each case of a case file creates the op's kernel, runs it once and compares its outputs
// with the expected ones the case holds (float64 numpy reference, written by the test): exit status 1 on a mismatch,
// 0 when every case matched. It writes every output to the results file too, so the test can check what needs bit
// equality (a verification row against its decode row).
//
// Usage: cpu_op_runner --targets                   (the compiled targets and those this CPU runs, one line each)
//        cpu_op_runner CASES RESULTS               (KVFORGE_CPU_TARGET picks the target, as in the library)
//
// Case file, little-endian: u32 count, then per case: str op, u32 attributes (str name, u8 kind 0 = int64 | 1 =
// float32, then i64 or f32), u32 inputs (i32 ONNX element type, 0 = absent; u32 rank; i64 dims; u64 bytes; data),
// u32 outputs (u32 rank; i64 dims; f32 atol; float32 expected data). str = u32 length + bytes.
// Results file: per case, per output, its float32 data as computed.

#include <onnxruntime_c_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

extern "C" OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base);
extern "C" const char* kvforge_cpu_compiled_targets();
extern "C" const char* kvforge_cpu_runnable_targets();
extern "C" const char* kvforge_cpu_chosen_target();
extern "C" const char* kvforge_cpu_target_problem();

// The opaque types of the C API, as this runner holds them.
struct OrtStatus {
  std::string message;
};
struct OrtValue {
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<int64_t> dims;
  std::vector<uint8_t> owned;  // the data when the runner owns it
  void* data = nullptr;
};
struct OrtTensorTypeAndShapeInfo {
  ONNXTensorElementDataType type;
  std::vector<int64_t> dims;
};
struct OrtKernelInfo {
  std::map<std::string, int64_t> ints;
  std::map<std::string, float> floats;
};
struct OrtKernelContext {
  std::vector<OrtValue*> inputs;  // nullptr: an absent optional input
  std::vector<std::unique_ptr<OrtValue>> outputs;
};
struct OrtCustomOpDomain {
  std::vector<const OrtCustomOp*> ops;
};
struct OrtOpAttr {
  std::string name;
  OrtOpAttrType type;
  int64_t i = 0;
  float f = 0;
};
struct OrtOp {
  std::string name;
  std::map<std::string, double> attrs;
};
struct OrtMemoryInfo {};

namespace {

size_t element_size(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32:
      return 4;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
      return 2;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE:
      return 8;
    default:
      return 1;  // uint8, int8, bool, float8
  }
}

int64_t count(const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

OrtStatus* fail(const std::string& message) { return new OrtStatus{message}; }

// ---- the OrtApi entries the ops call ----
OrtStatus* ORT_API_CALL CreateStatus(OrtErrorCode, const char* msg) NO_EXCEPTION { return fail(msg); }
const char* ORT_API_CALL GetErrorMessage(const OrtStatus* status) NO_EXCEPTION { return status->message.c_str(); }
void ORT_API_CALL ReleaseStatus(OrtStatus* status) { delete status; }

OrtStatus* ORT_API_CALL KernelContext_GetInputCount(const OrtKernelContext* ctx, size_t* out) NO_EXCEPTION {
  *out = ctx->inputs.size();
  return nullptr;
}
OrtStatus* ORT_API_CALL KernelContext_GetOutputCount(const OrtKernelContext* ctx, size_t* out) NO_EXCEPTION {
  *out = ctx->outputs.size();
  return nullptr;
}
OrtStatus* ORT_API_CALL KernelContext_GetInput(const OrtKernelContext* ctx, size_t index,
                                               const OrtValue** out) NO_EXCEPTION {
  *out = index < ctx->inputs.size() ? ctx->inputs[index] : nullptr;
  return nullptr;
}
OrtStatus* ORT_API_CALL KernelContext_GetOutput(OrtKernelContext* ctx, size_t index, const int64_t* dims,
                                                size_t rank, OrtValue** out) NO_EXCEPTION {
  if (ctx->outputs.size() <= index) ctx->outputs.resize(index + 1);
  auto value = std::make_unique<OrtValue>();
  value->type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  value->dims.assign(dims, dims + rank);
  value->owned.assign(sizeof(float) * count(value->dims), 0xEE);  // not zero: an unwritten element shows
  value->data = value->owned.data();
  *out = value.get();
  ctx->outputs[index] = std::move(value);
  return nullptr;
}
OrtStatus* ORT_API_CALL KernelContext_ParallelFor(const OrtKernelContext*, void (*fn)(void*, size_t), size_t total,
                                                  size_t, void* data) NO_EXCEPTION {
  for (size_t i = 0; i < total; ++i) fn(data, i);  // one thread: the order never changes a result
  return nullptr;
}
OrtStatus* ORT_API_CALL GetTensorTypeAndShape(const OrtValue* value, OrtTensorTypeAndShapeInfo** out) NO_EXCEPTION {
  *out = new OrtTensorTypeAndShapeInfo{value->type, value->dims};
  return nullptr;
}
OrtStatus* ORT_API_CALL GetDimensionsCount(const OrtTensorTypeAndShapeInfo* info, size_t* out) NO_EXCEPTION {
  *out = info->dims.size();
  return nullptr;
}
OrtStatus* ORT_API_CALL GetDimensions(const OrtTensorTypeAndShapeInfo* info, int64_t* dims, size_t n) NO_EXCEPTION {
  for (size_t i = 0; i < n && i < info->dims.size(); ++i) dims[i] = info->dims[i];
  return nullptr;
}
OrtStatus* ORT_API_CALL GetSymbolicDimensions(const OrtTensorTypeAndShapeInfo*, const char* names[],
                                              size_t n) NO_EXCEPTION {
  for (size_t i = 0; i < n; ++i) names[i] = "";
  return nullptr;
}
OrtStatus* ORT_API_CALL GetTensorElementType(const OrtTensorTypeAndShapeInfo* info,
                                             ONNXTensorElementDataType* out) NO_EXCEPTION {
  *out = info->type;
  return nullptr;
}
void ORT_API_CALL ReleaseTensorTypeAndShapeInfo(OrtTensorTypeAndShapeInfo* info) { delete info; }
OrtStatus* ORT_API_CALL GetTensorData(const OrtValue* value, const void** out) NO_EXCEPTION {
  *out = value->data;
  return nullptr;
}
OrtStatus* ORT_API_CALL GetTensorMutableData(OrtValue* value, void** out) NO_EXCEPTION {
  *out = value->data;
  return nullptr;
}
OrtStatus* ORT_API_CALL KernelInfoGetAttribute_int64(const OrtKernelInfo* info, const char* name,
                                                     int64_t* out) NO_EXCEPTION {
  auto found = info->ints.find(name);
  if (found == info->ints.end()) return fail(std::string("no attribute ") + name);
  *out = found->second;
  return nullptr;
}
OrtStatus* ORT_API_CALL KernelInfoGetAttribute_float(const OrtKernelInfo* info, const char* name,
                                                     float* out) NO_EXCEPTION {
  auto found = info->floats.find(name);
  if (found == info->floats.end()) return fail(std::string("no attribute ") + name);
  *out = found->second;
  return nullptr;
}
OrtStatus* ORT_API_CALL CreateCustomOpDomain(const char*, OrtCustomOpDomain** out) NO_EXCEPTION {
  *out = new OrtCustomOpDomain;  // lives as long as the process, as the library expects
  return nullptr;
}
OrtCustomOpDomain* g_domain = nullptr;
OrtStatus* ORT_API_CALL CustomOpDomain_Add(OrtCustomOpDomain* domain, const OrtCustomOp* op) NO_EXCEPTION {
  domain->ops.push_back(op);
  return nullptr;
}
OrtStatus* ORT_API_CALL AddCustomOpDomain(OrtSessionOptions*, OrtCustomOpDomain* domain) NO_EXCEPTION {
  g_domain = domain;
  return nullptr;
}
// MatMulBlocks' many-row path hands ONNX Runtime a Gemm (y = alpha · a · wᵀ, no C input): a plain one here, in
// float64.
OrtStatus* ORT_API_CALL CreateOpAttr(const char* name, const void* data, int, OrtOpAttrType type,
                                     OrtOpAttr** out) NO_EXCEPTION {
  auto* attr = new OrtOpAttr{name, type};
  if (type == ORT_OP_ATTR_INT) attr->i = *static_cast<const int64_t*>(data);
  if (type == ORT_OP_ATTR_FLOAT) attr->f = *static_cast<const float*>(data);
  *out = attr;
  return nullptr;
}
void ORT_API_CALL ReleaseOpAttr(OrtOpAttr* attr) { delete attr; }
OrtStatus* ORT_API_CALL CreateOp(const OrtKernelInfo*, const char* name, const char*, int, const char**,
                                 const ONNXTensorElementDataType*, int, const OrtOpAttr* const* attrs, int count,
                                 int, int, OrtOp** out) NO_EXCEPTION {
  auto* op = new OrtOp{name, {}};
  for (int i = 0; i < count; ++i)
    op->attrs[attrs[i]->name] = attrs[i]->type == ORT_OP_ATTR_INT ? attrs[i]->i : attrs[i]->f;
  *out = op;
  return nullptr;
}
void ORT_API_CALL ReleaseOp(OrtOp* op) { delete op; }
OrtStatus* ORT_API_CALL InvokeOp(const OrtKernelContext*, const OrtOp* op, const OrtValue* const* in, int inputs,
                                 OrtValue* const* out, int) NO_EXCEPTION {
  if (op->name != "Gemm" || inputs != 2 || op->attrs.at("transA") != 0 || op->attrs.at("transB") != 1)
    return fail("the runner's InvokeOp does Gemm of two inputs with transB only, asked for " + op->name);
  const float* a = static_cast<const float*>(in[0]->data);
  const float* w = static_cast<const float*>(in[1]->data);
  float* y = static_cast<float*>(out[0]->data);
  const int64_t m = in[0]->dims[0], k = in[0]->dims[1], n = in[1]->dims[0];
  const double alpha = op->attrs.at("alpha");  // beta scales C, and there is none
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < n; ++c) {
      double sum = 0;
      for (int64_t i = 0; i < k; ++i) sum += double(a[r * k + i]) * w[c * k + i];
      y[r * n + c] = float(alpha * sum);
    }
  return nullptr;
}
OrtStatus* ORT_API_CALL CreateTensorWithDataAsOrtValue(const OrtMemoryInfo*, void* data, size_t, const int64_t* shape,
                                                       size_t rank, ONNXTensorElementDataType type,
                                                       OrtValue** out) NO_EXCEPTION {
  auto* value = new OrtValue;
  value->type = type;
  value->dims.assign(shape, shape + rank);
  value->data = data;
  *out = value;
  return nullptr;
}
void ORT_API_CALL ReleaseValue(OrtValue* value) { delete value; }
OrtStatus* ORT_API_CALL CreateCpuMemoryInfo(OrtAllocatorType, OrtMemType, OrtMemoryInfo** out) NO_EXCEPTION {
  *out = new OrtMemoryInfo;
  return nullptr;
}
void ORT_API_CALL ReleaseMemoryInfo(OrtMemoryInfo* info) { delete info; }

OrtApi make_api() {
  OrtApi api;
  std::memset(&api, 0, sizeof api);  // an entry the ops call and this runner lacks crashes at once, never silently
  api.CreateStatus = CreateStatus;
  api.GetErrorMessage = GetErrorMessage;
  api.ReleaseStatus = ReleaseStatus;
  api.KernelContext_GetInputCount = KernelContext_GetInputCount;
  api.KernelContext_GetOutputCount = KernelContext_GetOutputCount;
  api.KernelContext_GetInput = KernelContext_GetInput;
  api.KernelContext_GetOutput = KernelContext_GetOutput;
  api.KernelContext_ParallelFor = KernelContext_ParallelFor;
  api.GetTensorTypeAndShape = GetTensorTypeAndShape;
  api.GetDimensionsCount = GetDimensionsCount;
  api.GetDimensions = GetDimensions;
  api.GetSymbolicDimensions = GetSymbolicDimensions;
  api.GetTensorElementType = GetTensorElementType;
  api.ReleaseTensorTypeAndShapeInfo = ReleaseTensorTypeAndShapeInfo;
  api.GetTensorData = GetTensorData;
  api.GetTensorMutableData = GetTensorMutableData;
  api.KernelInfoGetAttribute_int64 = KernelInfoGetAttribute_int64;
  api.KernelInfoGetAttribute_float = KernelInfoGetAttribute_float;
  api.CreateCustomOpDomain = CreateCustomOpDomain;
  api.CustomOpDomain_Add = CustomOpDomain_Add;
  api.AddCustomOpDomain = AddCustomOpDomain;
  api.CreateOpAttr = CreateOpAttr;
  api.ReleaseOpAttr = ReleaseOpAttr;
  api.CreateOp = CreateOp;
  api.ReleaseOp = ReleaseOp;
  api.InvokeOp = InvokeOp;
  api.CreateTensorWithDataAsOrtValue = CreateTensorWithDataAsOrtValue;
  api.ReleaseValue = ReleaseValue;
  api.CreateCpuMemoryInfo = CreateCpuMemoryInfo;
  api.ReleaseMemoryInfo = ReleaseMemoryInfo;
  return api;
}

const OrtApi g_table = make_api();
const OrtApi* ORT_API_CALL GetApi(uint32_t version) NO_EXCEPTION {
  return version == ORT_API_VERSION ? &g_table : nullptr;
}
const char* ORT_API_CALL GetVersionString() NO_EXCEPTION { return "kvforge cpu_op_runner"; }

// ---- the case file ----
struct Reader {
  std::ifstream in;
  template <typename T>
  T get() {
    T value{};
    in.read(reinterpret_cast<char*>(&value), sizeof value);
    if (!in) throw std::runtime_error("the case file ends early");
    return value;
  }
  std::string str() {
    std::string s(get<uint32_t>(), '\0');
    in.read(&s[0], static_cast<std::streamsize>(s.size()));
    return s;
  }
  std::vector<int64_t> dims() {
    std::vector<int64_t> d(get<uint32_t>());
    for (auto& x : d) x = get<int64_t>();
    return d;
  }
};

int run_case(Reader& r, std::ofstream& results, int index) {
  const std::string name = r.str();
  OrtKernelInfo info;
  for (uint32_t i = 0, n = r.get<uint32_t>(); i < n; ++i) {
    const std::string attr = r.str();
    if (r.get<uint8_t>() == 0)
      info.ints[attr] = r.get<int64_t>();
    else
      info.floats[attr] = r.get<float>();
  }
  std::vector<std::unique_ptr<OrtValue>> inputs;
  OrtKernelContext ctx;
  for (uint32_t i = 0, n = r.get<uint32_t>(); i < n; ++i) {
    auto value = std::make_unique<OrtValue>();
    value->type = static_cast<ONNXTensorElementDataType>(r.get<int32_t>());
    value->dims = r.dims();
    value->owned.resize(r.get<uint64_t>());
    r.in.read(reinterpret_cast<char*>(value->owned.data()), static_cast<std::streamsize>(value->owned.size()));
    value->data = value->owned.data();
    ctx.inputs.push_back(value->type == ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED ? nullptr : value.get());
    inputs.push_back(std::move(value));
  }
  const OrtCustomOp* op = nullptr;
  for (const OrtCustomOp* candidate : g_domain->ops)
    if (name == candidate->GetName(candidate)) op = candidate;
  if (!op) throw std::runtime_error("no op named " + name);
  void* kernel = nullptr;
  if (OrtStatus* st = op->CreateKernelV2(op, &g_table, &info, &kernel))
    throw std::runtime_error(name + ": creating the kernel: " + st->message);
  OrtStatus* st = op->KernelComputeV2(kernel, &ctx);
  op->KernelDestroy(kernel);
  if (st) throw std::runtime_error(name + ": " + st->message);
  int bad = 0;
  for (uint32_t o = 0, n = r.get<uint32_t>(); o < n; ++o) {
    const std::vector<int64_t> dims = r.dims();
    const float atol = r.get<float>();
    std::vector<float> expected(count(dims));
    r.in.read(reinterpret_cast<char*>(expected.data()), static_cast<std::streamsize>(expected.size() * 4));
    if (o >= ctx.outputs.size() || !ctx.outputs[o] || ctx.outputs[o]->dims != dims)
      throw std::runtime_error(name + ": output " + std::to_string(o) + " missing or of another shape");
    const float* got = static_cast<const float*>(ctx.outputs[o]->data);
    results.write(reinterpret_cast<const char*>(got), static_cast<std::streamsize>(expected.size() * 4));
    double worst = 0;
    int64_t where = -1;
    for (size_t i = 0; i < expected.size(); ++i) {
      const double diff = std::fabs(double(got[i]) - expected[i]);
      if (!(diff <= atol) && (where < 0 || diff > worst)) worst = diff, where = static_cast<int64_t>(i);
    }
    if (where >= 0) {
      std::fprintf(stderr, "case %d (%s) output %u: element %lld is %.9g, expected %.9g (atol %g)\n", index,
                   name.c_str(), o, static_cast<long long>(where), got[where], expected[where], atol);
      ++bad;
    }
  }
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  OrtApiBase base{GetApi, GetVersionString};
  if (OrtStatus* st = RegisterCustomOps(nullptr, &base)) {
    std::fprintf(stderr, "RegisterCustomOps: %s\n", st->message.c_str());
    return 2;
  }
  if (argc == 2 && std::string(argv[1]) == "--targets") {
    std::printf("%s\n%s\n", kvforge_cpu_compiled_targets(), kvforge_cpu_runnable_targets());
    return 0;
  }
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s --targets | %s CASES RESULTS\n", argv[0], argv[0]);
    return 2;
  }
  const char* chosen = kvforge_cpu_chosen_target();
  if (!*chosen) {
    std::fprintf(stderr, "%s\n", kvforge_cpu_target_problem());
    return 2;
  }
  Reader reader{std::ifstream(argv[1], std::ios::binary)};
  std::ofstream results(argv[2], std::ios::binary);
  int bad = 0, cases = 0;
  try {
    for (uint32_t i = 0, n = reader.get<uint32_t>(); i < n; ++i, ++cases) bad += run_case(reader, results, int(i));
  } catch (const std::exception& error) {
    std::fprintf(stderr, "target %s: %s\n", chosen, error.what());
    return 2;
  }
  std::printf("target %s: %d cases, %d mismatched outputs\n", chosen, cases, bad);
  return bad ? 1 : 0;
}
