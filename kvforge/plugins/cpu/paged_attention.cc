// kvforge.cpu.PagedAttention: an ONNX Runtime CPU custom op that reads the paged KV pool in place.
//
// The contract is kvforge/plugins/ops.py CPU_PAGED_ATTENTION; the semantics are kvforge/plugins/reference.py
// paged_attention_rows. The library links no libonnxruntime: RegisterCustomOps receives the API table.
//
// Work is cut into items (row b, kv head h, block of queries, split of the cached range), run on ORT's
// intra-op pool (KernelContext_ParallelFor), longest first. An item streams its K/V through tiles of up to
// kTile positions, read through the page table straight from the pool (fp16, fp8 or fp32 pages) or from the
// new rows, and each tile serves every query row of the item: the block's queries times the whole GQA group.
// Decode and verify rows (every item on targets without AVX-512) take the direct path: each register block of
// rows decodes K and V inside its FMA loops, the first block from memory and the rest from L1, and one reduction
// tree per 16 (AVX2: 8) tokens sums a row's dot products; a row's arithmetic does not depend on the rows beside it,
// so a verify row is its decode row bit for bit. AVX-512 prefill blocks (more than kDirectQueries queries) decode K
// once into a transposed float32 tile, so q.K^T is broadcast FMAs with no horizontal sums, and stage V once. Each
// item keeps an online softmax (max, sum, acc) per row; when the cached range is split across threads (decode,
// verify), the last split of a group to finish merges the partials (flash decoding).
//
// Compiled per target (Highway's foreach_target; cpu_target.h says which runs): AVX-512 keeps its intrinsics (16-lane
// tiles, a transposing decode of K, a shuffle tree per 16 tokens), every other target (AVX2, SSE4, NEON,
// scalar) runs one Highway source over N <= 16 lanes: fp16 and fp8 rows decoded a vector at a time (PromoteTo,
// F16C on AVX2), an hadd tree (AVX2) or Highway lane sums, vector_exp.h's Exp. Results are exact within a target,
// not across targets.

#ifndef KVFORGE_ATTENTION_COMMON
#define KVFORGE_ATTENTION_COMMON
// gcc 12 reports its own _mm512_undefined_ps() (inside the shuffle intrinsics) as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "attention.h"
#endif  // KVFORGE_ATTENTION_COMMON

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "paged_attention.cc"
#include <hwy/foreach_target.h>  // re-includes this file once per target
#include <hwy/highway.h>

#include "vector_exp.h"

HWY_BEFORE_NAMESPACE();
namespace kvforge_attention {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#undef KVF_AVX512
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
#define KVF_AVX512 1  // Highway has included <immintrin.h>
#else
#define KVF_AVX512 0
#endif

// ---- decoding stored K/V elements into float32 ----

#if KVF_AVX512
// 16 consecutive elements of a stored row as float32 lanes.
inline __m512 decode16(const float* src) { return _mm512_loadu_ps(src); }
inline __m512 decode16(const uint16_t* src) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}
// E4M3 by bit arithmetic (a gather from the table costs a load per lane): a normal e.m byte is the float32
// with exponent e - 7 + 127 and the top mantissa bits m; a subnormal (e = 0) is m * 2^-9; NaN (0x7F) reads 0.
inline __m512 decode16(const uint8_t* src) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m512i magnitude = _mm512_and_si512(bytes, _mm512_set1_epi32(0x7F));
  const __m512 normal = _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_slli_epi32(magnitude, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(magnitude), _mm512_set1_ps(1.0f / 512.0f));
  const __mmask16 is_subnormal = _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32(8));
  const __mmask16 is_nan = _mm512_cmpeq_epi32_mask(magnitude, _mm512_set1_epi32(0x7F));
  const __m512 value = _mm512_maskz_mov_ps(static_cast<__mmask16>(~is_nan),
                                           _mm512_mask_blend_ps(is_subnormal, normal, subnormal));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign));
}

// One stored row of head_dim elements as float32 (a prefill block's staged V tile).
template <typename E>
void decode_row(const E* src, float* dst, int dim) {
  for (int d = 0; d < dim; d += 16) _mm512_storeu_ps(dst + d, decode16(src + d));
}
#endif


#if !KVF_AVX512
// Every other target: N = 4, 8 or 16 float lanes (head widths are multiples of 16), one Highway source.
using DF = hn::CappedTag<float, 16>;
using VF = hn::Vec<DF>;
HWY_INLINE VF load_f(DF d, const float* src) { return hn::LoadU(d, src); }
// fp16 by Highway's PromoteTo (F16C's vcvtph2ps on AVX2), never a scalar conversion per element.
HWY_INLINE VF load_f(DF d, const uint16_t* src) {
  const hn::Rebind<hwy::float16_t, DF> dh;
  return hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(src)));
}
// E4M3 by the AVX-512 path's bit arithmetic (see decode16 above).
HWY_INLINE VF load_f(DF d, const uint8_t* src) {
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint8_t, DF> d8;
  const auto bytes = hn::PromoteTo(di, hn::LoadU(d8, src));
  const auto magnitude = hn::And(bytes, hn::Set(di, 0x7F));
  const auto normal = hn::BitCast(d, hn::Add(hn::ShiftLeft<20>(magnitude), hn::Set(di, 120 << 23)));
  const auto subnormal = hn::Mul(hn::ConvertTo(d, magnitude), hn::Set(d, 1.0f / 512.0f));
  const auto is_subnormal = hn::RebindMask(d, hn::Lt(magnitude, hn::Set(di, 8)));
  const auto is_nan = hn::RebindMask(d, hn::Eq(magnitude, hn::Set(di, 0x7F)));
  const auto value = hn::IfThenZeroElse(is_nan, hn::IfThenElse(is_subnormal, subnormal, normal));
  const auto sign = hn::ShiftLeft<24>(hn::And(bytes, hn::Set(di, 0x80)));
  return hn::BitCast(d, hn::Or(hn::BitCast(di, value), sign));
}

