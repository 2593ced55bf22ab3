// kvforge.cpu.MatMulBlocks: a 4-bit block-quantized matmul whose rows do not change with the call's row count.
//
// The contract is kvforge/plugins/ops.py CPU_MATMUL_BLOCKS; the semantics are kvforge/plugins/reference.py matmul_blocks.
// Y [..., N] = A [..., K] @ W, where weight k of output column n is scale[n, b] * q + min[n, b] (b = k / 32, q the
// 4-bit value). That is a GGUF Q4_1 block exactly (a Q4_0 block has min = -8 * scale), so the exact-remainder
// correction the stock form needs (a block-sum MatMul, an offsets MatMul and an Add beside MatMulNBits) is gone.
// Each block is 24 bytes, a column's blocks one after another: 16 bytes of values (byte j: element j in the low
// nibble, element j + 16 in the high one, GGUF's order, so the activations are read as they are), then the scale
// and the min as float32. One contiguous stream per column is what the hardware prefetchers follow best.
//
// Why not ONNX Runtime's MatMulNBits: at more than one row its float path dequantizes the whole weight and runs
// SGEMM, so a verification call of 5 rows cost 2.7x a decode call, and its rounding differs from the one-row
// call's, so a verified token's logits were not the decoded token's. Here, up to kDirectRows rows, each block is
// decoded once into float32 (one FMA per weight: scale * q + min, rounded once) and dotted with every row; an
// output element is summed in the same order whatever the row count, the column split or the thread, so
// verification rows equal decode rows bit for bit (on AVX2 the rows run in int16 instead, run_int16 below, with the
// same property). More rows (prefill chunks) dequantize W once into float32
// [N, K] and run ONNX Runtime's own Gemm on it (InvokeOp), as MatMulNBits' float path does internally.
//
// One source, many targets (Google Highway's foreach_target): the block below the common part is compiled once per
// target (AVX3_DL with AVX512_BF16 for the bfloat16 panels, AVX3 = AVX-512, AVX2, SSE4, scalar on x86; NEON on ARM) and the best one this CPU runs is chosen at run time (KVFORGE_CPU_TARGET forces one: cpu_target.cc).
// AVX-512 keeps its intrinsics (a 16-entry vpermps table per block); the other targets share one Highway loop.

#ifndef KVFORGE_MATMUL_COMMON
#define KVFORGE_MATMUL_COMMON
// gcc 12 reports its own _mm512_undefined_* (inside the intrinsics) as uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <onnxruntime_c_api.h>

#include "cpu_target.h"
#include "ort_op.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace kvforge_matmul {
namespace {

const OrtApi* g_api = nullptr;

constexpr int64_t kBlock = 32;          // weights per block (GGUF's Q4_0 / Q4_1)
// A block's bytes: the 32 values (two 4-bit values a byte, or one 8-bit value), then scale and min (float32).
template <int BITS>
constexpr int64_t kValueBytes = BITS == 4 ? 16 : 32;
template <int BITS>
constexpr int64_t kBlockBytes = kValueBytes<BITS> + 8;
constexpr int64_t kDirectRows = 16;     // up to this many rows: the row-invariant direct kernel
constexpr int64_t kRowGroup = 8;        // the most rows sharing one decoded block in registers
constexpr int64_t kColumnsPerItem = 32; // one parallel work item

#define KVF_MM_TRY(expr)                  \
  do {                                    \
    if (OrtStatus* _st = (expr)) return _st; \
  } while (0)

OrtStatus* error(const std::string& message) {
  return g_api->CreateStatus(ORT_INVALID_ARGUMENT, ("kvforge.cpu.MatMulBlocks: " + message).c_str());
}

struct Kernel {
  int64_t k = 0;
  int64_t n = 0;
  int64_t bits = 4;  // 4 (GGUF Q4_0 / Q4_1) or 8 (Q8_0, the LM head)
  bool bf16 = false;  // many-row calls of 4-bit weights in bfloat16 where the CPU has it (attribute `bf16`)
  OrtOp* gemm = nullptr;  // ONNX Runtime's Gemm (transB = 1) for calls of many rows
  OrtMemoryInfo* cpu = nullptr;
};

struct Call {
  const Kernel* kernel;
  int64_t rows;
  const float* x;         // [rows, K]
  const uint8_t* blocks;  // [N, K / 32, 24] (4-bit) or [N, K / 32, 40] (8-bit)
  float* y;               // [rows, N]
  float* dequantized;     // [N, K] (the many-rows path)
  // AVX2's int16 decode rows (run_int16): per row, blocks padded to a multiple of 8, zeros past K / 32.
  const int16_t* xq = nullptr;  // [rows, padded * 32] the activations in int16, one symmetric scale per block
  const float* dx = nullptr;   // [rows, padded * 8] each block's scale, repeated 8 times (a vector's lanes)
  const float* xs = nullptr;   // [rows, padded] each block's float32 sum of the activations (for the mins)
  int64_t padded = 0;          // blocks per row in those buffers
};


inline float block_float(const uint8_t* block, int64_t offset) {
  float value;
  std::memcpy(&value, block + offset, sizeof value);
  return value;
}

}  // namespace
}  // namespace kvforge_matmul
#endif  // KVFORGE_MATMUL_COMMON

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "matmul_blocks.cc"
#include <hwy/foreach_target.h>  // re-includes this file once per target
#include <hwy/highway.h>
#include <hwy/cache_control.h>

