// What the two attention ops' files share (paged_attention.cc: the kernel and PagedAttention;
// paged_attention_rope.cc: PagedAttentionRope and kvforge_rotate_keys): the pool types, the call's geometry and work
// plan, and the input validation. Not per target: the per-target code is paged_attention.cc's.
#pragma once

#include <onnxruntime_c_api.h>

#include "cpu_target.h"
#include "ort_op.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace kvforge_attention {

inline const OrtApi* g_api = nullptr;  // set by RegisterCustomOps (register.cc)

constexpr int kTile = 64;          // positions decoded per tile (4 vectors of 16)
constexpr int kRowBlock = 4;       // query rows per register block
constexpr int kMaxRows = 48;       // query rows (queries x group) per item: 16 queries of a group of 3
constexpr int kDirectQueries = 8;  // AVX-512: items of up to this many queries (verify rows) take the direct path
constexpr int kMaxHeadDim = 512;  // Gemma 4's global layers are 512 wide
constexpr int kSplitTokens = 256;  // cached positions per split when the range is split
constexpr int kMaxSplits = 64;
constexpr int kEnoughGroups = 16;  // this many (row, head, query block) groups keep the threads busy unsplit
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum class PoolType { kF16, kFp8, kF32 };

inline float g_fp8_table[256];  // E4M3FN bit pattern -> float; NaN patterns decode to 0 (never written)

inline void init_fp8_table() {
  for (int bits = 0; bits < 256; ++bits) {
    const int exponent = (bits >> 3) & 0xf, mantissa = bits & 0x7;
    float magnitude;
    if (exponent == 0xf && mantissa == 0x7) {
      magnitude = 0.0f;
    } else if (exponent == 0) {
      magnitude = std::ldexp(static_cast<float>(mantissa), -9);
    } else {
      magnitude = std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
    }
    g_fp8_table[bits] = (bits & 0x80) ? -magnitude : magnitude;
  }
}

// The table once per process, whichever comes first: RegisterCustomOps or a ctypes call of kvforge_rotate_keys.
inline void ensure_fp8_table() {
  static const bool table_ready = (init_fp8_table(), true);
  (void)table_ready;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0) {
    const float sub = std::ldexp(static_cast<float>(mantissa), -24);
    std::memcpy(&bits, &sub, sizeof bits);
    bits |= sign;
  } else if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// ---- the call: validated geometry, the work plan, and the items ----

struct Item {
  int32_t b, h, q0, q1;  // row, kv head, queries [q0, q1)
  int32_t c0, c1;        // cached positions [c0, c1)
  bool with_new;         // this item also attends over the call's new rows
  int32_t group;         // index into Call::groups
  int32_t split;         // index of this split within its group
};

struct Group {
  int32_t b, h, q0, q1;
  int32_t splits;
  int64_t partial;  // offset of the group's partials (splits x rows x (dim + 2))
};

struct Call {
  int64_t batch, seq, q_heads, kv_heads, dim, page_tokens, width, num_pages, group_size;
  int64_t window;  // sliding window: query at position p sees keys p - window + 1..p (0 = every position)
  float scale;
  const float* query;
  const float* new_kv;
  const void* pool;
  PoolType pool_type;
  const int32_t* page_table;
  const int32_t* start;
  const int32_t* length;
  const bool* mask;
  float* out;
  std::vector<Item> items;
  std::vector<Group> groups;
  mutable std::vector<float> partials;  // written by the items of split groups
  std::unique_ptr<std::atomic<int32_t>[]> pending;  // items of each group still running
};


inline size_t pool_offset(const Call& c, int64_t page, int kv, int64_t head, int64_t slot) {
  return static_cast<size_t>((((page * 2 + kv) * c.kv_heads + head) * c.page_tokens + slot) * c.dim);
}

// Offset of (row b, token i, q head) in query and output [B, S, Hq * D].
inline size_t head_offset(const Call& c, int64_t b, int64_t i, int64_t q_head) {
  return static_cast<size_t>(((b * c.seq + i) * c.q_heads + q_head) * c.dim);
}

// Bits [0, m) of a tile: the keys below a sliding window's first visible one (m clamped to [0, 64]).
inline uint64_t low_bits(int64_t m) {
  if (m <= 0) return 0;
  return m >= 64 ? ~uint64_t{0} : (uint64_t{1} << m) - 1;
}

// Bit t set iff a query sees new key j0 + t: from a row of the tree mask, or causally (t <= offset = i - j0).
inline uint64_t mask_bits(const bool* row, int n) {
  uint64_t bits = 0;
  for (int t = 0; t < n; ++t) bits |= static_cast<uint64_t>(row[t]) << t;
  return bits;
}

inline uint64_t causal_bits(int64_t offset, int n) {
  const uint64_t tile = n == 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1;
  if (offset < 0) return 0;
  return offset >= 63 ? tile : ((uint64_t{1} << (offset + 1)) - 1) & tile;
}