// The mask of lanes j*N..j*N+N-1 of a tile's visibility bits.
HWY_INLINE hn::Mask<DF> lanes_seen(DF d, uint64_t seen, int j) {
  const hn::RebindToUnsigned<DF> du;
  alignas(64) static constexpr uint32_t kBit[16] = {1u << 0, 1u << 1, 1u << 2, 1u << 3, 1u << 4, 1u << 5,
                                                     1u << 6, 1u << 7, 1u << 8, 1u << 9, 1u << 10, 1u << 11,
                                                     1u << 12, 1u << 13, 1u << 14, 1u << 15};
  const int N = static_cast<int>(hn::Lanes(d));
  const uint32_t chunk = static_cast<uint32_t>((seen >> (N * j)) & ((uint64_t{1} << N) - 1));
  const auto bits = hn::And(hn::Set(du, chunk), hn::LoadU(du, kBit));
  return hn::RebindMask(d, hn::Ne(bits, hn::Zero(du)));
}
#endif

// ---- per-thread scratch of one item ----

struct Scratch {
  std::vector<float> q, kt, vf, scores, probs, acc, max, sum, alpha, old_max, tile_sum;
  std::vector<uint64_t> visible;
  bool direct = true;  // this item's tiles take the direct path (attend_tile)

  void reserve(int rows, int dim) {
    const size_t padded = static_cast<size_t>((rows + kRowBlock - 1) / kRowBlock * kRowBlock);
    q.assign(padded * dim, 0.0f);
    kt.resize(static_cast<size_t>(kTile) * dim);
    vf.resize(static_cast<size_t>(kTile) * dim);
    scores.resize(padded * kTile);
    probs.assign(padded * kTile, 0.0f);  // padding rows stay 0
    acc.assign(padded * dim, 0.0f);
    max.assign(padded, kNegInf);
    sum.assign(padded, 0.0f);
    alpha.assign(padded, 1.0f);
    old_max.resize(padded);
    tile_sum.resize(padded);
    visible.assign(padded, 0);
  }
};

#if KVF_AVX512
// kt[d][t] = key t's element d, decoded straight from its stored row, for t < n; zeros for the rest of the
// 16-blocks the scores read. Transposed so q.K^T is broadcast FMAs over 16 tokens at once.
template <typename E>
void load_keys_transposed(const E* const* keys, int n, int dim, float* kt) {
  const int blocks = (n + 15) / 16;
  for (int tb = 0; tb < blocks; ++tb) {
    for (int d0 = 0; d0 < dim; d0 += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        const int t = tb * 16 + i;
        r[i] = t < n ? decode16(keys[t] + d0) : _mm512_setzero_ps();
      }
      __m512 t2[16];
      for (int i = 0; i < 8; ++i) {
        t2[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t2[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
      }
      __m512 u[16];  // u[4i+j], 128-bit lane L: column 4L+j of rows 4i..4i+3
      for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(t2[4 * i]), b = _mm512_castps_pd(t2[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t2[4 * i + 2]), e = _mm512_castps_pd(t2[4 * i + 3]);
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
      }
      for (int j = 0; j < 4; ++j) {
        const __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44);
        const __m512 v1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
        const __m512 v2 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xEE);
        const __m512 v3 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xEE);
        float* base = kt + tb * 16;
        _mm512_storeu_ps(base + static_cast<size_t>(d0 + j) * kTile, _mm512_shuffle_f32x4(v0, v1, 0x88));
        _mm512_storeu_ps(base + static_cast<size_t>(d0 + 4 + j) * kTile, _mm512_shuffle_f32x4(v0, v1, 0xDD));
        _mm512_storeu_ps(base + static_cast<size_t>(d0 + 8 + j) * kTile, _mm512_shuffle_f32x4(v2, v3, 0x88));
        _mm512_storeu_ps(base + static_cast<size_t>(d0 + 12 + j) * kTile, _mm512_shuffle_f32x4(v2, v3, 0xDD));
      }
    }
  }
}

using kvforge_simd::HWY_NAMESPACE::exp512;

