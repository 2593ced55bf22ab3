// The attention mass output of PagedAttentionRope (issue 53, `--documentRepair attention`): for a watched sequence,
// the softmax probabilities its question rows give each cached position, summed over query heads and layers, so the
// runtime can tell which document the question reads. Armed and read from Python by ctypes
// (kvforge/plugins/attention_mass.py), like kvforge_rotate_keys; PagedAttentionRope asks `attention_mass_armed()`
// (one relaxed atomic load) after its attention and runs `add_attention_mass` only when a watch is armed.
//
// A watch names its sequence by a page of it: the page at `page_index` of the row's page table, the page holding
// the first question position, which only that sequence holds (it lies past the sequence's exact prefix, so it is
// never shared). Rows of a call whose table has that page there are watched; their query positions from
// `query_from` on add their probabilities into the watch's buffer [positions].
//
// The pass is separate from the attention kernel (paged_attention.cc) and plain: scores over each watched row's
// visible positions (the cached ones through the page table, the call's new rows causally or through the tree
// mask, within a sliding window), softmax, p added. One work item per (watch, row, kv head) on ORT's intra-op
// pool, each into its own partial buffer; the partials are added in item order after, so the sums do not race and
// do not depend on the thread count. Compiled per target (Highway's foreach_target; KVFORGE_CPU_TARGET forces one):
// the scores of four queries at a time against keys transposed to [dim][keys], and vector_exp.h's Exp; the rest is
// scalar. The numpy reference is reference.attention_mass.

#ifndef KVFORGE_ATTENTION_MASS_COMMON
#define KVFORGE_ATTENTION_MASS_COMMON
#include "attention.h"

#include <mutex>
#endif  // KVFORGE_ATTENTION_MASS_COMMON

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention_mass.cc"
#include <hwy/foreach_target.h>  // re-includes this file once per target
#include <hwy/highway.h>

#include "vector_exp.h"

