// kvforge.cpu.PagedAttentionRope: RoPE and the K/V write inside the call, then PagedAttention's attention
// (attention.h, paged_attention.cc); and kvforge_rotate_keys, the same rotation and rounding for document reuse.
// Not per target: a few rows per call, elementwise, rounded exactly as the numpy reference does.

#include "attention.h"

namespace kvforge_attention {

// attention_mass.cc: whether a watch is armed (one relaxed atomic load), and the pass that fills the watches.
bool attention_mass_armed();
OrtStatus* add_attention_mass(OrtKernelContext* ctx, const Call& c);

namespace {

// Takes the un-rotated query, key and value of the call's rows, rotates query and key by the rows' positions
// (rotate-half over the table's R leading dims of each head, the rest passed: partial rotary), rounds the new
// keys and values through the pool's storage type and writes them into the pool at slots start..start+len-1
// through the page table: the pool input is ALIASED and updated in place (ONNX Runtime only ever sees it as an
// input; the runtime binds its own numpy pool zero-copy, so the write lands in the runtime's memory). The
// attention that follows is PagedAttention's, over the cached positions and the rounded new rows.

// float32 -> IEEE half, round to nearest even (numpy's astype(float16)).
uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | 0x7c00 | (x > 0x7f800000u ? 0x200 : 0);  // inf, NaN
  if (x >= 0x477ff000u) return sign | 0x7c00;  // from 65520 on rounds to inf
  if (x < 0x38800000u) {  // below 2^-14: a half subnormal, m * 2^-24 (m = 1024 is the smallest normal)
    float a;
    std::memcpy(&a, &x, sizeof a);
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f));
  }
  x += 0xfffu + ((x >> 13) & 1u);
  return sign | static_cast<uint16_t>((x >> 13) - (112u << 10));
}

// float32 -> E4M3FN bits, saturating to +-448 (reference.to_storage), round to nearest even.
uint8_t float_to_e4m3(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint8_t sign = static_cast<uint8_t>((x >> 24) & 0x80);
  if (std::isnan(f)) return sign | 0x7f;
  const float a = std::min(std::fabs(f), 448.0f);
  if (a < 0.015625f) return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));  // subnormal: m * 2^-9
  uint32_t bits;
  std::memcpy(&bits, &a, sizeof bits);
  bits += 0x7ffffu + ((bits >> 20) & 1u);
  return sign | static_cast<uint8_t>((bits >> 20) - (120u << 3));
}

// Store n floats in the pool's type and return what attention reads back from them (in place in `values`).
void store_row(PoolType type, float* values, void* dst, int64_t n) {
  switch (type) {
    case PoolType::kF32:
      std::memcpy(dst, values, sizeof(float) * n);
      break;
    case PoolType::kF16: {
      uint16_t* out = static_cast<uint16_t*>(dst);
      for (int64_t d = 0; d < n; ++d) {
        out[d] = float_to_half(values[d]);
        values[d] = half_to_float(out[d]);
      }
      break;
    }
    case PoolType::kFp8: {
      uint8_t* out = static_cast<uint8_t*>(dst);
      for (int64_t d = 0; d < n; ++d) {
        out[d] = float_to_e4m3(values[d]);
        values[d] = g_fp8_table[out[d]];
      }
      break;
    }
  }
}

size_t pool_element_bytes(PoolType type) {
  return type == PoolType::kF16 ? 2 : type == PoolType::kFp8 ? 1 : 4;
}

// Rotate-half of one head: x1*cos - x2*sin, x2*cos + x1*sin over the first `rotary` dims, the rest copied. Kept
// free of FMA contraction so the products round as the exported graph's Mul/Sub/Add (and numpy) round them.
__attribute__((optimize("fp-contract=off"))) void rotate_head(const float* x, const float* cos_sin, int64_t rotary,
                                                             int64_t dim, float* out) {
  const int64_t half = rotary / 2;
  const float* cosv = cos_sin;
  const float* sinv = cos_sin + half;
  for (int64_t j = 0; j < half; ++j) {
    const float x1 = x[j], x2 = x[j + half];
    const float a = x1 * cosv[j], b = x2 * sinv[j], c = x2 * cosv[j], d = x1 * sinv[j];
    out[j] = a - b;
    out[j + half] = c + d;
  }
  for (int64_t j = rotary; j < dim; ++j) out[j] = x[j];
}

struct RopeCall {
  const float* query;
  const float* key;
  const float* value;
  int64_t q_stride, kv_stride;  // floats from one token's query (key, value) row to the next
  const float* cos_sin;
  int64_t capacity, rotary;
  const int32_t* positions;  // [B, S] or null: start + i
  void* pool;                // the aliased pool, written in place
};