// RB rows (<= kRowBlock) against NB 16-token blocks: RB x NB accumulators stay in registers over the dims.
template <int RB, int NB>
void scores_block(const float* q, int dim, const float* kt, float* scores) {
  __m512 acc[RB][NB];
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int d = 0; d < dim; ++d) {
    __m512 k[NB];
    for (int j = 0; j < NB; ++j) k[j] = _mm512_loadu_ps(kt + static_cast<size_t>(d) * kTile + 16 * j);
    for (int i = 0; i < RB; ++i) {
      const __m512 qb = _mm512_set1_ps(q[static_cast<size_t>(i) * dim + d]);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(qb, k[j], acc[i][j]);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(scores + i * kTile + 16 * j, acc[i][j]);
}

// RB rows x NV 16-dim vectors of the accumulators stay in registers over the tile's tokens; V rows are read
// through pointers, either straight from the pool (decoded in the FMA loop) or from the staged float32 tile.
template <typename V, int RB, int NV>
void pv_block(const float* probs, const float* alpha, const V* const* vrows, int n, int dim, int d0, float* acc) {
  __m512 a[RB][NV];
  for (int i = 0; i < RB; ++i) {
    const __m512 scale = _mm512_set1_ps(alpha[i]);
    const float* row = acc + static_cast<size_t>(i) * dim + d0;
    for (int k = 0; k < NV; ++k) a[i][k] = _mm512_mul_ps(_mm512_loadu_ps(row + 16 * k), scale);
  }
  for (int t = 0; t < n; ++t) {
    __m512 v[NV];
    for (int k = 0; k < NV; ++k) v[k] = decode16(vrows[t] + d0 + 16 * k);
    for (int i = 0; i < RB; ++i) {
      const __m512 p = _mm512_set1_ps(probs[i * kTile + t]);
      for (int k = 0; k < NV; ++k) a[i][k] = _mm512_fmadd_ps(p, v[k], a[i][k]);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int k = 0; k < NV; ++k) _mm512_storeu_ps(acc + static_cast<size_t>(i) * dim + d0 + 16 * k, a[i][k]);
}

template <int RB>
void scores_rows(const float* q, int dim, const float* kt, float* out, int blocks) {
  switch (blocks) {
    case 1: scores_block<RB, 1>(q, dim, kt, out); break;
    case 2: scores_block<RB, 2>(q, dim, kt, out); break;
    case 3: scores_block<RB, 3>(q, dim, kt, out); break;
    default: scores_block<RB, 4>(q, dim, kt, out); break;
  }
}

template <typename V, int RB>
void pv_rows(const float* probs, const float* alpha, const V* const* vrows, int n, int dim, int d0, float* acc,
             int vectors) {
  switch (vectors) {
    case 1: pv_block<V, RB, 1>(probs, alpha, vrows, n, dim, d0, acc); break;
    case 2: pv_block<V, RB, 2>(probs, alpha, vrows, n, dim, d0, acc); break;
    case 3: pv_block<V, RB, 3>(probs, alpha, vrows, n, dim, d0, acc); break;
    default: pv_block<V, RB, 4>(probs, alpha, vrows, n, dim, d0, acc); break;
  }
}

// Lane t of the result = the horizontal sum of v[t]: a reduction tree whose shuffles also put token t in lane t.
inline __m512 reduce16(const __m512 v[16]) {
  __m512 w[8], u[4];
  for (int i = 0; i < 8; ++i)  // 128-bit lane: [t0, t1, t0, t1] partials of tokens 2i, 2i+1
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {  // 128-bit lane: tokens 4j..4j+3, each summed over that lane's 4 elements
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(w[2 * j]), _mm512_castps_pd(w[2 * j + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(w[2 * j]), _mm512_castps_pd(w[2 * j + 1]));
    u[j] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  const __m512 g01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
  const __m512 g23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(g01, g23, 0x88), _mm512_shuffle_f32x4(g01, g23, 0xDD));
}

// Scores of a few rows (decode: one GQA group) straight from the stored keys: each key row is decoded once and
// dotted with every row, and one reduction tree per row and 16 tokens replaces transposing the tile.
template <typename E, int RB>
void scores_direct(const float* q, int dim, const E* const* keys, int n, float* scores) {
  for (int t0 = 0; t0 < n; t0 += 16) {
    __m512 part[RB][16];
    for (int t = 0; t < 16; ++t) {
      __m512 acc[RB];
      for (int i = 0; i < RB; ++i) acc[i] = _mm512_setzero_ps();
      if (t0 + t < n) {
        for (int d = 0; d < dim; d += 16) {
          const __m512 k = decode16(keys[t0 + t] + d);
          for (int i = 0; i < RB; ++i)
            acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + static_cast<size_t>(i) * dim + d), k, acc[i]);
        }
      }
      for (int i = 0; i < RB; ++i) part[i][t] = acc[i];
    }
    for (int i = 0; i < RB; ++i) _mm512_storeu_ps(scores + i * kTile + t0, reduce16(part[i]));
  }
}

#else
#if HWY_TARGET == HWY_AVX2
// Lane t of the result = the horizontal sum of v[t]: 8 tokens' dot products in one hadd tree (reduce16's AVX2 form).
inline __m256 reduce8(const __m256 v[8]) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 ce = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, ce, 0x20), _mm256_permute2f128_ps(ab, ce, 0x31));
}

// Scores of a few rows (decode) straight from the stored keys: each key row decoded once (8 lanes at a time, F16C
// for fp16) and dotted with every row; one hadd tree per row and 8 tokens.
template <typename E, int RB>
void scores_direct(const float* q, int dim, const E* const* keys, int n, float* scores) {
  const DF d;
  for (int t0 = 0; t0 < n; t0 += 8) {
    __m256 part[RB][8];
    for (int t = 0; t < 8; ++t) {
      VF acc[RB];
      for (int i = 0; i < RB; ++i) acc[i] = hn::Zero(d);
      if (t0 + t < n) {
        const E* key = keys[t0 + t];
        for (int x = 0; x < dim; x += 8) {
          const VF k = load_f(d, key + x);
          for (int i = 0; i < RB; ++i)
            acc[i] = hn::MulAdd(hn::LoadU(d, q + static_cast<size_t>(i) * dim + x), k, acc[i]);
        }
      }
      for (int i = 0; i < RB; ++i) part[i][t] = acc[i].raw;
    }
    for (int i = 0; i < RB; ++i) _mm256_storeu_ps(scores + i * kTile + t0, reduce8(part[i]));
  }
  for (int t = (n + 7) / 8 * 8; t < (n + 15) / 16 * 16; ++t)  // the rest of the last 16-block reads as 0
    for (int i = 0; i < RB; ++i) scores[i * kTile + t] = 0.0f;
}
#else
// Scores of a few rows (decode) straight from the stored keys: each key row decoded once (N lanes at a time) and
// dotted with every row, one Highway lane sum per row and token.
template <typename E, int RB>
void scores_direct(const float* q, int dim, const E* const* keys, int n, float* scores) {
  const DF d;
  const int N = static_cast<int>(hn::Lanes(d));
  const int padded = (n + 15) / 16 * 16;
  for (int t = 0; t < padded; ++t) {
    if (t >= n) {
      for (int i = 0; i < RB; ++i) scores[i * kTile + t] = 0.0f;
      continue;
    }
    VF acc[RB];
    for (int i = 0; i < RB; ++i) acc[i] = hn::Zero(d);
    const E* key = keys[t];
    for (int x = 0; x < dim; x += N) {
      const VF k = load_f(d, key + x);
      for (int i = 0; i < RB; ++i) acc[i] = hn::MulAdd(hn::LoadU(d, q + static_cast<size_t>(i) * dim + x), k, acc[i]);
    }
    for (int i = 0; i < RB; ++i) scores[i * kTile + t] = hn::GetLane(hn::SumOfLanes(d, acc[i]));
  }
}

#endif

