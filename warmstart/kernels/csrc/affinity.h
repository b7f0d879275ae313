// Pinning the OpenMP workers of the calling thread's team, one CPU each (what vLLM's CPU backend and llama.cpp's
// --cpu-strict do). Why: on a host where other processes keep the cores busy, the scheduler balances runnable tasks
// by count, so it may leave an engine's master and its worker time-sliced on one core while the neighbours share the
// other. Then every parallel region waits a scheduler slice for the worker, and a 2-thread decode that runs at
// ~50 tok/s under such a load falls to 1-3 tok/s (benchmarks/decode.py, under load). With one thread per CPU the
// team is never stacked on one core. warmstart/runner/affinity.py decides when to pin and pins the master itself.
#pragma once
#include <cstdint>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__linux__)
#include <sched.h>
#endif

namespace ws::affinity {

// Team threads t >= 1 of the calling thread's OpenMP pool (cpus.size() threads) each get the mask fill(t, set)
// writes; returns how many took it (0 without OpenMP or off Linux, or for fewer than 2 CPUs). libgomp keeps a pool
// per calling thread and gives team thread t the same pool thread every region, so the mask holds for every later
// region of this caller with up to cpus.size() threads.
template <typename Fill>
inline int64_t set_workers(const std::vector<int64_t>& cpus, const Fill& fill) {
  int64_t done = 0;
#if defined(_OPENMP) && defined(__linux__)
  const int n = static_cast<int>(cpus.size());
  if (n < 2) return 0;
#pragma omp parallel num_threads(n) reduction(+ : done)
  {
    const int t = omp_get_thread_num();
    if (t > 0) {
      cpu_set_t set;
      CPU_ZERO(&set);
      fill(t, set);
      if (sched_setaffinity(0, sizeof(set), &set) == 0) done += 1;
    }
  }
#else
  (void)cpus;
  (void)fill;
#endif
  return done;
}

// Team thread t (t >= 1) is pinned to cpus[t]; thread 0, the caller, is left as it is. Returns how many workers were
// pinned.
inline int64_t pin_workers(const std::vector<int64_t>& cpus) {
#if defined(__linux__)
  return set_workers(cpus, [&](int t, cpu_set_t& set) { CPU_SET(static_cast<int>(cpus[t]), &set); });
#else
  (void)cpus;
  return 0;
#endif
}

// Team threads t >= 1 may run on any of `cpus` (undoes pin_workers while the host is busy: warmstart/runner/
// affinity.py). Returns how many workers were set.
inline int64_t spread_workers(const std::vector<int64_t>& cpus) {
#if defined(__linux__)
  return set_workers(cpus, [&](int, cpu_set_t& set) {
    for (const int64_t c : cpus) CPU_SET(static_cast<int>(c), &set);
  });
#else
  (void)cpus;
  return 0;
#endif
}

}  // namespace ws::affinity