HWY_BEFORE_NAMESPACE();
namespace kvforge_matmul {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#undef KVF_AVX512
#undef KVF_BF16
#undef KVF_BF16_ATTR
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
#define KVF_AVX512 1  // Highway has included <immintrin.h>
#else
#define KVF_AVX512 0
#endif
#if HWY_TARGET == HWY_AVX3_DL
#define KVF_BF16 1
#define KVF_BF16_ATTR __attribute__((target("avx512bf16")))
#else
#define KVF_BF16 0
#define KVF_BF16_ATTR
#endif

#if KVF_AVX512
// Columns c0..c0+NC-1 against rows r0..r0+NR-1: one accumulator per (column, row), summed block by block in
// order, lane by lane, then reduced by one fixed tree: the same arithmetic for any NC, NR or row count.
template <int BITS, int NC, int NR>
void dot_group(const Call& c, int64_t c0, int64_t r0) {
  constexpr int64_t kBytes = kBlockBytes<BITS>, kValues = kValueBytes<BITS>;
  const int64_t k = c.kernel->k, n = c.kernel->n, blocks = k / kBlock;
  const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 acc[NC][NR];
  for (int j = 0; j < NC; ++j)
    for (int r = 0; r < NR; ++r) acc[j][r] = _mm512_setzero_ps();
  // The next column group's blocks, one block step ahead per step: a column's stream is only K / 32 blocks (7 to 18
  // cache lines here), too short for the hardware prefetchers to lock on, and a decode call is 120 such matmuls
  // streaming 80 MB. Prefetching the group ahead took SmolLM2's 120 one-row matmuls from ~5.2 to ~3.3 ms on two
  // cores. The group ahead is contiguous (columns are consecutive), so step b covers its bytes [b, b + 1) * span: an
  // address every cache line and the span's last byte reach each line it touches. The last group of an item
  // prefetches the next item's first, which another thread may be reading.
  constexpr int64_t span = NC * kBytes;
  const bool prefetch = c0 + 2 * NC <= n;
  const char* ahead = reinterpret_cast<const char*>(c.blocks + (prefetch ? (c0 + NC) * blocks * kBytes : 0));
  for (int64_t b = 0; b < blocks; ++b) {
    if (prefetch) {
      const char* group = ahead + b * span;
      for (int64_t offset = 0; offset < span; offset += 64) _mm_prefetch(group + offset, _MM_HINT_T0);
      _mm_prefetch(group + span - 1, _MM_HINT_T0);
    }
    __m512 low[NC], high[NC];  // elements 0..15 and 16..31 of each column's block
    for (int j = 0; j < NC; ++j) {
      const uint8_t* block = c.blocks + ((c0 + j) * blocks + b) * kBytes;
      const __m512 scale = _mm512_set1_ps(block_float(block, kValues));
      const __m512 min = _mm512_set1_ps(block_float(block, kValues + 4));
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
      if constexpr (BITS == 4) {
        // The block's 16 possible weights scale * q + min (each rounded once, as the other targets decode them), then
        // looked up by nibble: vpermps reads only an index's low 4 bits, so the low nibble needs no mask.
        const __m512 table = _mm512_fmadd_ps(iota, scale, min);
        low[j] = _mm512_permutexvar_ps(v, table);
        high[j] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
      } else {  // one byte a weight: scale * q + min, rounded once, as the table's entries are
        const __m512i v_high = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16)));
        low[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), scale, min);
        high[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v_high), scale, min);
      }
    }
    for (int r = 0; r < NR; ++r) {  // each row's 32 activations loaded once for all NC columns
      const float* x = c.x + (r0 + r) * k + b * kBlock;
      const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
      for (int j = 0; j < NC; ++j) {
        acc[j][r] = _mm512_fmadd_ps(low[j], x0, acc[j][r]);
        acc[j][r] = _mm512_fmadd_ps(high[j], x1, acc[j][r]);
      }
    }
  }
  for (int j = 0; j < NC; ++j)
    for (int r = 0; r < NR; ++r) c.y[(r0 + r) * n + c0 + j] = _mm512_reduce_add_ps(acc[j][r]);
}
#else
// Every other target (AVX2, SSE4, NEON, scalar), one Highway source: lanes of N <= 16 floats, the block's
// 32 weights decoded as scale * q + min (one FMA, the AVX-512 table's rounding) N at a time, summed chunk by chunk
// in a fixed order, then Highway's fixed lane reduction: the same arithmetic for any NC, NR or row count.
template <int BITS, int NC, int NR>
void dot_group(const Call& c, int64_t c0, int64_t r0) {
  const hn::CappedTag<float, 16> d;
  const hn::Rebind<int32_t, decltype(d)> di;
  const hn::Rebind<uint8_t, decltype(d)> d8;
  using V = hn::Vec<decltype(d)>;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  constexpr int64_t kBytes = kBlockBytes<BITS>, kValues = kValueBytes<BITS>;
  const int64_t k = c.kernel->k, n = c.kernel->n, blocks = k / kBlock;
  V acc[NC][NR];
  for (int j = 0; j < NC; ++j)
    for (int r = 0; r < NR; ++r) acc[j][r] = hn::Zero(d);
  constexpr int64_t span = NC * kBytes;  // the next column group, prefetched a block step ahead (see the AVX-512 path)
  const bool prefetch = c0 + 2 * NC <= n;
  const char* ahead = reinterpret_cast<const char*>(c.blocks + (prefetch ? (c0 + NC) * blocks * kBytes : 0));
  const auto nibble = hn::Set(di, 0xF);
  for (int64_t b = 0; b < blocks; ++b) {
    if (prefetch) {
      const char* group = ahead + b * span;
      for (int64_t offset = 0; offset < span; offset += 64) hwy::Prefetch(group + offset);
      hwy::Prefetch(group + span - 1);
    }
    const uint8_t* block[NC];
    V scale[NC], min[NC];
    for (int j = 0; j < NC; ++j) {
      block[j] = c.blocks + ((c0 + j) * blocks + b) * kBytes;
      scale[j] = hn::Set(d, block_float(block[j], kValues));
      min[j] = hn::Set(d, block_float(block[j], kValues + 4));
    }
    if constexpr (BITS == 4) {
      // Bytes e..e+N-1 hold elements e..e+N-1 (low nibbles) and 16+e.. (high ones): loaded and widened once for both.
      for (int64_t e = 0; e < kBlock / 2; e += N) {
        V low[NC], high[NC];
        for (int j = 0; j < NC; ++j) {
          const auto q = hn::PromoteTo(di, hn::LoadU(d8, block[j] + e));
          low[j] = hn::MulAdd(hn::ConvertTo(d, hn::And(q, nibble)), scale[j], min[j]);
          high[j] = hn::MulAdd(hn::ConvertTo(d, hn::ShiftRight<4>(q)), scale[j], min[j]);
        }
        for (int r = 0; r < NR; ++r) {
          const float* x = c.x + (r0 + r) * k + b * kBlock + e;
          const V x0 = hn::LoadU(d, x), x1 = hn::LoadU(d, x + kBlock / 2);
          for (int j = 0; j < NC; ++j) {
            acc[j][r] = hn::MulAdd(low[j], x0, acc[j][r]);
            acc[j][r] = hn::MulAdd(high[j], x1, acc[j][r]);
          }
        }
      }
    } else {
      for (int64_t e = 0; e < kBlock; e += N) {  // one byte a weight
        V w[NC];
        for (int j = 0; j < NC; ++j)
          w[j] = hn::MulAdd(hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(d8, block[j] + e))), scale[j], min[j]);
        for (int r = 0; r < NR; ++r) {
          const V x = hn::LoadU(d, c.x + (r0 + r) * k + b * kBlock + e);
          for (int j = 0; j < NC; ++j) acc[j][r] = hn::MulAdd(w[j], x, acc[j][r]);
        }
      }
    }
  }
  for (int j = 0; j < NC; ++j)
    for (int r = 0; r < NR; ++r) c.y[(r0 + r) * n + c0 + j] = hn::GetLane(hn::SumOfLanes(d, acc[j][r]));
}
#endif