// RB rows x NV vectors of the accumulators in registers over the tile's tokens (V read from the pool or staged).
template <typename V, int RB, int NV>
void pv_block(const float* probs, const float* alpha, const V* const* vrows, int n, int dim, int d0, float* acc) {
  const DF d;
  const int N = static_cast<int>(hn::Lanes(d));
  VF a[RB][NV];
  for (int i = 0; i < RB; ++i) {
    const VF scale = hn::Set(d, alpha[i]);
    const float* row = acc + static_cast<size_t>(i) * dim + d0;
    for (int k = 0; k < NV; ++k) a[i][k] = hn::Mul(hn::LoadU(d, row + N * k), scale);
  }
  for (int t = 0; t < n; ++t) {
    VF v[NV];
    for (int k = 0; k < NV; ++k) v[k] = load_f(d, vrows[t] + d0 + N * k);
    for (int i = 0; i < RB; ++i) {
      const VF p = hn::Set(d, probs[i * kTile + t]);
      for (int k = 0; k < NV; ++k) a[i][k] = hn::MulAdd(p, v[k], a[i][k]);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int k = 0; k < NV; ++k) hn::StoreU(a[i][k], d, acc + static_cast<size_t>(i) * dim + d0 + N * k);
}

template <typename V, int RB>
void pv_rows(const float* probs, const float* alpha, const V* const* vrows, int n, int dim, int d0, float* acc,
             int vectors) {
  switch (vectors) {
    case 1: pv_block<V, RB, 1>(probs, alpha, vrows, n, dim, d0, acc); break;
    case 2: pv_block<V, RB, 2>(probs, alpha, vrows, n, dim, d0, acc); break;
    case 3: pv_block<V, RB, 3>(probs, alpha, vrows, n, dim, d0, acc); break;
    default: pv_block<V, RB, 4>(probs, alpha, vrows, n, dim, d0, acc); break;
  }
}
#endif

// Scores of every row, a register block of kRowBlock rows at a time, straight from the stored keys. Each row's dot
// products come out of the same FMA chains and reduction tree whatever block it lands in, so a row's scores do not
// depend on how many rows share its item: a verify row's are its decode row's, bit for bit.
template <typename E>
void scores_direct_rows(const Scratch& s, int rows, const E* const* keys, int n, int dim, float* scores) {
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    const float* q = s.q.data() + static_cast<size_t>(r0) * dim;
    float* out = scores + r0 * kTile;
    switch (std::min(kRowBlock, rows - r0)) {
      case 1: scores_direct<E, 1>(q, dim, keys, n, out); break;
      case 2: scores_direct<E, 2>(q, dim, keys, n, out); break;
      case 3: scores_direct<E, 3>(q, dim, keys, n, out); break;
      default: scores_direct<E, kRowBlock>(q, dim, keys, n, out); break;
    }
  }
}

#if KVF_AVX512
// scores[r][t] = q_r . k_t for the (padded) rows and the tile's 16-blocks.
void compute_scores(const Scratch& s, int rows, int n, int dim, float* scores) {
  const int blocks = (n + 15) / 16;
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    const float* q = s.q.data() + static_cast<size_t>(r0) * dim;
    float* out = scores + r0 * kTile;
    switch (std::min(kRowBlock, rows - r0)) {
      case 1: scores_rows<1>(q, dim, s.kt.data(), out, blocks); break;
      case 2: scores_rows<2>(q, dim, s.kt.data(), out, blocks); break;
      case 3: scores_rows<3>(q, dim, s.kt.data(), out, blocks); break;
      default: scores_rows<kRowBlock>(q, dim, s.kt.data(), out, blocks); break;
    }
  }
}
#endif