OrtStatus* gather_rope_inputs(const Kernel& k, OrtKernelContext* ctx, Call& c, RopeCall& r) {
  const OrtValue* v[10] = {};
  TensorInfo info[10];
  const void* data[10] = {};
  size_t count = 0;
  KVF_TRY(read_inputs(ctx, 8, "PagedAttentionRope ", count, v, info, data));
  KVF_TRY(query_geometry(k, info[0], c));
  const auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, I32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  const int64_t q_width = k.q_heads * k.dim, kv_width = k.kv_heads * k.dim;
  if (k.packed_qkv) {
    const int64_t packed = q_width + 2 * kv_width;
    KVF_TRY(expect("qkv", info[0], F32, {c.batch, c.seq, packed}));
    if (data[1] != data[0] || data[2] != data[0])
      return error("with packed_qkv, inputs 1 and 2 must be the packed qkv tensor of input 0");
    const float* qkv = static_cast<const float*>(data[0]);
    r.query = qkv;
    r.key = qkv + q_width;
    r.value = qkv + q_width + kv_width;
    r.q_stride = r.kv_stride = packed;
  } else {
    KVF_TRY(expect("query", info[0], F32, {c.batch, c.seq, q_width}));
    KVF_TRY(expect("key", info[1], F32, {c.batch, c.seq, kv_width}));
    KVF_TRY(expect("value", info[2], F32, {c.batch, c.seq, kv_width}));
    r.query = static_cast<const float*>(data[0]);
    r.key = static_cast<const float*>(data[1]);
    r.value = static_cast<const float*>(data[2]);
    r.q_stride = q_width;
    r.kv_stride = kv_width;
  }
  KVF_TRY(expect("pool", info[3], ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, {-1, 2, k.kv_heads, k.page_tokens, k.dim}));
  KVF_TRY(expect("kv_page_table", info[4], I32, {c.batch, -1}));
  KVF_TRY(expect("kvcache_start_index", info[5], I32, {c.batch}));
  KVF_TRY(expect("context_lengths", info[6], I32, {c.batch}));
  KVF_TRY(expect("rope_rotary_cos_sin", info[7], F32, {-1, -1}));
  switch (info[3].type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: c.pool_type = PoolType::kF16; break;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: c.pool_type = PoolType::kFp8; break;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: c.pool_type = PoolType::kF32; break;
    default:
      return error("pool element type " + std::to_string(info[3].type) +
                   " is not float16, uint8 (FP8 E4M3) or float32");
  }
  r.capacity = info[7].shape[0];
  r.rotary = info[7].shape[1];
  if (r.capacity <= 0 || r.rotary <= 0 || r.rotary % 2 != 0 || r.rotary > k.dim)
    return error("rope_rotary_cos_sin must be [capacity>0, R] with R even and <= head_dim, got " +
                 shape_text(info[7].shape));
  const auto present = [&](size_t i) {  // an optional input given with elements ([B,0] / [B,0,0] = absent)
    return count > i && v[i] && !info[i].shape.empty() &&
           std::none_of(info[i].shape.begin(), info[i].shape.end(), [](int64_t d) { return d == 0; });
  };
  r.positions = nullptr;
  if (present(8)) {
    KVF_TRY(expect("position_ids", info[8], I32, {c.batch, c.seq}));
    r.positions = static_cast<const int32_t*>(data[8]);
  }
  c.mask = nullptr;
  if (present(9)) {
    KVF_TRY(expect("attention_mask", info[9], ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL, {c.batch, c.seq, c.seq}));
    c.mask = static_cast<const bool*>(data[9]);
  }
  c.num_pages = info[3].shape[0];
  c.width = info[4].shape[1];
  c.pool = data[3];
  r.pool = const_cast<void*>(data[3]);  // the documented alias: this op writes its pool input
  c.page_table = static_cast<const int32_t*>(data[4]);
  c.start = static_cast<const int32_t*>(data[5]);
  c.length = static_cast<const int32_t*>(data[6]);
  r.cos_sin = static_cast<const float*>(data[7]);
  return check_values(c, true);
}

