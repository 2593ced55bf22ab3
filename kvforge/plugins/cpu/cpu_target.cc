// Run-time choice of the kernels' compiled target (cpu_target.h): Highway's own choice, or KVFORGE_CPU_TARGET's.

#include "cpu_target.h"

#include <hwy/highway.h>
#include <hwy/targets.h>

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>

namespace kvforge_cpu {
namespace {

std::mutex g_mutex;
std::string g_applied = "\x01";  // the KVFORGE_CPU_TARGET value last applied (never a real value at first)
std::string g_problem;           // why that value was refused; empty when it was applied

// What this CPU runs of what the library holds, measured before any forcing (Highway's mock replaces it).
int64_t runnable() {
  static const int64_t mask = [] {
    hwy::SetSupportedTargetsForTest(0);
    return hwy::SupportedTargets() & HWY_TARGETS;
  }();
  return mask;
}

std::string lower(const char* name) {
  std::string out(name);
  for (char& ch : out) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return out;
}

// The compiled targets' names, best first ("avx3_dl avx3 avx2 sse4 emu128").
std::string compiled_names() {
  std::string out;
  for (int64_t bits = HWY_TARGETS; bits != 0; bits &= bits - 1) {
    const int64_t target = bits & -bits;
    out += (out.empty() ? "" : " ") + lower(hwy::TargetName(target));
  }
  return out;
}

int64_t target_named(const std::string& name) {
  for (int64_t bits = HWY_TARGETS; bits != 0; bits &= bits - 1) {
    const int64_t target = bits & -bits;
    if (lower(hwy::TargetName(target)) == name) return target;
  }
  return 0;
}

}  // namespace

const char* forced_target_problem() {
  const char* raw = std::getenv(kTargetEnv);
  const std::string want = raw ? lower(raw) : std::string();
  std::lock_guard<std::mutex> lock(g_mutex);
  if (want == g_applied) return g_problem.empty() ? nullptr : g_problem.c_str();
  const int64_t cpu = runnable();
  g_problem.clear();
  if (want.empty()) {
    hwy::SetSupportedTargetsForTest(0);  // Highway's own choice: the best compiled target this CPU runs
  } else {
    const int64_t target = target_named(want);
    if (target == 0) {
      g_problem = std::string(kTargetEnv) + "=" + want + " is not a compiled target (compiled: " + compiled_names() +
                  ")";
    } else if ((cpu & target) == 0) {
      g_problem = std::string(kTargetEnv) + "=" + want + " is compiled but this CPU cannot run it";
    } else {
      hwy::SetSupportedTargetsForTest(target);
    }
  }
  if (g_problem.empty()) hwy::GetChosenTarget().Update(hwy::SupportedTargets());
  g_applied = want;
  return g_problem.empty() ? nullptr : g_problem.c_str();
}

}  // namespace kvforge_cpu

// For cpu_kernel.py (ctypes): the compiled targets, best first, space-separated.
extern "C" __attribute__((visibility("default"))) const char* kvforge_cpu_compiled_targets() {
  static const std::string names = kvforge_cpu::compiled_names();
  return names.c_str();
}

// The compiled targets this CPU runs, best first.
extern "C" __attribute__((visibility("default"))) const char* kvforge_cpu_runnable_targets() {
  static const std::string names = [] {
    std::string out;
    for (int64_t bits = kvforge_cpu::runnable(); bits != 0; bits &= bits - 1)
      out += (out.empty() ? "" : " ") + kvforge_cpu::lower(hwy::TargetName(bits & -bits));
    return out;
  }();
  return names.c_str();
}

// The target the kernels run now (KVFORGE_CPU_TARGET applied), or "" when its value is refused.
extern "C" __attribute__((visibility("default"))) const char* kvforge_cpu_chosen_target() {
  if (kvforge_cpu::forced_target_problem()) return "";
  const int64_t supported = hwy::SupportedTargets() & HWY_TARGETS;
  static thread_local std::string name;
  name = kvforge_cpu::lower(hwy::TargetName(supported & -supported));
  return name.c_str();
}

// Why KVFORGE_CPU_TARGET's value is refused, or "" when it is not.
extern "C" __attribute__((visibility("default"))) const char* kvforge_cpu_target_problem() {
  const char* why = kvforge_cpu::forced_target_problem();
  return why ? why : "";
}
