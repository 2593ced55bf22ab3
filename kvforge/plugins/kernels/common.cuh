// Storage conversions and small helpers shared by the paged-KV kernels.
//
// NVRTC ships no cuda_fp16.h / cuda_fp8.h here, so the conversions are spelled out: FP16 through the
// PTX `cvt` instructions (exact IEEE round-to-nearest-even), E4M3 in integer arithmetic. The E4M3
// encoder/decoder have numpy twins in kvforge/plugins/kernel_specs.py that the tests hold against ml_dtypes.
#pragma once

namespace kvf {

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

__device__ __forceinline__ i64 min64(i64 a, i64 b) { return a < b ? a : b; }

__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }

#ifdef KVF_HOST_EMULATION
// emulation/cuda_host.h runs these kernels on the CPU for tests; _Float16 rounds to nearest even too.
__device__ __forceinline__ u16 f32_to_f16(float x) {
    const _Float16 h = (_Float16)x;
    u16 bits;
    __builtin_memcpy(&bits, &h, 2);
    return bits;
}

__device__ __forceinline__ float f16_to_f32(u16 bits) {
    _Float16 h;
    __builtin_memcpy(&h, &bits, 2);
    return (float)h;
}
#else
__device__ __forceinline__ u16 f32_to_f16(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
    return x;
}
#endif

// float32 -> E4M3 (float8_e4m3fn): round-to-nearest-even; NaN stays NaN (S.1111.111); |x| >= 448, inf
// included, saturates to +-448 like ONNX Cast(saturate=1) and PTX cvt.satfinite. ml_dtypes agrees for
// every |x| <= 464 and gives NaN above (no saturation): see kernel_specs.e4m3_encode.
__device__ __forceinline__ u8 f32_to_e4m3(float x) {
    const u32 bits = __float_as_uint(x);
    const u32 sign = (bits >> 24) & 0x80u;
    const u32 mag = bits & 0x7fffffffu;
    if (mag > 0x7f800000u) return (u8)(sign | 0x7fu);  // NaN
    if (mag >= 0x43e00000u) return (u8)(sign | 0x7eu);  // >= 448: saturate
    if (mag < 0x3c800000u) {
        // Below 2^-6 E4M3 is subnormal with a fixed step of 2^-9: scale (exactly) and round to an integer
        // in [0, 8]; 8 is the bit pattern of 2^-6, the smallest normal, so the carry is free.
        return (u8)(sign | __float2uint_rn(__uint_as_float(mag) * 512.0f));
    }
    // Normal: drop 20 mantissa bits with round-to-nearest-even, then rebias the exponent 127 -> 7.
    const u32 rounded = mag + 0x7ffffu + ((mag >> 20) & 1u);
    return (u8)(sign | ((rounded >> 20) - (120u << 3)));
}

// E4M3 -> float32, exact: place exponent+mantissa in a float's bits and rescale by 2^(127-7) (this also
// maps E4M3 subnormals onto float subnormals correctly; the build never enables flush-to-zero).
__device__ __forceinline__ float e4m3_to_f32(u32 byte) {
    const u32 em = byte & 0x7fu;
    float mag = __uint_as_float(em << 20) * 0x1p120f;
    if (em == 0x7fu) mag = __uint_as_float(0x7fc00000u);
    return __uint_as_float(__float_as_uint(mag) | ((byte & 0x80u) << 24));
}

// Storage traits: T is the pool element; unpack16 turns one 16-byte load into kElems floats.
struct Fp16 {
    typedef u16 T;
    static constexpr int kElems = 8;
    __device__ __forceinline__ static T encode(float x) { return f32_to_f16(x); }
    __device__ __forceinline__ static void unpack16(const uint4 raw, float* out) {
        const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            out[2 * k] = f16_to_f32((u16)(w[k] & 0xffffu));
            out[2 * k + 1] = f16_to_f32((u16)(w[k] >> 16));
        }
    }
};

struct Fp8 {
    typedef u8 T;
    static constexpr int kElems = 16;
    __device__ __forceinline__ static T encode(float x) { return f32_to_e4m3(x); }
    __device__ __forceinline__ static void unpack16(const uint4 raw, float* out) {
        const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
#pragma unroll
            for (int byte = 0; byte < 4; ++byte) out[4 * k + byte] = e4m3_to_f32((w[k] >> (8 * byte)) & 0xffu);
        }
    }
};

__device__ __forceinline__ uint4 load16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// log2 of a power of two (tokens_per_page is validated as one on the host).
__device__ __forceinline__ int log2_pow2(int x) { return 31 - __clz(x); }

// Pool addressing, [num_pages, 2 (K, V), num_kv_heads, tokens_per_page, head_dim]: element offset of
// (page, kv, head, token 0, dim 0).
__device__ __forceinline__ i64 pool_offset(int page, int kv, int head, int num_kv_heads, int tokens_per_page,
                                           int head_dim) {
    return ((((i64)page * 2 + kv) * num_kv_heads + head) * tokens_per_page) * head_dim;
}

}  // namespace kvf