inline void merge_group(const Call& c, const Group& grp) {
  const int64_t g = c.group_size, dim = c.dim;
  const int64_t rows = (grp.q1 - grp.q0) * g;
  for (int64_t r = 0; r < rows; ++r) {
    float peak = kNegInf;
    for (int sp = 0; sp < grp.splits; ++sp)
      peak = std::max(peak, c.partials[grp.partial + (sp * rows + r) * (dim + 2)]);
    float* out = c.out + head_offset(c, grp.b, grp.q0 + r / g, grp.h * g + r % g);
    std::fill(out, out + dim, 0.0f);
    if (peak == kNegInf) continue;  // this query sees nothing
    float total = 0.0f;
    for (int sp = 0; sp < grp.splits; ++sp) {
      const float* slot = c.partials.data() + grp.partial + (sp * rows + r) * (dim + 2);
      if (slot[0] == kNegInf) continue;
      const float w = std::exp(slot[0] - peak);
      total += slot[1] * w;
      for (int64_t d = 0; d < dim; ++d) out[d] += slot[2 + d] * w;
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t d = 0; d < dim; ++d) out[d] *= inv;
  }
}

inline void plan(Call& c) {
  const int64_t g = c.group_size;
  const int64_t block = std::max<int64_t>(1, kMaxRows / g);
  int64_t groups = 0;
  for (int64_t b = 0; b < c.batch; ++b) groups += c.kv_heads * ((c.length[b] + block - 1) / block);
  int64_t partial = 0;
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t len = c.length[b];
    const int64_t cached = std::min<int64_t>(c.start[b], c.width * c.page_tokens);  // past W nothing is visible
    // Splits cover whole tiles (kSplitTokens or more, a multiple of kTile), so only the last one is ragged.
    int64_t splits = 1, chunk = std::max<int64_t>(cached, 1);
    if (groups < kEnoughGroups && cached > kSplitTokens) {
      chunk = std::max<int64_t>(kSplitTokens, (cached + kMaxSplits - 1) / kMaxSplits);
      chunk = (chunk + kTile - 1) / kTile * kTile;
      splits = (cached + chunk - 1) / chunk;
    }
    for (int64_t h = 0; h < c.kv_heads; ++h) {
      for (int64_t q0 = 0; q0 < len; q0 += block) {
        const int64_t q1 = std::min(len, q0 + block);
        Group grp{static_cast<int32_t>(b), static_cast<int32_t>(h), static_cast<int32_t>(q0),
                  static_cast<int32_t>(q1), static_cast<int32_t>(splits), partial};
        if (splits > 1) partial += splits * (q1 - q0) * g * (c.dim + 2);
        for (int64_t sp = 0; sp < splits; ++sp) {
          c.items.push_back(Item{grp.b, grp.h, grp.q0, grp.q1, static_cast<int32_t>(std::min(cached, sp * chunk)),
                                 static_cast<int32_t>(std::min(cached, (sp + 1) * chunk)), sp == splits - 1,
                                 static_cast<int32_t>(c.groups.size()), static_cast<int32_t>(sp)});
        }
        c.groups.push_back(grp);
      }
    }
  }
  // Threads take items in order, so the longest go first (a long decode row next to a prefill chunk is not
  // left to the end, alone on one thread).
  const auto cost = [&c](const Item& it) {
    const int64_t keys = (it.c1 - it.c0) + (it.with_new ? (c.mask ? c.length[it.b] : it.q1) : 0);
    return keys * (it.q1 - it.q0);
  };
  std::stable_sort(c.items.begin(), c.items.end(), [&cost](const Item& a, const Item& b) { return cost(a) > cost(b); });
  c.partials.assign(static_cast<size_t>(partial), 0.0f);
  c.pending.reset(new std::atomic<int32_t>[c.groups.size()]);
  for (size_t i = 0; i < c.groups.size(); ++i) c.pending[i].store(c.groups[i].splits, std::memory_order_relaxed);
}

// ---- ORT plumbing: the kernel, validation and registration ----

struct Kernel {
  int64_t q_heads, kv_heads, dim, page_tokens;
  int64_t window;
  float scale;
  // PagedAttentionRope only: input 0 is the packed projection [B,S,(Hq+2Hkv)*D] (q, then k, then v of each token)
  // and inputs 1 and 2 repeat it (kvforge/builder/pack_qkv.py), so no Split runs between the matmul and the attention.
  int64_t packed_qkv;
};

inline OrtStatus* error(const std::string& message) {
  return g_api->CreateStatus(ORT_INVALID_ARGUMENT, ("kvforge.cpu.PagedAttention: " + message).c_str());
}

#define KVF_TRY(expr)                     \
  do {                                    \
    if (OrtStatus* _st = (expr)) return _st; \
  } while (0)

struct TensorInfo {
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<int64_t> shape;
};