// Rotates the rows' queries and keys, rounds keys and values through the storage type and writes them into the
// pool (a position without a page, -1 or past the table's width, is not written); `rotated_query` and `new_kv`
// [B,S,2,Hkv,D] receive what attention reads.
void rotate_and_write(const Call& c, const RopeCall& r, float* rotated_query, float* new_kv) {
  const int64_t dim = c.dim, hq = c.q_heads, hkv = c.kv_heads;
  const size_t elem = pool_element_bytes(c.pool_type);
  char* pool = static_cast<char*>(r.pool);
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t i = 0; i < c.length[b]; ++i) {
      const int64_t slot_pos = static_cast<int64_t>(c.start[b]) + i;
      int64_t pos = r.positions ? r.positions[b * c.seq + i] : slot_pos;
      pos = std::min<int64_t>(std::max<int64_t>(pos, 0), r.capacity - 1);  // as the export's clamped Gather
      const float* table = r.cos_sin + pos * r.rotary;
      const size_t token = static_cast<size_t>(b * c.seq + i);
      for (int64_t h = 0; h < hq; ++h)
        rotate_head(r.query + token * r.q_stride + h * dim, table, r.rotary, dim,
                    rotated_query + (token * hq + h) * dim);
      const int64_t index = slot_pos / c.page_tokens;
      const int32_t page = index < c.width ? c.page_table[b * c.width + index] : -1;
      const int64_t slot = slot_pos % c.page_tokens;
      for (int64_t h = 0; h < hkv; ++h) {
        float* k_out = new_kv + ((token * 2 + 0) * hkv + h) * dim;
        float* v_out = new_kv + ((token * 2 + 1) * hkv + h) * dim;
        rotate_head(r.key + token * r.kv_stride + h * dim, table, r.rotary, dim, k_out);
        std::memcpy(v_out, r.value + token * r.kv_stride + h * dim, sizeof(float) * dim);
        float scratch[kMaxHeadDim];
        char* k_dst = page >= 0 ? pool + pool_offset(c, page, 0, h, slot) * elem : nullptr;
        char* v_dst = page >= 0 ? pool + pool_offset(c, page, 1, h, slot) * elem : nullptr;
        // Without a page the rows are still rounded (attention reads the same values either way).
        store_row(c.pool_type, k_out, k_dst ? static_cast<void*>(k_dst) : static_cast<void*>(scratch), dim);
        store_row(c.pool_type, v_out, v_dst ? static_cast<void*>(v_dst) : static_cast<void*>(scratch), dim);
      }
    }
  }
}

OrtStatus* ORT_API_CALL compute_rope(void* kernel, OrtKernelContext* ctx) {
  const Kernel& k = *static_cast<const Kernel*>(kernel);
  if (const char* why = kvforge_cpu::forced_target_problem()) return error(why);
  Call c;
  RopeCall r{};
  KVF_TRY(gather_rope_inputs(k, ctx, c, r));
  const int64_t out_shape[3] = {c.batch, c.seq, k.q_heads * k.dim};
  OrtValue* out_value = nullptr;
  KVF_TRY(g_api->KernelContext_GetOutput(ctx, 0, out_shape, 3, &out_value));
  void* out = nullptr;
  KVF_TRY(g_api->GetTensorMutableData(out_value, &out));
  c.out = static_cast<float*>(out);
  const size_t tokens = static_cast<size_t>(c.batch * c.seq);
  std::vector<float> rotated(tokens * static_cast<size_t>(k.q_heads * k.dim), 0.0f);
  std::vector<float> new_kv(tokens * static_cast<size_t>(2 * k.kv_heads * k.dim), 0.0f);
  rotate_and_write(c, r, rotated.data(), new_kv.data());
  c.query = rotated.data();
  c.new_kv = new_kv.data();
  KVF_TRY(attend(ctx, c));
  return attention_mass_armed() ? add_attention_mass(ctx, c) : nullptr;  // issue 53: attention_mass.cc
}

const char* ORT_API_CALL rope_op_name(const OrtCustomOp*) { return "PagedAttentionRope"; }
size_t ORT_API_CALL rope_input_count(const OrtCustomOp*) { return 10; }

ONNXTensorElementDataType ORT_API_CALL rope_input_type(const OrtCustomOp*, size_t index) {
  switch (index) {
    case 0: case 1: case 2: case 7: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    case 3: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // float16, uint8 or float32: checked per call
    case 9: return ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
    default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  }
}

OrtCustomOpInputOutputCharacteristic ORT_API_CALL rope_input_characteristic(const OrtCustomOp*, size_t index) {
  return index >= 8 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}