// One pass over a column group's blocks serves as many rows as the registers hold: NC x NR accumulators plus the
// NC decoded pairs stay within the 32 vector registers without spilling (4 x 4, 3 x 5, 2 x 8).
template <int BITS, int NC, int NR>
void dot_columns(const Call& c, int64_t begin, int64_t end, int64_t r0) {
  int64_t c0 = begin;
  for (; c0 + NC <= end; c0 += NC) dot_group<BITS, NC, NR>(c, c0, r0);
  for (; c0 < end; ++c0) dot_group<BITS, 1, NR>(c, c0, r0);
}

template <int BITS, int NR>
void dot_rows(const Call& c, int64_t begin, int64_t end, int64_t r0) {
  // AVX-512 has 32 registers; the other x86 targets 16: NC x NR accumulators, 2 NC decoded chunks, a row's two.
  constexpr int kColumns = KVF_AVX512 ? (NR <= 4 ? 4 : NR == 5 ? 3 : 2) : (NR <= 2 ? 3 : NR <= 4 ? 2 : 1);
  dot_columns<BITS, kColumns, NR>(c, begin, end, r0);
}

template <int BITS>
void direct_item(void* data, size_t item) {
  const Call& c = *static_cast<const Call*>(data);
  const int64_t begin = static_cast<int64_t>(item) * kColumnsPerItem;
  const int64_t end = std::min(begin + kColumnsPerItem, c.kernel->n);
  for (int64_t r0 = 0; r0 < c.rows; r0 += kRowGroup) {
    switch (std::min<int64_t>(c.rows - r0, kRowGroup)) {
      case 1: dot_rows<BITS, 1>(c, begin, end, r0); break;
      case 2: dot_rows<BITS, 2>(c, begin, end, r0); break;
      case 3: dot_rows<BITS, 3>(c, begin, end, r0); break;
      case 4: dot_rows<BITS, 4>(c, begin, end, r0); break;
      case 5: dot_rows<BITS, 5>(c, begin, end, r0); break;
      case 6: dot_rows<BITS, 6>(c, begin, end, r0); break;
      case 7: dot_rows<BITS, 7>(c, begin, end, r0); break;
      default: dot_rows<BITS, 8>(c, begin, end, r0); break;
    }
  }
}

#undef KVF_INT16
#if HWY_TARGET == HWY_AVX2
#define KVF_INT16 1  // 4-bit decode and verify rows in integers (every other target keeps the float path)
#else
#define KVF_INT16 0
#endif

#if KVF_INT16
// ---- AVX2 decode and verify rows in int16 (4-bit blocks) ----
//
// The float path spends most of an AVX2 decode row decoding weights (widen, convert, one FMA per 8 weights) for 4
// FMAs of use per block. Here each activation row is quantized once per call, block by block: scale dx = max |x| /
// 32767 and xq = x * (32767 / max |x|) rounded to nearest even, and the block's float32 sum s of x is kept. A block's
// dot product with a column's block (scale d, min m, 4-bit q) is d * dx * sum(q * xq) + m * s: the 4-bit values
// widen to int16 in one instruction, VPMADDWD sums their products exactly in int32 (|q * xq| <= 15 * 32767), and the
// only new error is xq's rounding, at most dx / 2 an element (1 / 65534 of the block's largest activation); the min
// term keeps the exact activations. int8 activations (llama.cpp's Q8_0, VPMADDUBSW) were tried and failed the int4
// quality bar on SmolLM2 (top-1 agreement 92.5 %, 2 of 10 answers equal; docs/benchmarks.md), as they did on AVX-512
// with VPDPBUSD, where they were slower at one row besides: AVX-512 keeps its float table path.
// Per row and block: two VPMADDWD, an add, one conversion, one scale product and one FMA, lane by lane in block
// order, and the min terms added 8 blocks at a time: a row's arithmetic depends on K alone, never on the row count,
// the column split or the thread, so verification rows still equal decode rows bit for bit.
constexpr int64_t kChunk = 8;  // blocks whose min terms are added at once (a vector of xs)

