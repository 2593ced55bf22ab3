// CPU emulation of the few CUDA features the kvforge kernels use, so that their indexing, masking and
// synchronisation can be checked against the numpy reference on machines without a GPU
// (scripts/gpu_check.py --emulate). Not a performance tool and not part of any engine.
//
// Every CUDA thread of a block is a fiber with its own stack (x86-64 System V context switch below);
// blocks run one after another. __syncthreads() waits for all live threads of the block; __shfl_xor_sync
// waits for every lane named in the mask and checks that they all call it with the same mask, and a wait
// that can never finish (a lane named in a mask has exited, a barrier some thread never reaches) is
// reported as a deadlock instead of hanging. __shared__ variables become function statics, shared by
// the fibers of the block being run.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if !defined(__x86_64__) || !defined(__linux__)
#error "the kvforge CUDA emulation switches fibers with x86-64 Linux assembly"
#endif

#define KVF_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

namespace kvf_emu {

struct Fiber {
    dim3 tid;
    int linear = 0;
    void* sp = nullptr;
    char* stack = nullptr;
    bool done = false;
    unsigned barriers = 0;  // __syncthreads calls made
    unsigned shuffles = 0;  // __shfl_xor_sync calls made
    float shfl_value[2] = {0.0f, 0.0f};  // double-buffered by call parity
    unsigned shfl_mask[2] = {0u, 0u};
};

extern Fiber* current;
extern dim3 block_idx, block_dim, grid_dim;

void yield();             // back to the scheduler
[[noreturn]] void fail(const std::string& why);
Fiber& thread_at(int linear);
int live_threads();

}  // namespace kvf_emu

#define threadIdx (kvf_emu::current->tid)
#define blockIdx (kvf_emu::block_idx)
#define blockDim (kvf_emu::block_dim)
#define gridDim (kvf_emu::grid_dim)

inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float __int_as_float(int i) { return __uint_as_float((unsigned)i); }
inline unsigned __float2uint_rn(float f) { return (unsigned)std::nearbyintf(f); }  // default mode: to nearest even
// Built with -ffp-contract=off, so plain operators round every step like the _rn intrinsics.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
template <class T>
inline T __ldg(const T* p) {
    return *p;
}

inline void __syncthreads() {
    kvf_emu::Fiber* self = kvf_emu::current;
    const unsigned mine = ++self->barriers;
    for (;;) {
        bool all = true;
        for (int t = 0, n = (int)(blockDim.x * blockDim.y * blockDim.z); t < n && all; ++t) {
            const kvf_emu::Fiber& other = kvf_emu::thread_at(t);
            all = other.done || other.barriers >= mine;
        }
        if (all) return;
        kvf_emu::yield();
    }
}

inline float __shfl_xor_sync(unsigned mask, float value, int lane_mask) {
    kvf_emu::Fiber* self = kvf_emu::current;
    const int lane = self->linear & 31, warp0 = self->linear - lane;
    const int partner = lane ^ lane_mask;
    if (!(mask >> lane & 1u)) kvf_emu::fail("__shfl_xor_sync: calling lane not in mask");
    if (partner > 31 || !(mask >> partner & 1u)) kvf_emu::fail("__shfl_xor_sync: partner lane not in mask");
    const unsigned mine = ++self->shuffles;
    self->shfl_value[mine & 1] = value;
    self->shfl_mask[mine & 1] = mask;
    for (;;) {
        bool all = true;
        for (int l = 0; l < 32 && all; ++l) {
            if (!(mask >> l & 1u)) continue;
            const kvf_emu::Fiber& other = kvf_emu::thread_at(warp0 + l);
            all = other.shuffles >= mine;
            if (!all && other.done) kvf_emu::fail("__shfl_xor_sync: a lane named in the mask has exited");
        }
        if (all) break;
        kvf_emu::yield();
    }
    const kvf_emu::Fiber& other = kvf_emu::thread_at(warp0 + partner);
    if (other.shfl_mask[mine & 1] != mask) kvf_emu::fail("__shfl_xor_sync: lanes disagree on the mask");
    return other.shfl_value[mine & 1];
}
