// PagedAttention specialised for decode: one block per (query head, token, sequence).
//
// Decode reads every cached key once per query head and does ~2 flops per byte, so the kernel is built
// for memory-level parallelism rather than reuse: the 256 threads form independent "streams" of
// kLanesPerKey lanes, one 16-byte load per lane covering a whole key (or value) row; stream s takes keys
// s, s + streams, ... and keeps its own fp32 online softmax (max, sum, accumulator slice), loading
// kUnroll keys and values before using any of them. The streams are merged once through shared memory.
// Blocks of one GQA group are adjacent in the grid, so the group's repeated K/V reads hit L2.
//
// TensorRT AOT plugins get no workspace, so there is no split over keys across blocks: parallelism is
// num_q_heads * seq_len * batch blocks. The kernel is correct for any seq_len (query i of a row sees
// keys 0 .. start + i), which lets a backend use it for short chunks too.
// grid = (num_q_heads, seq_len, batch), block = 256, static shared memory only (<= 16.5 KiB).
#include "common.cuh"

namespace kvf {

constexpr int kDecodeThreads = 256;
constexpr int kDecodeUnroll = 4;
constexpr float kDecodeLog2e = 1.4426950408889634f;

template <int D, class S>
__device__ __forceinline__ void paged_decode(const float* __restrict__ query, const typename S::T* __restrict__ pool,
                                             const int* __restrict__ context_lengths,
                                             const int* __restrict__ start_index,
                                             const int* __restrict__ page_table, float* __restrict__ out,
                                             int seq_len, int num_q_heads, int num_kv_heads, int tokens_per_page,
                                             int pages_per_seq, int scale_bits) {
    constexpr int kElems = S::kElems;               // elements per lane: one 16-byte load
    constexpr int kLanesPerKey = D / kElems;        // 16 (fp16, 128), 8 (fp16 64 / fp8 128), 4 (fp8 64)
    constexpr int kStreams = kDecodeThreads / kLanesPerKey;
    __shared__ float red_max[kStreams];
    __shared__ float red_sum[kStreams];
    __shared__ __align__(16) float red_acc[kStreams * D];

    const int qh = blockIdx.x;
    const int i = blockIdx.y;
    const int b = blockIdx.z;
    const int tid = threadIdx.x;
    const int group = num_q_heads / num_kv_heads;
    const int head = qh / group;
    float* dst = out + (((i64)b * seq_len + i) * num_q_heads + qh) * D;
    if (i >= context_lengths[b]) {  // padding row: output is defined as zero
        for (int d = tid; d < D; d += kDecodeThreads) dst[d] = 0.0f;
        return;
    }
    const int* page_row = page_table + (i64)b * pages_per_seq;
    const int shift = log2_pow2(tokens_per_page);
    // Keys 0 .. start + i, never past the page-table row.
    const int num_keys = (int)min64((i64)start_index[b] + i + 1, (i64)pages_per_seq << shift);
    const i64 head_offset = (i64)head * tokens_per_page * D;
    const i64 v_offset = (i64)num_kv_heads * tokens_per_page * D;  // K -> V inside a page
    const i64 page_elems = 2 * v_offset;

    const int lane = tid % kLanesPerKey;
    const int stream = tid / kLanesPerKey;
    // Shuffle mask of this stream's lanes: streams finish their key loops at different times, so a
    // full-warp mask would name lanes that have left the loop.
    const unsigned mask = (kLanesPerKey == 32 ? 0xffffffffu : ((1u << kLanesPerKey) - 1u))
                          << ((tid & 31) & ~(kLanesPerKey - 1));

    float q[kElems];
    {
        const float qscale = __int_as_float(scale_bits) * kDecodeLog2e;
        const float4* src = reinterpret_cast<const float4*>(
            query + (((i64)b * seq_len + i) * num_q_heads + qh) * D + lane * kElems);
#pragma unroll
        for (int e = 0; e < kElems / 4; ++e) {
            const float4 v = src[e];
            q[4 * e] = v.x * qscale;
            q[4 * e + 1] = v.y * qscale;
            q[4 * e + 2] = v.z * qscale;
            q[4 * e + 3] = v.w * qscale;
        }
    }

    float run_max = neg_inf();
    float run_sum = 0.0f;
    float acc[kElems];
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc[e] = 0.0f;

    for (int key0 = stream; key0 < num_keys; key0 += kStreams * kDecodeUnroll) {
        uint4 k_raw[kDecodeUnroll], v_raw[kDecodeUnroll];
        bool ok[kDecodeUnroll];
#pragma unroll
        for (int u = 0; u < kDecodeUnroll; ++u) {
            const int pos = key0 + u * kStreams;
            int page = -1;
            if (pos < num_keys) page = page_row[pos >> shift];
            ok[u] = page >= 0;
            if (ok[u]) {
                const typename S::T* src = pool + (i64)page * page_elems + head_offset +
                                           (i64)(pos & (tokens_per_page - 1)) * D + lane * kElems;
                k_raw[u] = load16(src);
                v_raw[u] = load16(src + v_offset);
            } else {
                k_raw[u] = v_raw[u] = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        float score[kDecodeUnroll];
#pragma unroll
        for (int u = 0; u < kDecodeUnroll; ++u) {
            float k[kElems];
            S::unpack16(k_raw[u], k);
            float dot = 0.0f;
#pragma unroll
            for (int e = 0; e < kElems; ++e) dot += q[e] * k[e];
            score[u] = dot;
        }
        // Butterfly all-reduce: every lane of the stream ends with the bitwise-same score.
#pragma unroll
        for (int off = kLanesPerKey / 2; off > 0; off >>= 1) {
#pragma unroll
            for (int u = 0; u < kDecodeUnroll; ++u) score[u] += __shfl_xor_sync(mask, score[u], off);
        }
        float new_max = run_max;
#pragma unroll
        for (int u = 0; u < kDecodeUnroll; ++u)
            if (ok[u]) new_max = fmaxf(new_max, score[u]);
        if (new_max == neg_inf()) continue;  // nothing readable in this step (only on -1 pages)
        const float correction = exp2f(run_max - new_max);
        run_sum *= correction;
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[e] *= correction;
#pragma unroll
        for (int u = 0; u < kDecodeUnroll; ++u) {
            if (!ok[u]) continue;
            const float p = exp2f(score[u] - new_max);
            run_sum += p;
            float v[kElems];
            S::unpack16(v_raw[u], v);
#pragma unroll
            for (int e = 0; e < kElems; ++e) acc[e] += p * v[e];
        }
        run_max = new_max;
    }

    // Merge the streams: rescale each to the block max, sum, normalise.
    if (lane == 0) {
        red_max[stream] = run_max;
        red_sum[stream] = run_sum;
    }
    // stream * D + lane * kElems == tid * kElems: each thread's slice is contiguous.
#pragma unroll
    for (int e = 0; e < kElems / 4; ++e)
        reinterpret_cast<float4*>(red_acc + tid * kElems)[e] =
            make_float4(acc[4 * e], acc[4 * e + 1], acc[4 * e + 2], acc[4 * e + 3]);
    __syncthreads();
    for (int d = tid; d < D; d += kDecodeThreads) {
        float block_max = neg_inf();
        for (int s = 0; s < kStreams; ++s) block_max = fmaxf(block_max, red_max[s]);
        if (block_max == neg_inf()) {  // no readable key at all (every page -1): nothing to average
            dst[d] = 0.0f;
            continue;
        }
        float total = 0.0f, value = 0.0f;
        for (int s = 0; s < kStreams; ++s) {
            const float w = exp2f(red_max[s] - block_max);  // 0 for streams that saw no key
            total += red_sum[s] * w;
            value += red_acc[s * D + d] * w;
        }
        dst[d] = value / total;
    }
}

}  // namespace kvf

// Parameter order is TensorRT AOT plugins': input pointers, the int32 scalars, then the output pointer.
#define KVF_DECODE_ENTRY(NAME, D, STORAGE)                                                                    \
    extern "C" __global__ void __launch_bounds__(kvf::kDecodeThreads)                                          \
        NAME(const float* __restrict__ query, const STORAGE::T* __restrict__ pool,                             \
             const int* __restrict__ context_lengths, const int* __restrict__ start_index,                     \
             const int* __restrict__ page_table, int seq_len, int num_q_heads, int num_kv_heads,                 \
             int tokens_per_page, int pages_per_seq, int scale_bits, float* __restrict__ out) {                  \
        kvf::paged_decode<D, STORAGE>(query, pool, context_lengths, start_index, page_table, out, seq_len,    \
                                      num_q_heads, num_kv_heads, tokens_per_page, pages_per_seq, scale_bits); \
    }

KVF_DECODE_ENTRY(kvforge_paged_decode_fp16_d64, 64, kvf::Fp16)
KVF_DECODE_ENTRY(kvforge_paged_decode_fp16_d128, 128, kvf::Fp16)
KVF_DECODE_ENTRY(kvforge_paged_decode_fp8_d64, 64, kvf::Fp8)
KVF_DECODE_ENTRY(kvforge_paged_decode_fp8_d128, 128, kvf::Fp8)