// Row x into the call's buffers (plain C++, compiled for this target alone).
void quantize_row(const float* x, int64_t blocks, int64_t padded, int16_t* xq, float* dx, float* xs) {
  for (int64_t b = 0; b < padded; ++b) {
    float amax = 0.0f, sum = 0.0f;
    const float* in = x + b * kBlock;
    if (b < blocks) {
      for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(in[i]));
      for (int64_t i = 0; i < kBlock; ++i) sum += in[i];  // in order: no -ffast-math, so never reassociated
    }
    const float inverse = amax > 0.0f ? 32767.0f / amax : 0.0f;
    for (int64_t i = 0; i < kBlock; ++i)
      xq[b * kBlock + i] = b < blocks ? static_cast<int16_t>(std::nearbyint(in[i] * inverse)) : 0;
    for (int i = 0; i < 8; ++i) dx[b * 8 + i] = amax / 32767.0f;
    xs[b] = sum;
  }
}

inline float lane_sum(__m256 v) {  // one fixed tree
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// Columns c0..c0+NC-1 against rows r0..r0+NR-1, each block decoded once for all the rows.
template <int NC, int NR>
void int16_group(const Call& c, int64_t c0, int64_t r0) {
  constexpr int64_t kBytes = kBlockBytes<4>;
  const int64_t k = c.kernel->k, n = c.kernel->n, blocks = k / kBlock, padded = c.padded;
  __m256 acc[NC][NR];
  for (int j = 0; j < NC; ++j)
    for (int r = 0; r < NR; ++r) acc[j][r] = _mm256_setzero_ps();
  constexpr int64_t span = NC * kBytes;  // the next column group, prefetched a block step ahead (see dot_group)
  const bool prefetch = c0 + 2 * NC <= n;
  const char* ahead = reinterpret_cast<const char*>(c.blocks + (prefetch ? (c0 + NC) * blocks * kBytes : 0));
  const __m256i nibble = _mm256_set1_epi16(0x0F);
  alignas(32) float mins[NC][kChunk];
  for (int64_t b0 = 0; b0 < blocks; b0 += kChunk) {
    const int64_t end = std::min(b0 + kChunk, blocks);
    for (int64_t b = b0; b < end; ++b) {
      if (prefetch) {
        const char* group = ahead + b * span;
        for (int64_t offset = 0; offset < span; offset += 64) hwy::Prefetch(group + offset);
        hwy::Prefetch(group + span - 1);
      }
      __m256i low[NC], high[NC];  // elements 0..15 and 16..31 as int16
      __m256 d[NC];
      for (int j = 0; j < NC; ++j) {
        const uint8_t* block = c.blocks + ((c0 + j) * blocks + b) * kBytes;
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
        low[j] = _mm256_and_si256(v, nibble);
        high[j] = _mm256_srli_epi16(v, 4);
        d[j] = _mm256_set1_ps(block_float(block, kValueBytes<4>));
        mins[j][b - b0] = block_float(block, kValueBytes<4> + 4);
      }
      for (int r = 0; r < NR; ++r) {
        const int16_t* xq = c.xq + ((r0 + r) * padded + b) * kBlock;
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
        const __m256 dx = _mm256_loadu_ps(c.dx + ((r0 + r) * padded + b) * 8);
        for (int j = 0; j < NC; ++j) {
          const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(low[j], x0), _mm256_madd_epi16(high[j], x1));
          acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d[j], dx), acc[j][r]);
        }
      }
    }
    for (int j = 0; j < NC; ++j)
      for (int64_t b = end; b < b0 + kChunk; ++b) mins[j][b - b0] = 0.0f;  // past K / 32
    for (int r = 0; r < NR; ++r) {  // the chunk's m * s, lane by lane (xs is zero past the row's blocks)
      const __m256 xs = _mm256_loadu_ps(c.xs + (r0 + r) * padded + b0);
      for (int j = 0; j < NC; ++j) acc[j][r] = _mm256_fmadd_ps(_mm256_load_ps(mins[j]), xs, acc[j][r]);
    }
  }
  for (int j = 0; j < NC; ++j)
    for (int r = 0; r < NR; ++r) c.y[(r0 + r) * n + c0 + j] = lane_sum(acc[j][r]);
}

template <int NR>
void int16_rows(const Call& c, int64_t begin, int64_t end, int64_t r0) {
  // 16 registers: NC x NR accumulators, 2 NC decoded halves and NC scales, a row's two halves and its scales.
  constexpr int kColumns = NR == 1 ? 3 : NR <= 3 ? 2 : 1;
  int64_t c0 = begin;
  for (; c0 + kColumns <= end; c0 += kColumns) int16_group<kColumns, NR>(c, c0, r0);
  for (; c0 < end; ++c0) int16_group<1, NR>(c, c0, r0);
}