// Online-softmax step of each row over the tile: new running max, rescale factor, probabilities, sum.
#if KVF_AVX512
void softmax_update(Scratch& s, int rows, int n) {
  const int blocks = (n + 15) / 16;
  float* old = s.old_max.data();
  float* tile_sum = s.tile_sum.data();
  for (int r = 0; r < rows; ++r) {
    const uint64_t seen = s.visible[r];
    float* p = s.probs.data() + r * kTile;
    const float* x = s.scores.data() + r * kTile;
    old[r] = s.max[r];
    if (seen == 0) {  // nothing visible in this tile: the row's state is unchanged
      for (int j = 0; j < blocks; ++j) _mm512_storeu_ps(p + 16 * j, _mm512_setzero_ps());
      tile_sum[r] = 0.0f;
      continue;
    }
    __m512 peak = _mm512_set1_ps(kNegInf);
    for (int j = 0; j < blocks; ++j)
      peak = _mm512_mask_max_ps(peak, static_cast<__mmask16>(seen >> (16 * j)), peak, _mm512_loadu_ps(x + 16 * j));
    const float running = std::max(s.max[r], _mm512_reduce_max_ps(peak));
    const __m512 m = _mm512_set1_ps(running);
    __m512 total = _mm512_setzero_ps();
    for (int j = 0; j < blocks; ++j) {
      const __mmask16 lanes = static_cast<__mmask16>(seen >> (16 * j));
      const __m512 e = _mm512_maskz_mov_ps(lanes, exp512(_mm512_sub_ps(_mm512_loadu_ps(x + 16 * j), m)));
      _mm512_storeu_ps(p + 16 * j, e);
      total = _mm512_add_ps(total, e);
    }
    tile_sum[r] = _mm512_reduce_add_ps(total);
    s.max[r] = running;
  }
  // Rescale factors exp(old - new) for 16 rows at a time; a row that saw nothing before has nothing to rescale.
  for (int r0 = 0; r0 < rows; r0 += 16) {
    const __mmask16 live = static_cast<__mmask16>(rows - r0 >= 16 ? 0xffff : (1u << (rows - r0)) - 1);
    const __m512 before = _mm512_maskz_loadu_ps(live, old + r0);
    const __m512 now = _mm512_maskz_loadu_ps(live, s.max.data() + r0);
    const __mmask16 started = _mm512_mask_cmp_ps_mask(live, before, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ);
    const __m512 alpha = _mm512_maskz_mov_ps(started, exp512(_mm512_sub_ps(before, now)));
    const __m512 sum = _mm512_maskz_loadu_ps(live, s.sum.data() + r0);
    _mm512_mask_storeu_ps(s.alpha.data() + r0, live, alpha);
    _mm512_mask_storeu_ps(s.sum.data() + r0, live,
                          _mm512_fmadd_ps(sum, alpha, _mm512_maskz_loadu_ps(live, tile_sum + r0)));
  }
}
#else
void softmax_update(Scratch& s, int rows, int n) {
  const DF d;
  const int N = static_cast<int>(hn::Lanes(d));
  const int vectors = (n + 15) / 16 * 16 / N;
  for (int r = 0; r < rows; ++r) {
    const uint64_t seen = s.visible[r];
    float* p = s.probs.data() + r * kTile;
    const float* x = s.scores.data() + r * kTile;
    s.old_max[r] = s.max[r];
    if (seen == 0) {  // nothing visible in this tile: the row's state is unchanged
      for (int j = 0; j < vectors; ++j) hn::StoreU(hn::Zero(d), d, p + N * j);
      s.tile_sum[r] = 0.0f;
      continue;
    }
    VF peak = hn::Set(d, kNegInf);
    for (int j = 0; j < vectors; ++j)
      peak = hn::IfThenElse(lanes_seen(d, seen, j), hn::Max(peak, hn::LoadU(d, x + N * j)), peak);
    const float running = std::max(s.max[r], hn::GetLane(hn::MaxOfLanes(d, peak)));
    const VF m = hn::Set(d, running);
    VF total = hn::Zero(d);
    for (int j = 0; j < vectors; ++j) {
      const VF e = hn::IfThenElseZero(lanes_seen(d, seen, j),
                                      kvforge_simd::HWY_NAMESPACE::Exp(d, hn::Sub(hn::LoadU(d, x + N * j), m)));
      hn::StoreU(e, d, p + N * j);
      total = hn::Add(total, e);
    }
    s.tile_sum[r] = hn::GetLane(hn::SumOfLanes(d, total));
    s.max[r] = running;
  }
  // Rescale factors exp(old - new); a row that saw nothing before has nothing to rescale.
  for (int r = 0; r < rows; ++r) {
    const float before = s.old_max[r];
    const float alpha = before == kNegInf ? 0.0f
                                          : hn::GetLane(kvforge_simd::HWY_NAMESPACE::Exp(d, hn::Set(d, before - s.max[r])));
    s.alpha[r] = alpha;
    s.sum[r] = std::fma(s.sum[r], alpha, s.tile_sum[r]);
  }
}
#endif

// acc[r] = acc[r] * alpha[r] + sum_t probs[r][t] * v_t (V read from the pool rows or the staged float32 tile)
template <typename V>
void accumulate_values(Scratch& s, const V* const* vrows, int rows, int n, int dim) {
#if KVF_AVX512
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    const float* p = s.probs.data() + r0 * kTile;
    const float* alpha = s.alpha.data() + r0;
    float* acc = s.acc.data() + static_cast<size_t>(r0) * dim;
    for (int d0 = 0; d0 < dim; d0 += 64) {
      const int vectors = std::min(4, (dim - d0) / 16);
      switch (std::min(kRowBlock, rows - r0)) {
        case 1: pv_rows<V, 1>(p, alpha, vrows, n, dim, d0, acc, vectors); break;
        case 2: pv_rows<V, 2>(p, alpha, vrows, n, dim, d0, acc, vectors); break;
        case 3: pv_rows<V, 3>(p, alpha, vrows, n, dim, d0, acc, vectors); break;
        default: pv_rows<V, kRowBlock>(p, alpha, vrows, n, dim, d0, acc, vectors); break;
      }
    }
  }
#else
  const int N = static_cast<int>(hn::Lanes(DF()));
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    const float* p = s.probs.data() + r0 * kTile;
    const float* alpha = s.alpha.data() + r0;
    float* acc = s.acc.data() + static_cast<size_t>(r0) * dim;
    const int rb = std::min(kRowBlock, rows - r0);
    const int most = rb <= 2 ? 4 : 2;  // accumulators + decoded V within 16 registers
    for (int d0 = 0; d0 < dim;) {
      const int vectors = std::min(most, (dim - d0) / N);
      switch (rb) {
        case 1: pv_rows<V, 1>(p, alpha, vrows, n, dim, d0, acc, vectors); break;
        case 2: pv_rows<V, 2>(p, alpha, vrows, n, dim, d0, acc, vectors); break;
        case 3: pv_rows<V, 3>(p, alpha, vrows, n, dim, d0, acc, vectors); break;
        default: pv_rows<V, kRowBlock>(p, alpha, vrows, n, dim, d0, acc, vectors); break;
      }
      d0 += vectors * N;
    }
  }
#endif
}

// One tile. On the direct path (decode and verify rows; every item on targets without AVX-512) each register block
// of rows reads K and V straight from their rows, decoded inside the FMA loops: the first block brings the tile
// into L1 and the others read it there. A row's arithmetic is then the same whatever block and item it lands in,
// so a verify row is its decode row bit for bit. Otherwise (AVX-512 prefill blocks) K is decoded once into the
// transposed tile and V staged once as float32, and every row of the item is attended over them.
template <typename E>
void attend_tile(Scratch& s, const E* const* keys, const E* const* values, int n, int rows, int dim) {
  if (s.direct) {
    scores_direct_rows<E>(s, rows, keys, n, dim, s.scores.data());
    softmax_update(s, rows, n);
    accumulate_values<E>(s, values, rows, n, dim);
    return;
  }
#if KVF_AVX512
  load_keys_transposed(keys, n, dim, s.kt.data());
  compute_scores(s, rows, n, dim, s.scores.data());
  softmax_update(s, rows, n);
  const float* staged[kTile];
  for (int t = 0; t < n; ++t) {
    staged[t] = s.vf.data() + static_cast<size_t>(t) * dim;
    decode_row(values[t], s.vf.data() + static_cast<size_t>(t) * dim, dim);
  }
  accumulate_values<float>(s, staged, rows, n, dim);
#endif
}