HWY_BEFORE_NAMESPACE();
namespace kvforge_attention {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// out[i * keys + t] = scale * sum_j q[i][j] * kt[j * keys + t] for the 4 queries (duplicates fill a short block).
void MassScores(const float* const* q, const float* kt, int64_t keys, int64_t dim, float scale, float* out) {
  const hn::ScalableTag<float> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  int64_t t = 0;
  for (; t + lanes <= keys; t += lanes) {
    auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
    for (int64_t j = 0; j < dim; ++j) {
      const auto k = hn::LoadU(d, kt + j * keys + t);
      a0 = hn::MulAdd(hn::Set(d, q[0][j]), k, a0);
      a1 = hn::MulAdd(hn::Set(d, q[1][j]), k, a1);
      a2 = hn::MulAdd(hn::Set(d, q[2][j]), k, a2);
      a3 = hn::MulAdd(hn::Set(d, q[3][j]), k, a3);
    }
    const auto s = hn::Set(d, scale);
    hn::StoreU(hn::Mul(a0, s), d, out + t);
    hn::StoreU(hn::Mul(a1, s), d, out + keys + t);
    hn::StoreU(hn::Mul(a2, s), d, out + 2 * keys + t);
    hn::StoreU(hn::Mul(a3, s), d, out + 3 * keys + t);
  }
  for (; t < keys; ++t) {
    for (int i = 0; i < 4; ++i) {
      float acc = 0.0f;
      for (int64_t j = 0; j < dim; ++j) acc += q[i][j] * kt[j * keys + t];
      out[i * keys + t] = acc * scale;
    }
  }
}

// x[t] = exp(x[t] - peak) in place over [0, n): -inf (an invisible position) gives 0.
void MassExp(float* x, int64_t n, float peak) {
  const hn::ScalableTag<float> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const auto p = hn::Set(d, peak);
  int64_t t = 0;
  for (; t + lanes <= n; t += lanes)
    hn::StoreU(kvforge_simd::HWY_NAMESPACE::Exp(d, hn::Sub(hn::LoadU(d, x + t), p)), d, x + t);
  for (; t < n; ++t) x[t] = std::exp(x[t] - peak);
}

}  // namespace HWY_NAMESPACE
}  // namespace kvforge_attention
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvforge_attention {

HWY_EXPORT(MassScores);
HWY_EXPORT(MassExp);

namespace {

struct MassWatch {
  float* mass = nullptr;  // [positions], owned by the caller until disarmed
  int64_t positions = 0;
  int32_t page = -1;
  int64_t page_index = 0;
  int64_t query_from = 0;
  int64_t rows = 0;  // query rows (per layer call, per query head) added so far
};

constexpr int kMaxWatches = 256;
std::mutex g_mass_mutex;
MassWatch g_watches[kMaxWatches];
std::atomic<int32_t> g_armed{0};

struct MassItem {
  int watch;
  int64_t b, kv_head, first_row;
};

struct MassCall {
  const Call* c;
  std::vector<MassItem> items;
  std::vector<int64_t> offsets;  // each item's partial: offsets[i] floats into partials
  std::vector<float> partials;
  const MassWatch* watches;
};

// A cached key of row b at position t, decoded; false when the position has no page (invisible).
bool cached_key(const Call& c, int64_t b, int64_t head, int64_t t, float* out) {
  const int64_t index = t / c.page_tokens;
  const int32_t page = index < c.width ? c.page_table[b * c.width + index] : -1;
  if (page < 0) return false;
  const size_t at = pool_offset(c, page, 0, head, t % c.page_tokens);
  switch (c.pool_type) {
    case PoolType::kF32:
      std::memcpy(out, static_cast<const float*>(c.pool) + at, sizeof(float) * c.dim);
      break;
    case PoolType::kF16:
      for (int64_t d = 0; d < c.dim; ++d) out[d] = half_to_float(static_cast<const uint16_t*>(c.pool)[at + d]);
      break;
    case PoolType::kFp8:
      for (int64_t d = 0; d < c.dim; ++d) out[d] = g_fp8_table[static_cast<const uint8_t*>(c.pool)[at + d]];
      break;
  }
  return true;
}

void run_mass_item(const MassCall& m, size_t index) {
  const Call& c = *m.c;
  const MassItem& it = m.items[index];
  const MassWatch& w = m.watches[it.watch];
  float* partial = const_cast<float*>(m.partials.data()) + m.offsets[index];
  const int64_t b = it.b, start = c.start[b], length = c.length[b], dim = c.dim;
  const int64_t keys = start + length;
  // Keys of this kv head transposed, [dim][keys], so a row's scores are one contiguous loop per dim; `seen` marks
  // the cached positions that have a page.
  std::vector<float> kt(static_cast<size_t>(dim * keys), 0.0f);
  std::vector<char> has_page(static_cast<size_t>(keys), 1);
  std::vector<float> row(static_cast<size_t>(dim));
  for (int64_t t = 0; t < keys; ++t) {
    if (t < start) {
      has_page[t] = cached_key(c, b, it.kv_head, t, row.data());
      if (!has_page[t]) continue;
    } else {  // the call's own rows, as attention reads them (rounded through the storage type)
      std::memcpy(row.data(), c.new_kv + (((b * c.seq + (t - start)) * 2 + 0) * c.kv_heads + it.kv_head) * dim,
                  sizeof(float) * dim);
    }
    for (int64_t d = 0; d < dim; ++d) kt[d * keys + t] = row[d];
  }
  // The (row, query head) pairs of this kv head, four at a time: their scores, then each one's softmax.
  std::vector<std::pair<int64_t, int64_t>> queries;
  for (int64_t i = it.first_row; i < length; ++i)
    for (int64_t g = 0; g < c.group_size; ++g) queries.emplace_back(i, g);
  std::vector<float> scores(static_cast<size_t>(4 * keys));
  for (size_t block = 0; block < queries.size(); block += 4) {
    const size_t count = std::min<size_t>(4, queries.size() - block);
    const float* q[4];
    for (size_t k = 0; k < 4; ++k) {
      const auto& [i, g] = queries[block + std::min(k, count - 1)];
      q[k] = c.query + head_offset(c, b, i, it.kv_head * c.group_size + g);
    }
    HWY_DYNAMIC_DISPATCH(MassScores)(q, kt.data(), keys, dim, c.scale, scores.data());
    for (size_t k = 0; k < count; ++k) {
      const int64_t i = queries[block + k].first, position = start + i;
      const int64_t first = c.window > 0 ? std::max<int64_t>(0, position - c.window + 1) : 0;
      float* s = scores.data() + k * keys;
      float peak = kNegInf;
      for (int64_t t = 0; t < keys; ++t) {
        const bool visible = t >= first && (t < start ? has_page[t] != 0
                                            : (c.mask ? c.mask[(b * c.seq + i) * c.seq + (t - start)] : t <= position));
        s[t] = visible ? s[t] : kNegInf;
        peak = std::max(peak, s[t]);
      }
      if (peak == kNegInf) continue;
      HWY_DYNAMIC_DISPATCH(MassExp)(s, keys, peak);
      float total = 0.0f;
      for (int64_t t = 0; t < keys; ++t) total += s[t];
      const float inv = 1.0f / total;
      const int64_t upto = std::min(keys, w.positions);
      for (int64_t t = 0; t < upto; ++t) partial[t] += s[t] * inv;
    }
  }
}

void run_mass_trampoline(void* data, size_t index) { run_mass_item(*static_cast<const MassCall*>(data), index); }

}  // namespace

bool attention_mass_armed() { return g_armed.load(std::memory_order_relaxed) != 0; }

// Adds this call's probabilities into every watch one of its rows matches (after PagedAttentionRope's attention:
// c.query holds the rotated queries, c.new_kv the call's rounded rows, the pool the cached ones).
OrtStatus* add_attention_mass(OrtKernelContext* ctx, const Call& c) {
  std::lock_guard<std::mutex> lock(g_mass_mutex);
  MassCall m;
  m.c = &c;
  m.watches = g_watches;
  for (int w = 0; w < kMaxWatches; ++w) {
    const MassWatch& watch = g_watches[w];
    if (!watch.mass || watch.page_index >= c.width) continue;
    for (int64_t b = 0; b < c.batch; ++b) {
      if (c.page_table[b * c.width + watch.page_index] != watch.page) continue;
      const int64_t first_row = std::max<int64_t>(0, watch.query_from - c.start[b]);
      if (first_row >= c.length[b]) continue;
      for (int64_t h = 0; h < c.kv_heads; ++h) {
        m.items.push_back(MassItem{w, b, h, first_row});
        m.offsets.push_back(0);
      }
    }
  }
  if (m.items.empty()) return nullptr;
  int64_t total = 0;
  for (size_t i = 0; i < m.items.size(); ++i) {
    m.offsets[i] = total;
    total += g_watches[m.items[i].watch].positions;
  }
  m.partials.assign(static_cast<size_t>(total), 0.0f);
  KVF_TRY(g_api->KernelContext_ParallelFor(ctx, run_mass_trampoline, m.items.size(), 0, &m));
  for (size_t i = 0; i < m.items.size(); ++i) {  // in item order: the same sums on any thread count
    MassWatch& watch = g_watches[m.items[i].watch];
    const float* partial = m.partials.data() + m.offsets[i];
    for (int64_t t = 0; t < watch.positions; ++t) watch.mass[t] += partial[t];
    watch.rows += (c.length[m.items[i].b] - m.items[i].first_row) * c.group_size;
  }
  return nullptr;
}

}  // namespace kvforge_attention