void int16_item(void* data, size_t item) {
  const Call& c = *static_cast<const Call*>(data);
  const int64_t begin = static_cast<int64_t>(item) * kColumnsPerItem;
  const int64_t end = std::min(begin + kColumnsPerItem, c.kernel->n);
  for (int64_t r0 = 0; r0 < c.rows; r0 += kRowGroup) {
    switch (std::min<int64_t>(c.rows - r0, kRowGroup)) {
      case 1: int16_rows<1>(c, begin, end, r0); break;
      case 2: int16_rows<2>(c, begin, end, r0); break;
      case 3: int16_rows<3>(c, begin, end, r0); break;
      case 4: int16_rows<4>(c, begin, end, r0); break;
      case 5: int16_rows<5>(c, begin, end, r0); break;
      case 6: int16_rows<6>(c, begin, end, r0); break;
      case 7: int16_rows<7>(c, begin, end, r0); break;
      default: int16_rows<8>(c, begin, end, r0); break;
    }
  }
}

OrtStatus* run_int16(OrtKernelContext* ctx, const Call& call) {
  const int64_t k = call.kernel->k, blocks = k / kBlock;
  const int64_t padded = (blocks + kChunk - 1) / kChunk * kChunk;
  thread_local std::vector<int16_t> xq;  // the calling thread's: reused call after call, never shrunk
  thread_local std::vector<float> scales;
  xq.resize(static_cast<size_t>(call.rows * padded * kBlock));
  scales.resize(static_cast<size_t>(call.rows * padded * 9));
  float* dx = scales.data();
  float* xs = dx + call.rows * padded * 8;
  for (int64_t r = 0; r < call.rows; ++r)
    quantize_row(call.x + r * k, blocks, padded, xq.data() + r * padded * kBlock, dx + r * padded * 8,
                 xs + r * padded);
  Call c = call;
  c.xq = xq.data();
  c.dx = dx;
  c.xs = xs;
  c.padded = padded;
  const size_t items = static_cast<size_t>((c.kernel->n + kColumnsPerItem - 1) / kColumnsPerItem);
  return g_api->KernelContext_ParallelFor(ctx, int16_item, items, 0, &c);
}
#endif  // KVF_INT16

// W^T [N, K] in float32, in the original element order, for ONNX Runtime's Gemm (4-bit weights only: an 8-bit
// weight is the LM head, whose many-row calls are rare and whose float copy would be 4x its blocks).
void dequantize_item(void* data, size_t item) {
  const Call& c = *static_cast<const Call*>(data);
  const int64_t k = c.kernel->k, blocks = k / kBlock;
  const int64_t begin = static_cast<int64_t>(item) * kColumnsPerItem;
  const int64_t end = std::min(begin + kColumnsPerItem, c.kernel->n);
  for (int64_t col = begin; col < end; ++col) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = c.blocks + (col * blocks + b) * kBlockBytes<4>;
      const float d = block_float(block, kValueBytes<4>), m = block_float(block, kValueBytes<4> + 4);
      float* out = c.dequantized + col * k + b * kBlock;
      for (int64_t i = 0; i < kValueBytes<4>; ++i) {
        out[i] = std::fma(static_cast<float>(block[i] & 0xF), d, m);
        out[kValueBytes<4> + i] = std::fma(static_cast<float>(block[i] >> 4), d, m);
      }
    }
  }
}

#if KVF_BF16
// ---- many rows in bfloat16: A and W rounded to bf16 (nearest even), products summed in float32 by VDPBF16PS ----
//
// W is dequantized a panel of 32 columns at a time (scale * q + min in float32, as every path rounds it, then to
// bf16) into the thread's panel [K/2][32] of bf16 pairs: dword (p, j) holds weights 2p and 2p + 1 of column j, the
// layout VDPBF16PS pairs with a broadcast dword of two activations. A register block of kPanelRows rows then runs
// over the whole panel with 2 x kPanelRows accumulators; the panel (K x 64 bytes) stays in L2 for all the rows.
constexpr int64_t kPanel = 32;      // columns per panel: two vectors of 16
constexpr int kPanelRows = 12;      // rows per register block: 24 accumulators, 2 weight vectors, a broadcast
constexpr int64_t kPackRows = 16;   // rows rounded to bf16 per work item

struct Bf16Call {
  const Kernel* kernel;
  int64_t rows;
  const float* x;         // [rows, K]
  uint16_t* a;            // [rows, K] bf16 (x rounded)
  const uint8_t* blocks;  // [N, K / 32, 24]
  float* y;               // [rows, N]
};

KVF_BF16_ATTR void round_rows_item(void* data, size_t item) {
  const Bf16Call& c = *static_cast<const Bf16Call*>(data);
  const int64_t k = c.kernel->k, begin = static_cast<int64_t>(item) * kPackRows;
  const int64_t end = std::min(begin + kPackRows, c.rows);
  for (int64_t i = begin * k; i < end * k; i += kBlock) {  // K is a multiple of 32
    const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(c.x + i + 16), _mm512_loadu_ps(c.x + i));
    _mm512_storeu_si512(c.a + i, reinterpret_cast<const __m512i&>(pairs));
  }
}

// Columns n0..n0+31 of W into `panel` as bf16 pairs; columns past N are zero.
KVF_BF16_ATTR void dequantize_panel(const Bf16Call& c, int64_t n0, uint32_t* panel) {
  const int64_t k = c.kernel->k, n = c.kernel->n, blocks = k / kBlock;
  const int64_t columns = std::min(kPanel, n - n0);
  const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  // Dword l of a block's 32 rounded weights is pair b * 16 + l: scattered down the panel at a stride of 32 dwords.
  const __m512i stride = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(static_cast<int>(kPanel)));
  for (int64_t j = 0; j < columns; ++j) {
    const uint8_t* column = c.blocks + (n0 + j) * blocks * kBlockBytes<4>;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = column + b * kBlockBytes<4>;
      const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(block_float(block, kValueBytes<4>)),
                                           _mm512_set1_ps(block_float(block, kValueBytes<4> + 4)));
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
      const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table),
                                                 _mm512_permutexvar_ps(v, table));
      _mm512_i32scatter_epi32(panel + b * 16 * kPanel + j, stride, reinterpret_cast<const __m512i&>(pairs), 4);
    }
  }
  for (int64_t p = 0; columns < kPanel && p < k / 2; ++p)
    std::memset(panel + p * kPanel + columns, 0, sizeof(uint32_t) * (kPanel - columns));
}

