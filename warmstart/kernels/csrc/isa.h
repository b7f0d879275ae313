// Which vector ISA the kernels use, chosen once per process at run time: the extension is built for x86-64-v3
// (AVX2), and the AVX-512 code (qlinear_vnni.h, paged_attention_avx512.h) is compiled by target pragmas and runs
// only where the CPU has it. Shared by every kernel module (one value per process, see isa_level below).
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>
#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <c10/util/Exception.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WS_VNNI512 1
#else
#define WS_VNNI512 0
#endif

namespace ws::qlinear {

// Which kernels run: 3 = AVX-512 VNNI (and paged_attention_avx512.h) plus AMX-BF16 tiles for the panel route (8+ rows; qlinear_vnni.h's amx namespace),
// where the CPU has them and AVX512-BF16 and Linux grants this process the tile state; 2 = AVX-512 VNNI; 1 = AVX2
// (0: a build without AVX2). The CPU's best by default; WARMSTART_KERNEL_ISA=avx512-vnni or avx2 (or set_isa) holds
// it lower, for A/B runs and for the tests of each. One value per process: a function-local static of an inline
// function is one symbol across the four modules (see pool.h).
inline bool amx_usable() {
#if WS_VNNI512
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return false;  // bf16, tile
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) return false;                       // avx512-bf16
  // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: the process-wide permission to use the tile data (Linux 5.16+)
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
  return false;
#endif
}

// Probed once per process (set_isa asks again for every change of level).
inline int cpu_isa() {
  static const int best = [] {
#if WS_VNNI512
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
      return amx_usable() ? 3 : 2;
#endif
#if defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
  }();
  return best;
}

inline int& isa_level() {
  static int level = [] {
    const int best = cpu_isa();
    const char* env = std::getenv("WARMSTART_KERNEL_ISA");
    if (env && std::strcmp(env, "avx2") == 0) return best < 1 ? best : 1;
    if (env && std::strcmp(env, "avx512-vnni") == 0) return best < 2 ? best : 2;
    return best;
  }();
  return level;
}

inline std::string isa_name(int level) {
  return level == 3 ? "amx-bf16" : level == 2 ? "avx512-vnni" : level == 1 ? "avx2" : "scalar";
}
inline std::string isa() { return isa_name(isa_level()); }

// Sets the level by name ("amx-bf16", "avx512-vnni" or "avx2"), at most the CPU's; returns the name of the level now
// in force. (A build without AVX2 runs its scalar code whatever this says.)
inline std::string set_isa(const std::string& name) {
  const int want = name == "amx-bf16" ? 3 : name == "avx512-vnni" ? 2 : name == "avx2" ? 1 : -1;
  TORCH_CHECK(want >= 0, "unknown kernel ISA '", name, "' (amx-bf16, avx512-vnni or avx2)");
  isa_level() = std::min(want, cpu_isa());
  return isa();
}

}  // namespace ws::qlinear