// An int attribute in shape inference, `fallback` where the node does not have it.
int64_t shape_attribute(OrtShapeInferContext* ctx, const char* name, int64_t fallback) {
  const OrtOpAttr* attr = nullptr;
  if (OrtStatus* st = g_api->ShapeInferContext_GetAttribute(ctx, name, &attr)) {
    g_api->ReleaseStatus(st);
    return fallback;
  }
  int64_t value = fallback;
  size_t written = 0;
  if (!attr) return fallback;
  if (OrtStatus* st = g_api->ReadOpAttr(attr, ORT_OP_ATTR_INT, &value, sizeof value, &written)) {
    g_api->ReleaseStatus(st);
    return fallback;
  }
  return value;
}

// PagedAttentionRope's output: the query's shape, or with packed_qkv the packed input's with the last dim Hq * D.
OrtStatus* ORT_API_CALL infer_rope_shape(const OrtCustomOp* op, OrtShapeInferContext* ctx) {
  if (!shape_attribute(ctx, "packed_qkv", 0)) return infer_shape(op, ctx);
  const int64_t width = shape_attribute(ctx, "num_q_heads", -1) * shape_attribute(ctx, "head_dim", -1);
  return kvforge_ort::infer_last_dim(g_api, ctx, [width](int64_t) { return width > 0 ? width : -1; });
}

OrtCustomOp make_rope_op() {
  OrtCustomOp op = make_op();
  op.InferOutputShapeFn = infer_rope_shape;
  op.GetName = rope_op_name;
  op.GetInputType = rope_input_type;
  op.GetInputTypeCount = rope_input_count;
  op.GetInputCharacteristic = rope_input_characteristic;
  op.KernelComputeV2 = compute_rope;
  return op;
}

OrtCustomOp g_paged_attention_rope = make_rope_op();

// One stored key row decoded to float32 (scalar: any head width, and exact like the vector decode).
void decode_any(PoolType type, const void* src, float* dst, int64_t n) {
  switch (type) {
    case PoolType::kF32:
      std::memcpy(dst, src, sizeof(float) * n);
      break;
    case PoolType::kF16:
      for (int64_t d = 0; d < n; ++d) dst[d] = half_to_float(static_cast<const uint16_t*>(src)[d]);
      break;
    case PoolType::kFp8:
      for (int64_t d = 0; d < n; ++d) dst[d] = g_fp8_table[static_cast<const uint8_t*>(src)[d]];
      break;
  }
}

}  // namespace

// Called by RegisterCustomOps (register.cc).
OrtStatus* add_rope_ops(OrtCustomOpDomain* domain) {
  return g_api->CustomOpDomain_Add(domain, &g_paged_attention_rope);
}

// Document reuse (issue 37) moves a document's stored keys by `delta` positions: one more rotate-half rotation.
// In place on `rows` contiguous rows of `head_dim` elements in the storage type (`dtype`: 0 fp16, 1 fp8 E4M3FN,
// 2 fp32, PoolType's order): decoded to float32, the first `rotary` dims rotated with `cos_sin_row` (the rope
// table's row |delta|: rotary/2 cosines then rotary/2 sines; `sign` -1 negates the sines to rotate back), encoded
// with the KV write's rounding. Byte for byte reference.rotate_keys. Returns 0, or -1 for arguments it refuses.
extern "C" __attribute__((visibility("default"))) int kvforge_rotate_keys(void* keys, int64_t rows, int64_t head_dim,
                                                                          int64_t rotary, const float* cos_sin_row,
                                                                          int sign, int dtype) {
  if (!keys || !cos_sin_row || rows < 0 || head_dim <= 0 || rotary < 0 || rotary % 2 || rotary > head_dim ||
      (sign != 1 && sign != -1) || dtype < 0 || dtype > 2) {
    return -1;
  }
  ensure_fp8_table();
  const PoolType type = static_cast<PoolType>(dtype);
  const int64_t half = rotary / 2;
  std::vector<float> table(static_cast<size_t>(rotary));
  for (int64_t j = 0; j < half; ++j) {
    table[j] = cos_sin_row[j];
    table[half + j] = sign < 0 ? -cos_sin_row[half + j] : cos_sin_row[half + j];  // sin(-a) = -sin(a), exact
  }
  std::vector<float> decoded(static_cast<size_t>(head_dim)), rotated(static_cast<size_t>(head_dim));
  const size_t row_bytes = pool_element_bytes(type) * static_cast<size_t>(head_dim);
  uint8_t* base = static_cast<uint8_t*>(keys);
  for (int64_t r = 0; r < rows; ++r) {
    void* row = base + static_cast<size_t>(r) * row_bytes;
    decode_any(type, row, decoded.data(), head_dim);
    rotate_head(decoded.data(), table.data(), rotary, head_dim, rotated.data());
    store_row(type, rotated.data(), row, head_dim);
  }
  return 0;
}

}  // namespace kvforge_attention