thread_local Scratch t_scratch;

// A tile of an item's cached range: its K and V rows in the pool and their positions.
template <typename E>
struct Tile {
  const E* keys[kTile];
  const E* values[kTile];
  int64_t at[kTile];  // each key's position: pages without an entry are skipped, so not contiguous
  int n = 0;
};

// Fills `tile` with the positions from `pos` on (up to kTile of them, none past it.c1) and returns the position
// after it; a tile with n = 0 means the range is done.
template <typename E>
int64_t fill_tile(const Call& c, const Item& it, int64_t pos, Tile<E>& tile) {
  const E* pool = static_cast<const E*>(c.pool);
  int n = 0;
  while (n < kTile && pos < it.c1) {
    const int64_t index = pos / c.page_tokens;
    const int64_t segment_end = std::min<int64_t>(it.c1, (index + 1) * c.page_tokens);
    const int32_t page = index < c.width ? c.page_table[it.b * c.width + index] : -1;
    if (page < 0) {  // no page: these positions are not visible
      pos = segment_end;
      continue;
    }
    const int64_t take = std::min<int64_t>(segment_end - pos, kTile - n);
    const int64_t slot = pos % c.page_tokens;
    for (int64_t k = 0; k < take; ++k) {
      tile.keys[n + k] = pool + pool_offset(c, page, 0, it.h, slot + k);
      tile.values[n + k] = pool + pool_offset(c, page, 1, it.h, slot + k);
      tile.at[n + k] = pos + k;
    }
    n += static_cast<int>(take);
    pos += take;
  }
  tile.n = n;
  return pos;
}

// Asks for a tile's K and V rows while the tile before it is attended: its pages are scattered through the pool,
// so the hardware prefetcher meets a new stream at every page (16 tokens by default) and starts each one late.
// Measured (cpu_attention's graph, AVX-512, quiet): a decode step at 1,500 tokens 4.1 -> 2.7 ms, verify 7.8 -> 6.3.
template <typename E>
void prefetch_tile(const Tile<E>& tile, int dim) {
  const int bytes = dim * static_cast<int>(sizeof(E));
  for (int t = 0; t < tile.n; ++t) {
    const char* k = reinterpret_cast<const char*>(tile.keys[t]);
    const char* v = reinterpret_cast<const char*>(tile.values[t]);
    for (int at = 0; at < bytes; at += 64) {
      __builtin_prefetch(k + at, 0, 3);
      __builtin_prefetch(v + at, 0, 3);
    }
  }
}

template <typename E>
void attend_cached(const Call& c, const Item& it, Scratch& s, int rows) {
  const int64_t g = c.group_size;
  int64_t pos = it.c0;
  // A sliding window: nothing before the block's first query's window is visible to any of its queries.
  if (c.window > 0) pos = std::max<int64_t>(pos, c.start[it.b] + it.q0 - c.window + 1);
  Tile<E> tiles[2];  // the tile attended and the next one, whose rows are on their way meanwhile
  int current = 0;
  pos = fill_tile(c, it, pos, tiles[0]);
  for (; tiles[current].n > 0; current ^= 1) {
    const Tile<E>& tile = tiles[current];
    pos = fill_tile(c, it, pos, tiles[current ^ 1]);
    prefetch_tile(tiles[current ^ 1], static_cast<int>(c.dim));
    const int n = tile.n;
    const uint64_t all = n == 64 ? ~uint64_t{0} : ((uint64_t{1} << n) - 1);
    bool any = true;
    if (c.window > 0) {  // positions rise through the tile: each row hides the keys before its window
      any = false;
      for (int r = 0; r < rows; ++r) {
        const int64_t first = c.start[it.b] + it.q0 + r / g - c.window + 1;
        const int64_t hidden = std::lower_bound(tile.at, tile.at + n, first) - tile.at;
        s.visible[r] = all & ~low_bits(hidden);
        any = any || s.visible[r] != 0;
      }
    } else {
      for (int r = 0; r < rows; ++r) s.visible[r] = all;
    }
    if (any) attend_tile<E>(s, tile.keys, tile.values, n, rows, static_cast<int>(c.dim));
  }
}

void attend_new(const Call& c, const Item& it, Scratch& s, int rows) {
  const int64_t g = c.group_size;
  const int64_t limit = c.mask ? c.length[it.b] : it.q1;  // causal: no query of the block sees past q1 - 1
  const float* keys[kTile];
  const float* values[kTile];
  for (int64_t j0 = 0; j0 < limit; j0 += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, limit - j0));
    for (int t = 0; t < n; ++t) {
      const int64_t base = ((it.b * c.seq + j0 + t) * 2) * c.kv_heads + it.h;
      keys[t] = c.new_kv + static_cast<size_t>(base * c.dim);
      values[t] = c.new_kv + static_cast<size_t>((base + c.kv_heads) * c.dim);
    }
    bool any = false;
    for (int r = 0; r < rows; ++r) {
      const int64_t i = it.q0 + r / g;
      s.visible[r] = c.mask ? mask_bits(c.mask + (it.b * c.seq + i) * c.seq + j0, n) : causal_bits(i - j0, n);
      if (c.window > 0) s.visible[r] &= ~low_bits(i - c.window + 1 - j0);  // new key j: i - j < window
      any = any || s.visible[r] != 0;
    }
    if (any) attend_tile<float>(s, keys, values, n, rows, static_cast<int>(c.dim));
  }
}


