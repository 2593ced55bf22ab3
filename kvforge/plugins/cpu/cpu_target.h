// Which compiled target the kvforge.cpu kernels run: Highway picks the best one this CPU supports, and
// KVFORGE_CPU_TARGET (a lower-case Highway target name: scalar, sse4, avx2, avx3, avx3_dl; neon on ARM) forces one.
#pragma once

namespace kvforge_cpu {

constexpr const char* kTargetEnv = "KVFORGE_CPU_TARGET";

// Applies KVFORGE_CPU_TARGET to Highway's dispatch when it changed since the last call (so tests and benchmarks can
// force each target in turn in one process) and returns nullptr, or the one-line reason it cannot: an unknown name,
// a target not compiled into this library or one this CPU cannot run. Every op calls it before dispatching.
const char* forced_target_problem();

}  // namespace kvforge_cpu