inline OrtStatus* describe(const OrtValue* value, TensorInfo* info) {
  OrtTensorTypeAndShapeInfo* raw = nullptr;
  KVF_TRY(g_api->GetTensorTypeAndShape(value, &raw));
  size_t rank = 0;
  OrtStatus* st = g_api->GetTensorElementType(raw, &info->type);
  if (!st) st = g_api->GetDimensionsCount(raw, &rank);
  if (!st) {
    info->shape.resize(rank);
    st = g_api->GetDimensions(raw, info->shape.data(), rank);
  }
  g_api->ReleaseTensorTypeAndShapeInfo(raw);
  return st;
}

inline std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? "," : "") + std::to_string(shape[i]);
  return text + "]";
}

inline OrtStatus* expect(const char* name, const TensorInfo& info, ONNXTensorElementDataType type,
                  const std::vector<int64_t>& shape) {
  if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED && info.type != type)
    return error(std::string(name) + " has element type " + std::to_string(info.type) + ", expected " +
                 std::to_string(type));
  bool same = info.shape.size() == shape.size();
  for (size_t i = 0; same && i < shape.size(); ++i) same = shape[i] < 0 || info.shape[i] == shape[i];
  if (!same)
    return error(std::string(name) + " has shape " + shape_text(info.shape) + ", expected " + shape_text(shape) +
                 " (-1: any)");
  return nullptr;
}

inline OrtStatus* input(OrtKernelContext* ctx, size_t index, const OrtValue** value, TensorInfo* info, const void** data) {
  KVF_TRY(g_api->KernelContext_GetInput(ctx, index, value));
  if (!*value) return nullptr;
  KVF_TRY(describe(*value, info));
  return g_api->GetTensorData(*value, data);
}

// `writes`: PagedAttentionRope also writes positions start..start+len-1, so their pages are checked too.
inline OrtStatus* check_values(const Call& c, bool writes = false) {
  for (int64_t b = 0; b < c.batch; ++b) {
    if (c.length[b] < 0 || c.length[b] > c.seq)
      return error("context_lengths[" + std::to_string(b) + "]=" + std::to_string(c.length[b]) +
                   " is outside [0, S=" + std::to_string(c.seq) + "]");
    if (c.start[b] < 0) return error("kvcache_start_index[" + std::to_string(b) + "] is negative");
    const int64_t extent = static_cast<int64_t>(c.start[b]) + (writes ? c.length[b] : 0);
    const int64_t pages = (extent + c.page_tokens - 1) / c.page_tokens;
    const int64_t used = std::min<int64_t>(c.width, pages);  // entries past the cached positions are not read
    for (int64_t w = 0; w < used; ++w) {
      const int32_t page = c.page_table[b * c.width + w];
      if (page < -1 || page >= c.num_pages)
        return error("kv_page_table[" + std::to_string(b) + "," + std::to_string(w) + "]=" + std::to_string(page) +
                     " is outside [-1, num_pages=" + std::to_string(c.num_pages) + ")");
    }
  }
  return nullptr;
}

// The inputs of a call (`count` of them, up to N read), the first `required` present.
template <size_t N>
inline OrtStatus* read_inputs(OrtKernelContext* ctx, size_t required, const char* op, size_t& count,
                       const OrtValue* (&v)[N], TensorInfo (&info)[N], const void* (&data)[N]) {
  count = 0;
  KVF_TRY(g_api->KernelContext_GetInputCount(ctx, &count));
  if (count < required)
    return error(std::string(op) + "needs at least " + std::to_string(required) + " inputs, got " +
                 std::to_string(count));
  for (size_t i = 0; i < std::min<size_t>(count, N); ++i) KVF_TRY(input(ctx, i, &v[i], &info[i], &data[i]));
  for (size_t i = 0; i < required; ++i)
    if (!v[i]) return error("input " + std::to_string(i) + " is missing");
  return nullptr;
}

// The query's batch geometry and the kernel's head layout, into `c`.
inline OrtStatus* query_geometry(const Kernel& k, const TensorInfo& query, Call& c) {
  if (query.shape.size() != 3) return error("query must be [B,S,Hq*D], got " + shape_text(query.shape));
  c.batch = query.shape[0];
  c.seq = query.shape[1];
  c.q_heads = k.q_heads, c.kv_heads = k.kv_heads, c.dim = k.dim, c.page_tokens = k.page_tokens;
  c.group_size = k.q_heads / k.kv_heads;
  c.window = k.window;
  c.scale = k.scale;
  return nullptr;
}

// paged_attention.cc: the attention of a gathered call into c.out (the items on ORT's pool, the best target's
// kernel), PagedAttention's OrtCustomOp (PagedAttentionRope starts from it) and its output shape.
OrtStatus* attend(OrtKernelContext* ctx, Call& c);
OrtCustomOp make_op();
OrtStatus* ORT_API_CALL infer_shape(const OrtCustomOp* op, OrtShapeInferContext* ctx);  // the query's shape

}  // namespace kvforge_attention