void run_item(const Call& c, size_t index) {
  const Item& it = c.items[index];
  const int64_t g = c.group_size, dim = c.dim;
  const int rows = static_cast<int>((it.q1 - it.q0) * g);
  Scratch& s = t_scratch;
  s.reserve(rows, static_cast<int>(dim));
  // AVX-512's transposed tile wins for prefill blocks; elsewhere the direct path won at every block size measured
  // (experiments/kernels/cpu_attention.py, AVX2: prefill 512 @1024 and verify 5 @1500).
  s.direct = !KVF_AVX512 || it.q1 - it.q0 <= kDirectQueries;
  for (int r = 0; r < rows; ++r) {  // row r = (query q0 + r / g, q head h * g + r % g), pre-scaled
    const float* q = c.query + head_offset(c, it.b, it.q0 + r / g, it.h * g + r % g);
    for (int64_t d = 0; d < dim; ++d) s.q[static_cast<size_t>(r) * dim + d] = q[d] * c.scale;
  }
  switch (c.pool_type) {
    case PoolType::kF16: attend_cached<uint16_t>(c, it, s, rows); break;
    case PoolType::kFp8: attend_cached<uint8_t>(c, it, s, rows); break;
    case PoolType::kF32: attend_cached<float>(c, it, s, rows); break;
  }
  if (it.with_new) attend_new(c, it, s, rows);
  const Group& grp = c.groups[it.group];
  if (grp.splits == 1) {
    for (int r = 0; r < rows; ++r) {
      float* out = c.out + head_offset(c, it.b, it.q0 + r / g, it.h * g + r % g);
      const float inv = s.sum[r] > 0.0f ? 1.0f / s.sum[r] : 0.0f;
      for (int64_t d = 0; d < dim; ++d) out[d] = s.acc[static_cast<size_t>(r) * dim + d] * inv;
    }
    return;
  }
  // A split's partial: (max, sum, acc) per row; the group's last item to finish merges them, so no second
  // parallel pass (and thread wake-up) is needed. acq_rel publishes every split's partial to that item.
  float* part = c.partials.data() + grp.partial +
                static_cast<int64_t>(it.split) * rows * (dim + 2);
  for (int r = 0; r < rows; ++r) {
    float* slot = part + static_cast<int64_t>(r) * (dim + 2);
    slot[0] = s.max[r];
    slot[1] = s.sum[r];
    std::memcpy(slot + 2, s.acc.data() + static_cast<size_t>(r) * dim, sizeof(float) * dim);
  }
  if (c.pending[it.group].fetch_sub(1, std::memory_order_acq_rel) == 1) merge_group(c, grp);
}

void run_item_trampoline(void* data, size_t index) { run_item(*static_cast<const Call*>(data), index); }

// The call's planned items on ORT's intra-op pool.
OrtStatus* RunItems(OrtKernelContext* ctx, const Call* c) {
  return g_api->KernelContext_ParallelFor(ctx, run_item_trampoline, c->items.size(), 0, const_cast<Call*>(c));
}

}  // namespace HWY_NAMESPACE
}  // namespace kvforge_attention
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvforge_attention {
HWY_EXPORT(RunItems);

OrtStatus* gather_inputs(const Kernel& k, OrtKernelContext* ctx, Call& c) {
  const OrtValue* v[7] = {};
  TensorInfo info[7];
  const void* data[7] = {};
  size_t count = 0;
  KVF_TRY(read_inputs(ctx, 6, "", count, v, info, data));
  KVF_TRY(query_geometry(k, info[0], c));
  const auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, I32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  KVF_TRY(expect("query", info[0], F32, {c.batch, c.seq, k.q_heads * k.dim}));
  KVF_TRY(expect("new_kv", info[1], F32, {c.batch, c.seq, 2, k.kv_heads, k.dim}));
  KVF_TRY(expect("pool", info[2], ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, {-1, 2, k.kv_heads, k.page_tokens, k.dim}));
  KVF_TRY(expect("kv_page_table", info[3], I32, {c.batch, -1}));
  KVF_TRY(expect("kvcache_start_index", info[4], I32, {c.batch}));
  KVF_TRY(expect("context_lengths", info[5], I32, {c.batch}));
  switch (info[2].type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: c.pool_type = PoolType::kF16; break;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: c.pool_type = PoolType::kFp8; break;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: c.pool_type = PoolType::kF32; break;
    default:
      return error("pool element type " + std::to_string(info[2].type) +
                   " is not float16, uint8 (FP8 E4M3) or float32");
  }
  c.mask = nullptr;
  // A mask with no elements ([B,0,0]) means causal: a graph with tree inputs runs its plain calls mask-free.
  const bool has_mask = count > 6 && v[6] && !info[6].shape.empty() &&
                        std::none_of(info[6].shape.begin(), info[6].shape.end(), [](int64_t d) { return d == 0; });
  if (has_mask) {
    KVF_TRY(expect("attention_mask", info[6], ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL, {c.batch, c.seq, c.seq}));
    c.mask = static_cast<const bool*>(data[6]);
  }
  c.num_pages = info[2].shape[0];
  c.width = info[3].shape[1];
  c.query = static_cast<const float*>(data[0]);
  c.new_kv = static_cast<const float*>(data[1]);
  c.pool = data[2];
  c.page_table = static_cast<const int32_t*>(data[3]);
  c.start = static_cast<const int32_t*>(data[4]);
  c.length = static_cast<const int32_t*>(data[5]);
  return check_values(c);
}

// The attention of a gathered call into c.out: padding rows zero, the items on ORT's intra-op pool.
OrtStatus* attend(OrtKernelContext* ctx, Call& c) {
  const size_t row_floats = static_cast<size_t>(c.q_heads * c.dim);
  for (int64_t b = 0; b < c.batch; ++b) {  // padding rows are zero
    const int64_t len = c.length[b];
    std::fill(c.out + (b * c.seq + len) * row_floats, c.out + (b + 1) * c.seq * row_floats, 0.0f);
  }
  plan(c);
  if (c.items.empty()) return nullptr;
  KVF_TRY(HWY_DYNAMIC_DISPATCH(RunItems)(ctx, &c));
  return nullptr;
}

OrtStatus* ORT_API_CALL compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel& k = *static_cast<const Kernel*>(kernel);
  if (const char* why = kvforge_cpu::forced_target_problem()) return error(why);
  Call c;
  KVF_TRY(gather_inputs(k, ctx, c));
  const int64_t out_shape[3] = {c.batch, c.seq, k.q_heads * k.dim};
  OrtValue* out_value = nullptr;
  KVF_TRY(g_api->KernelContext_GetOutput(ctx, 0, out_shape, 3, &out_value));
  void* out = nullptr;
  KVF_TRY(g_api->GetTensorMutableData(out_value, &out));
  c.out = static_cast<float*>(out);
  return attend(ctx, c);
}