// Arm a watch: `mass` [positions] float32, zeroed by the caller and kept alive until disarmed, receives the
// probabilities of the query rows at positions >= query_from of the rows whose page table holds `page` at index
// `page_index`. Returns the watch's id (>= 0), or -1 when the arguments are refused or every watch is taken.
extern "C" __attribute__((visibility("default"))) int kvforge_attention_mass_arm(float* mass, int64_t positions,
                                                                                 int32_t page, int64_t page_index,
                                                                                 int64_t query_from) {
  using namespace kvforge_attention;
  if (!mass || positions <= 0 || page < 0 || page_index < 0 || query_from < 0) return -1;
  ensure_fp8_table();
  std::lock_guard<std::mutex> lock(g_mass_mutex);
  for (int w = 0; w < kMaxWatches; ++w) {
    if (g_watches[w].mass) continue;
    g_watches[w] = MassWatch{mass, positions, page, page_index, query_from, 0};
    g_armed.fetch_add(1, std::memory_order_relaxed);
    return w;
  }
  return -1;
}

// Disarm watch `id`: its buffer is no longer written. Returns the query rows it summed (each row once per query
// head and layer call: the buffer's total is about that count), or -1 for an id not armed.
extern "C" __attribute__((visibility("default"))) int64_t kvforge_attention_mass_disarm(int id) {
  using namespace kvforge_attention;
  std::lock_guard<std::mutex> lock(g_mass_mutex);
  if (id < 0 || id >= kMaxWatches || !g_watches[id].mass) return -1;
  const int64_t rows = g_watches[id].rows;
  g_watches[id] = MassWatch{};
  g_armed.fetch_sub(1, std::memory_order_relaxed);
  return rows;
}

#endif  // HWY_ONCE
