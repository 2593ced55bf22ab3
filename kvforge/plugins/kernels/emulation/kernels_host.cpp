// The kvforge kernels compiled as C++ for the CPU emulation in cuda_host.h, behind one C entry point:
//   int kvf_emu_launch(name, grid xyz, block xyz, void** args, char* error, int error_len)
// `args` follows cuLaunchKernel's kernelParams: args[i] points at the i-th argument's value.
// Build: g++ -std=c++17 -O1 -ffp-contract=off -fno-strict-aliasing -shared -fPIC -I plugins/kernels ...
#include "emulation/cuda_host.h"

#include "attention.cu"
#include "copy.cu"
#include "decode.cu"
#include "kv_write.cu"

#include <cstdlib>
#include <stdexcept>
#include <utility>

namespace kvf_emu {

Fiber* current = nullptr;
dim3 block_idx, block_dim, grid_dim;

namespace {

constexpr size_t kStackBytes = 256 * 1024;
std::vector<Fiber> fibers;  // grows to the largest block seen; `active` of them run
int active = 0;
void* scheduler_sp = nullptr;
void (*kernel_body)(void**) = nullptr;
void** kernel_args = nullptr;
bool failed = false;
std::string failure;

struct Failure {};

}  // namespace

extern "C" void kvf_emu_switch(void** save_sp, void* load_sp);
// Save the callee-saved registers on the current stack, store its pointer, load the other stack, restore.
asm(R"(
    .text
    .globl kvf_emu_switch
    .type kvf_emu_switch, @function
kvf_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size kvf_emu_switch, .-kvf_emu_switch
)");

void yield() { kvf_emu_switch(&current->sp, scheduler_sp); }

void fail(const std::string& why) {
    failed = true;
    failure = why + " (block " + std::to_string(block_idx.x) + "," + std::to_string(block_idx.y) + "," +
              std::to_string(block_idx.z) + " thread " + std::to_string(current ? current->linear : -1) + ")";
    throw Failure{};
}

Fiber& thread_at(int linear) { return fibers[linear]; }

int live_threads() {
    int n = 0;
    for (int t = 0; t < active; ++t) n += !fibers[t].done;
    return n;
}

void fiber_main() {
    try {
        if (!failed) kernel_body(kernel_args);
    } catch (const Failure&) {
    }
    current->done = true;
    for (;;) yield();  // the scheduler never resumes a finished fiber
}

namespace {

void start_fiber(Fiber& f) {
    // Initial frame, popped by kvf_emu_switch: six callee-saved registers, then the "return" into
    // fiber_main, above it a fake return address so the entry sees rsp % 16 == 8 as after a call.
    auto* top = reinterpret_cast<uintptr_t*>(
        (reinterpret_cast<uintptr_t>(f.stack + kStackBytes) & ~uintptr_t(15)));
    *--top = 0;
    *--top = reinterpret_cast<uintptr_t>(&fiber_main);
    for (int r = 0; r < 6; ++r) *--top = 0;
    f.sp = top;
}

bool run_block(int threads) {
    for (int t = 0; t < threads; ++t) {
        Fiber& f = fibers[t];
        f.tid.x = t % block_dim.x;
        f.tid.y = (t / block_dim.x) % block_dim.y;
        f.tid.z = t / (block_dim.x * block_dim.y);
        f.linear = t;
        f.done = false;
        f.barriers = f.shuffles = 0;
        start_fiber(f);
    }
    int live = threads;
    while (live > 0 && !failed) {
        // One round: every live fiber runs until it finishes or waits. No fiber finishing and no counter
        // moving in a whole round means nobody can ever move again.
        unsigned long long before = 0, after = 0;
        for (int t = 0; t < threads; ++t) before += fibers[t].barriers + fibers[t].shuffles;
        int finished = 0;
        for (int t = 0; t < threads && !failed; ++t) {
            Fiber& f = fibers[t];
            if (f.done) continue;
            current = &f;
            kvf_emu_switch(&scheduler_sp, f.sp);
            finished += f.done;
        }
        current = nullptr;
        live -= finished;
        for (int t = 0; t < threads; ++t) after += fibers[t].barriers + fibers[t].shuffles;
        if (live > 0 && finished == 0 && after == before && !failed) {
            failed = true;
            failure = "deadlock: threads wait at a barrier or shuffle that the others never reach (block " +
                      std::to_string(block_idx.x) + "," + std::to_string(block_idx.y) + "," +
                      std::to_string(block_idx.z) + ")";
        }
    }
    return !failed;
}

template <class... A, size_t... I>
void call_with(void (*fn)(A...), void** args, std::index_sequence<I...>) {
    fn(*reinterpret_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <class... A>
constexpr size_t arity(void (*)(A...)) {
    return sizeof...(A);
}

#define KVF_EMU_KERNEL(NAME) \
    {#NAME, [](void** args) { call_with(&NAME, args, std::make_index_sequence<arity(&NAME)>{}); }}

struct Entry {
    const char* name;
    void (*body)(void**);
};

const Entry kEntries[] = {
    KVF_EMU_KERNEL(kvforge_paged_kv_write_fp16),      KVF_EMU_KERNEL(kvforge_paged_kv_write_fp8),
    KVF_EMU_KERNEL(kvforge_paged_attention_fp16_d64), KVF_EMU_KERNEL(kvforge_paged_attention_fp16_d128),
    KVF_EMU_KERNEL(kvforge_paged_attention_fp8_d64),  KVF_EMU_KERNEL(kvforge_paged_attention_fp8_d128),
    KVF_EMU_KERNEL(kvforge_paged_decode_fp16_d64),    KVF_EMU_KERNEL(kvforge_paged_decode_fp16_d128),
    KVF_EMU_KERNEL(kvforge_paged_decode_fp8_d64),     KVF_EMU_KERNEL(kvforge_paged_decode_fp8_d128),
    KVF_EMU_KERNEL(kvforge_copy_page_to_slot),        KVF_EMU_KERNEL(kvforge_copy_slot_to_page),
};

}  // namespace
}  // namespace kvf_emu

extern "C" int kvf_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                              unsigned bz, void** args, char* error, int error_len) {
    using namespace kvf_emu;
    kernel_body = nullptr;
    for (const Entry& e : kEntries)
        if (std::strcmp(e.name, name) == 0) kernel_body = e.body;
    failed = false;
    failure.clear();
    if (kernel_body == nullptr) {
        failed = true;
        failure = std::string("no kernel named ") + name;
    }
    const int threads = (int)(bx * by * bz);
    if (!failed && (threads < 1 || threads > 1024)) {
        failed = true;
        failure = "block of " + std::to_string(threads) + " threads";
    }
    if (!failed) {
        if ((int)fibers.size() < threads) {
            const size_t had = fibers.size();
            fibers.resize(threads);
            for (size_t t = had; t < fibers.size(); ++t) fibers[t].stack = static_cast<char*>(std::malloc(kStackBytes));
        }
        active = threads;
        kernel_args = args;
        grid_dim = dim3{gx, gy, gz};
        block_dim = dim3{bx, by, bz};
        for (unsigned z = 0; z < gz && !failed; ++z)
            for (unsigned y = 0; y < gy && !failed; ++y)
                for (unsigned x = 0; x < gx && !failed; ++x) {
                    block_idx = dim3{x, y, z};
                    run_block(threads);
                }
    }
    if (failed && error != nullptr && error_len > 0) {
        std::strncpy(error, failure.c_str(), (size_t)error_len - 1);
        error[error_len - 1] = '\0';
    }
    return failed ? 1 : 0;
}