OrtStatus* attribute_int(const OrtKernelInfo* info, const char* name, int64_t* value) {
  if (OrtStatus* st = g_api->KernelInfoGetAttribute_int64(info, name, value)) {
    g_api->ReleaseStatus(st);
    return error(std::string("missing int attribute ") + name);
  }
  return nullptr;
}

OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  Kernel k{};
  KVF_TRY(attribute_int(info, "num_q_heads", &k.q_heads));
  KVF_TRY(attribute_int(info, "num_kv_heads", &k.kv_heads));
  KVF_TRY(attribute_int(info, "head_dim", &k.dim));
  KVF_TRY(attribute_int(info, "tokens_per_page", &k.page_tokens));
  if (OrtStatus* st = g_api->KernelInfoGetAttribute_float(info, "scale", &k.scale)) {
    g_api->ReleaseStatus(st);  // absent: the usual 1/sqrt(head_dim)
    k.scale = k.dim > 0 ? 1.0f / std::sqrt(static_cast<float>(k.dim)) : 1.0f;
  }
  k.window = kvforge_ort::optional_int(g_api, info, "sliding_window", 0);  // absent: every position is visible
  if (k.window < 0) return error("sliding_window must be >= 0, got " + std::to_string(k.window));
  if (k.q_heads <= 0 || k.kv_heads <= 0 || k.q_heads % k.kv_heads != 0)
    return error("num_q_heads (" + std::to_string(k.q_heads) + ") must be a positive multiple of num_kv_heads (" +
                 std::to_string(k.kv_heads) + ")");
  if (k.dim <= 0 || k.dim % 16 != 0 || k.dim > kMaxHeadDim)
    return error("head_dim " + std::to_string(k.dim) + " is not supported: it must be a multiple of 16 up to " +
                 std::to_string(kMaxHeadDim));
  if (k.page_tokens <= 0) return error("tokens_per_page must be positive, got " + std::to_string(k.page_tokens));
  // Absent: separate query, key and value (engines built before).
  k.packed_qkv = kvforge_ort::optional_int(g_api, info, "packed_qkv", 0);
  *kernel = new Kernel(k);
  return nullptr;
}

void ORT_API_CALL destroy_kernel(void* kernel) { delete static_cast<Kernel*>(kernel); }

const char* ORT_API_CALL op_name(const OrtCustomOp*) { return "PagedAttention"; }
size_t ORT_API_CALL input_count(const OrtCustomOp*) { return 7; }
size_t ORT_API_CALL output_count(const OrtCustomOp*) { return 1; }

ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp*, size_t index) {
  switch (index) {
    case 0: case 1: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    case 2: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // float16, uint8 or float32: checked per call
    case 6: return ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
    default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  }
}

ONNXTensorElementDataType ORT_API_CALL output_type(const OrtCustomOp*, size_t) {
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

OrtCustomOpInputOutputCharacteristic ORT_API_CALL input_characteristic(const OrtCustomOp*, size_t index) {
  return index == 6 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}

OrtCustomOpInputOutputCharacteristic ORT_API_CALL output_characteristic(const OrtCustomOp*, size_t) {
  return INPUT_OUTPUT_REQUIRED;
}

// The output has the query's type and shape (the info belongs to the context: not released here). A dim the
// graph leaves wholly unknown (no value, no name) comes back as -1 and would be written as a negative value, which
// breaks shape inference downstream (tiny-qwen3_5's engine refused to load at a Concat after the optimizer's
// rewrites; tests/test_recurrent_engine.py): then the output's shape is left unknown instead.
OrtStatus* ORT_API_CALL infer_shape(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  OrtTensorTypeAndShapeInfo* query = nullptr;
  KVF_TRY(g_api->ShapeInferContext_GetInputTypeShape(ctx, 0, &query));
  size_t rank = 0;
  KVF_TRY(g_api->GetDimensionsCount(query, &rank));
  // A query whose shape the graph does not know reads as rank 0 here: left unknown, not inferred as a scalar
  // (a LoRA MatMul after the attention refused to load when it was).
  if (rank != 3) return nullptr;
  std::vector<int64_t> dims(rank);
  std::vector<const char*> names(rank, nullptr);
  KVF_TRY(g_api->GetDimensions(query, dims.data(), rank));
  KVF_TRY(g_api->GetSymbolicDimensions(query, names.data(), rank));
  for (size_t i = 0; i < rank; ++i)
    if (dims[i] < 0 && (names[i] == nullptr || names[i][0] == '\0')) return nullptr;
  return g_api->ShapeInferContext_SetOutputTypeShape(ctx, 0, query);
}

OrtCustomOp make_op() {
  OrtCustomOp op = kvforge_ort::base_op();
  op.GetName = op_name;
  op.GetInputType = input_type;
  op.GetInputTypeCount = input_count;
  op.GetOutputType = output_type;
  op.GetOutputTypeCount = output_count;
  op.KernelDestroy = destroy_kernel;
  op.GetInputCharacteristic = input_characteristic;
  op.GetOutputCharacteristic = output_characteristic;
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  op.InferOutputShapeFn = infer_shape;
  return op;
}

namespace {
OrtCustomOp g_paged_attention = make_op();
}  // namespace

// Called by RegisterCustomOps (register.cc).
OrtStatus* add_ops(OrtCustomOpDomain* domain) { return g_api->CustomOpDomain_Add(domain, &g_paged_attention); }

}  // namespace kvforge_attention
#endif  // HWY_ONCE