// Rows r0..r0+MR-1 against the panel's 32 columns; the columns past N are not stored.
template <int MR>
KVF_BF16_ATTR void panel_rows(const Bf16Call& c, const uint32_t* panel, int64_t n0, int64_t r0) {
  const int64_t pairs = c.kernel->k / 2, n = c.kernel->n;
  const uint32_t* a = reinterpret_cast<const uint32_t*>(c.a) + r0 * pairs;
  __m512 low[MR], high[MR];
  for (int r = 0; r < MR; ++r) low[r] = high[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512i w0 = _mm512_loadu_si512(panel + p * kPanel), w1 = _mm512_loadu_si512(panel + p * kPanel + 16);
    for (int r = 0; r < MR; ++r) {
      const __m512i x = _mm512_set1_epi32(static_cast<int>(a[r * pairs + p]));
      low[r] = _mm512_dpbf16_ps(low[r], reinterpret_cast<const __m512bh&>(x), reinterpret_cast<const __m512bh&>(w0));
      high[r] = _mm512_dpbf16_ps(high[r], reinterpret_cast<const __m512bh&>(x), reinterpret_cast<const __m512bh&>(w1));
    }
  }
  const int64_t columns = std::min(kPanel, n - n0);
  const __mmask16 low_mask = columns >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << columns) - 1);
  const __mmask16 high_mask = columns >= 32 ? 0xFFFF : columns <= 16 ? 0 : static_cast<__mmask16>((1u << (columns - 16)) - 1);
  for (int r = 0; r < MR; ++r) {
    float* y = c.y + (r0 + r) * n + n0;
    _mm512_mask_storeu_ps(y, low_mask, low[r]);
    _mm512_mask_storeu_ps(y + 16, high_mask, high[r]);
  }
}

KVF_BF16_ATTR void bf16_item(void* data, size_t item) {
  const Bf16Call& c = *static_cast<const Bf16Call*>(data);
  thread_local std::vector<uint32_t> panel;  // this thread's: reused call after call
  panel.resize(static_cast<size_t>(c.kernel->k / 2 * kPanel));
  const int64_t n0 = static_cast<int64_t>(item) * kPanel;
  dequantize_panel(c, n0, panel.data());
  int64_t r0 = 0;
  for (; r0 + kPanelRows <= c.rows; r0 += kPanelRows) panel_rows<kPanelRows>(c, panel.data(), n0, r0);
  switch (c.rows - r0) {
    case 0: break;
    case 1: panel_rows<1>(c, panel.data(), n0, r0); break;
    case 2: panel_rows<2>(c, panel.data(), n0, r0); break;
    case 3: panel_rows<3>(c, panel.data(), n0, r0); break;
    case 4: panel_rows<4>(c, panel.data(), n0, r0); break;
    case 5: panel_rows<5>(c, panel.data(), n0, r0); break;
    case 6: panel_rows<6>(c, panel.data(), n0, r0); break;
    case 7: panel_rows<7>(c, panel.data(), n0, r0); break;
    case 8: panel_rows<8>(c, panel.data(), n0, r0); break;
    case 9: panel_rows<9>(c, panel.data(), n0, r0); break;
    case 10: panel_rows<10>(c, panel.data(), n0, r0); break;
    default: panel_rows<11>(c, panel.data(), n0, r0); break;
  }
}

KVF_BF16_ATTR OrtStatus* run_bf16(OrtKernelContext* ctx, const Call& call) {
  thread_local std::vector<uint16_t> rounded;  // the calling thread's A in bf16, never shrunk
  rounded.resize(static_cast<size_t>(call.rows * call.kernel->k));
  Bf16Call c{call.kernel, call.rows, call.x, rounded.data(), call.blocks, call.y};
  const size_t row_items = static_cast<size_t>((call.rows + kPackRows - 1) / kPackRows);
  KVF_MM_TRY(g_api->KernelContext_ParallelFor(ctx, round_rows_item, row_items, 0, &c));
  const size_t panels = static_cast<size_t>((call.kernel->n + kPanel - 1) / kPanel);
  return g_api->KernelContext_ParallelFor(ctx, bf16_item, panels, 0, &c);
}
#endif

// ---- the entries dispatched at run time (HWY_EXPORT below) ----

OrtStatus* RunDirect(OrtKernelContext* ctx, const Call* c) {
#if KVF_INT16
  if (c->kernel->bits == 4) return run_int16(ctx, *c);
#endif
  const size_t items = static_cast<size_t>((c->kernel->n + kColumnsPerItem - 1) / kColumnsPerItem);
  return g_api->KernelContext_ParallelFor(ctx, c->kernel->bits == 8 ? direct_item<8> : direct_item<4>, items, 0,
                                          const_cast<Call*>(c));
}

OrtStatus* RunDequantize(OrtKernelContext* ctx, const Call* c) {
  const size_t items = static_cast<size_t>((c->kernel->n + kColumnsPerItem - 1) / kColumnsPerItem);
  return g_api->KernelContext_ParallelFor(ctx, dequantize_item, items, 0, const_cast<Call*>(c));
}

// Whether this target runs many-row calls in bfloat16: the AVX3_DL target on a CPU with AVX512_BF16.
int HasBf16() {
#if KVF_BF16
  return __builtin_cpu_supports("avx512bf16") ? 1 : 0;
#else
  return 0;
#endif
}

OrtStatus* RunBf16(OrtKernelContext* ctx, const Call* c) {
#if KVF_BF16
  return run_bf16(ctx, *c);
#else
  (void)ctx;
  (void)c;
  return nullptr;  // never called: HasBf16() is 0 on this target
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace kvforge_matmul
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvforge_matmul {
HWY_EXPORT(RunDirect);
HWY_EXPORT(RunDequantize);
HWY_EXPORT(HasBf16);
HWY_EXPORT(RunBf16);
namespace {

struct TensorInfo {
  std::vector<int64_t> shape;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
};

OrtStatus* describe(const OrtValue* value, TensorInfo& out) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  KVF_MM_TRY(g_api->GetTensorTypeAndShape(value, &info));
  size_t rank = 0;
  OrtStatus* st = g_api->GetDimensionsCount(info, &rank);
  if (!st) {
    out.shape.resize(rank);
    st = g_api->GetDimensions(info, out.shape.data(), rank);
  }
  if (!st) st = g_api->GetTensorElementType(info, &out.type);
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  return st;
}

int64_t elements(const std::vector<int64_t>& shape) {
  int64_t total = 1;
  for (int64_t d : shape) total *= d;
  return total;
}

OrtStatus* run_gemm(const Kernel& kernel, OrtKernelContext* ctx, const float* a, int64_t rows, float* weights,
                    float* y) {
  const int64_t a_shape[2] = {rows, kernel.k}, w_shape[2] = {kernel.n, kernel.k}, y_shape[2] = {rows, kernel.n};
  OrtValue* values[3] = {nullptr, nullptr, nullptr};
  OrtStatus* st = g_api->CreateTensorWithDataAsOrtValue(kernel.cpu, const_cast<float*>(a),
                                                        sizeof(float) * rows * kernel.k, a_shape, 2,
                                                        ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, &values[0]);
  if (!st) st = g_api->CreateTensorWithDataAsOrtValue(kernel.cpu, weights, sizeof(float) * kernel.n * kernel.k,
                                                      w_shape, 2, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, &values[1]);
  if (!st) st = g_api->CreateTensorWithDataAsOrtValue(kernel.cpu, y, sizeof(float) * rows * kernel.n, y_shape, 2,
                                                      ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, &values[2]);
  if (!st) {
    const OrtValue* inputs[2] = {values[0], values[1]};
    st = g_api->InvokeOp(ctx, kernel.gemm, inputs, 2, &values[2], 1);
  }
  for (OrtValue* v : values)
    if (v) g_api->ReleaseValue(v);
  return st;
}

OrtStatus* ORT_API_CALL compute(void* kernel_data, OrtKernelContext* ctx) {
  const Kernel& kernel = *static_cast<const Kernel*>(kernel_data);
  if (const char* why = kvforge_cpu::forced_target_problem()) return error(why);
  const OrtValue* inputs[2] = {nullptr, nullptr};
  TensorInfo info[2];
  for (size_t i = 0; i < 2; ++i) {
    KVF_MM_TRY(g_api->KernelContext_GetInput(ctx, i, &inputs[i]));
    if (!inputs[i]) return error("input " + std::to_string(i) + " is missing");
    KVF_MM_TRY(describe(inputs[i], info[i]));
  }
  const int64_t k = kernel.k, n = kernel.n, blocks = k / kBlock;
  if (info[0].shape.empty() || info[0].shape.back() != k)
    return error("input A's last dimension must be K = " + std::to_string(k));
  const int64_t block_bytes = kernel.bits == 4 ? kBlockBytes<4> : kBlockBytes<8>;
  if (info[1].shape != std::vector<int64_t>{n, blocks, block_bytes})
    return error("blocks must be [N, K / 32, " + std::to_string(block_bytes) + "] uint8 for bits = " +
                 std::to_string(kernel.bits));
  const int64_t rows = elements(info[0].shape) / k;
  std::vector<int64_t> out_shape(info[0].shape);
  out_shape.back() = n;
  OrtValue* out_value = nullptr;
  KVF_MM_TRY(g_api->KernelContext_GetOutput(ctx, 0, out_shape.data(), out_shape.size(), &out_value));
  void* y = nullptr;
  KVF_MM_TRY(g_api->GetTensorMutableData(out_value, &y));
  if (rows == 0) return nullptr;
  const void* data[2];
  for (size_t i = 0; i < 2; ++i) KVF_MM_TRY(g_api->GetTensorData(inputs[i], &data[i]));
  Call c{&kernel, rows, static_cast<const float*>(data[0]), static_cast<const uint8_t*>(data[1]),
         static_cast<float*>(y), nullptr};
  if (kernel.bits == 8 || rows <= kDirectRows) return HWY_DYNAMIC_DISPATCH(RunDirect)(ctx, &c);
  if (kernel.bf16 && HWY_DYNAMIC_DISPATCH(HasBf16)()) return HWY_DYNAMIC_DISPATCH(RunBf16)(ctx, &c);
  thread_local std::vector<float> scratch;  // the calling thread's: reused call after call, never shrunk
  scratch.resize(static_cast<size_t>(n * k));
  c.dequantized = scratch.data();
  KVF_MM_TRY(HWY_DYNAMIC_DISPATCH(RunDequantize)(ctx, &c));
  return run_gemm(kernel, ctx, c.x, rows, c.dequantized, static_cast<float*>(y));
}

OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** out) {
  Kernel kernel;
  for (auto [name, target] : {std::pair<const char*, int64_t*>{"K", &kernel.k}, {"N", &kernel.n}}) {
    if (OrtStatus* st = g_api->KernelInfoGetAttribute_int64(info, name, target)) {
      g_api->ReleaseStatus(st);
      return error(std::string("missing int attribute ") + name);
    }
  }
  if (kernel.k <= 0 || kernel.k % kBlock != 0 || kernel.n <= 0)
    return error("K must be a positive multiple of 32 and N positive, got K = " + std::to_string(kernel.k) +
                 ", N = " + std::to_string(kernel.n));
  kernel.bits = kvforge_ort::optional_int(g_api, info, "bits", 4);  // absent: engines built before 8-bit blocks
  if (kernel.bits != 4 && kernel.bits != 8)
    return error("bits must be 4 or 8, got " + std::to_string(kernel.bits));
  // Absent: float32 (engines built before it, `--cpuPrefillMatmul fp32`).
  kernel.bf16 = kvforge_ort::optional_int(g_api, info, "bf16", 0) != 0;
  // Gemm's kernel reads every attribute at creation: Y = A @ W^T (transB), alpha 1, beta 1 (no C is given).
  const int64_t trans_a = 0, trans_b = 1;
  const float one = 1.0f;
  OrtOpAttr* attrs[4] = {nullptr, nullptr, nullptr, nullptr};
  OrtStatus* st = g_api->CreateOpAttr("transA", &trans_a, 1, ORT_OP_ATTR_INT, &attrs[0]);
  if (!st) st = g_api->CreateOpAttr("transB", &trans_b, 1, ORT_OP_ATTR_INT, &attrs[1]);
  if (!st) st = g_api->CreateOpAttr("alpha", &one, 1, ORT_OP_ATTR_FLOAT, &attrs[2]);
  if (!st) st = g_api->CreateOpAttr("beta", &one, 1, ORT_OP_ATTR_FLOAT, &attrs[3]);
  const char* type_names[1] = {"T"};
  const ONNXTensorElementDataType types[1] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
  if (!st) st = g_api->CreateOp(info, "Gemm", "", 13, type_names, types, 1, attrs, 4, 2, 1, &kernel.gemm);
  for (OrtOpAttr* attr : attrs)
    if (attr) g_api->ReleaseOpAttr(attr);
  if (st) return st;
  st = g_api->CreateCpuMemoryInfo(OrtDeviceAllocator, OrtMemTypeDefault, &kernel.cpu);
  if (st) {
    g_api->ReleaseOp(kernel.gemm);
    return st;
  }
  *out = new Kernel(kernel);
  return nullptr;
}

void ORT_API_CALL destroy_kernel(void* data) {
  Kernel* kernel = static_cast<Kernel*>(data);
  if (kernel->gemm) g_api->ReleaseOp(kernel->gemm);
  if (kernel->cpu) g_api->ReleaseMemoryInfo(kernel->cpu);
  delete kernel;
}

const char* ORT_API_CALL op_name(const OrtCustomOp*) { return "MatMulBlocks"; }
size_t ORT_API_CALL input_count(const OrtCustomOp*) { return 2; }
size_t ORT_API_CALL output_count(const OrtCustomOp*) { return 1; }
ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp*, size_t index) {
  return index == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
ONNXTensorElementDataType ORT_API_CALL output_type(const OrtCustomOp*, size_t) {
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
OrtCustomOpInputOutputCharacteristic ORT_API_CALL required(const OrtCustomOp*, size_t) {
  return INPUT_OUTPUT_REQUIRED;
}

// Y has A's shape with the last dimension N (kvforge_ort::infer_last_dim says where it stays unknown).
OrtStatus* ORT_API_CALL infer_shape(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  const OrtOpAttr* attr = nullptr;
  KVF_MM_TRY(g_api->ShapeInferContext_GetAttribute(ctx, "N", &attr));
  int64_t n = 0;
  size_t written = 0;
  KVF_MM_TRY(g_api->ReadOpAttr(attr, ORT_OP_ATTR_INT, &n, sizeof n, &written));
  return kvforge_ort::infer_last_dim(g_api, ctx, [n](int64_t) { return n; });
}

OrtCustomOp make_op() {
  OrtCustomOp op = kvforge_ort::base_op();
  op.GetName = op_name;
  op.GetInputType = input_type;
  op.GetInputTypeCount = input_count;
  op.GetOutputType = output_type;
  op.GetOutputTypeCount = output_count;
  op.KernelDestroy = destroy_kernel;
  op.GetInputCharacteristic = required;
  op.GetOutputCharacteristic = required;
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  op.InferOutputShapeFn = infer_shape;
  return op;
}

OrtCustomOp g_matmul_blocks = make_op();

}  // namespace

// Whether many-row calls with `bf16` set run in bfloat16 here (1) or fall back to float32 SGEMM (0): the target
// chosen now (KVFORGE_CPU_TARGET applied) is AVX3_DL and this CPU has AVX512_BF16. Read by the tests (ctypes).
extern "C" __attribute__((visibility("default"))) int kvforge_matmul_bf16() {
  if (kvforge_cpu::forced_target_problem()) return 0;
  return HWY_DYNAMIC_DISPATCH(HasBf16)();
}

// Called by RegisterCustomOps (paged_attention.cc) with the API table it resolved.
OrtStatus* add_ops(OrtCustomOpDomain* domain, const OrtApi* api) {
  g_api = api;
  return api->CustomOpDomain_Add(domain, &g_matmul_blocks);
}

}  // namespace kvforge_matmul
#endif  // HWY_ONCE
