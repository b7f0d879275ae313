// An experiment, not warmstart code: what a decode step's thread team could get on a host whose cores are busy,
// if (a) no thread were "the caller" and (b) a chunk whose thread lost its core were run again by a thread that has
// one. Driven by benchmarks/roving_caller.py (which builds this file with g++ and runs it quiet and under load).
//
// A step is kRegions parallel regions (a batch-1 decode step of the default model runs about 210), each region
// cut into `chunks` chunks claimed from a shared counter (as kernels/csrc/pool.h does), with a short serial segment
// before each region (norms, views, the next kernel's setup). Modes, on 2 threads pinned one per CPU as the engine's
// step is:
//   one     one thread runs everything (what the adaptive team falls back to under load)
//   fixed   today's pool: thread 0 runs the serial segments and opens each region; both claim chunks; thread 0
//           waits for every chunk. If thread 0 loses its CPU nothing opens; if thread 1 loses it mid-chunk,
//           thread 0 waits for that chunk.
//   roving  whichever thread finishes a region's last chunk runs the next serial segment and opens the next region
//   rescueN roving, and a thread that finds nothing left to claim (after N pause loops) runs a chunk that is still
//           in flight itself; the first to finish a chunk counts it.
//   fixed_rescueN  fixed, and thread 0 runs a chunk still in flight instead of waiting for it (rescue without
//           roving: what a change to the pool alone could do)
// The chunk bodies are idempotent (B = A * f + c), so a chunk run twice writes the same values. This prototype does
// not guard against what a real engine must: a thread that resumes late finishing a chunk of a region that is long
// over, after its buffers were reused. A real version needs every buffer of a step written once (an arena per
// step, recycled only after every thread has left the step) and the step's layer loop as data (a list of regions)
// that any thread can advance, instead of C++ control flow on one thread's stack.
#include <immintrin.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int kRegions = 210;  // per step
constexpr long kStepsPerRound = 20;
int chunks = 8;
long work_floats = 0, serial_iters = 0;
std::vector<float> A, B;
volatile float sink;

void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  sched_setaffinity(0, sizeof s, &s);
}

void chunk_work(long region, int c) {
  const long per = work_floats / chunks, b = c * per, e = b + per;
  const float f = 1.0001f + float(region % kRegions) * 1e-9f;
  for (long i = b; i < e; ++i) B[i] = A[i] * f + 0.5f;
}

void serial_work(long region) {
  float x = float(region % kRegions);
  for (long i = 0; i < serial_iters; ++i) x = x * 1.0000001f + 1e-7f;
  sink = x;
}

// state: (region << 16) | next unclaimed chunk
struct Team {
  std::atomic<long> state{0xffff};
  std::atomic<long> done{0};
  std::atomic<int> chunk_done[64] = {};
  std::atomic<bool> stop{false};
  long end = 0;

  // the first to finish chunk c of region r counts it; the last count runs the next serial segment and opens r + 1
  void finish(long r, int c, bool roving) {
    int zero = 0;
    if (!chunk_done[c].compare_exchange_strong(zero, 1)) return;
    if (done.fetch_add(1) + 1 != chunks || !roving) return;
    for (int i = 0; i < chunks; ++i) chunk_done[i].store(0, std::memory_order_relaxed);
    done.store(0, std::memory_order_relaxed);
    if (r + 1 < end) serial_work(r + 1);
    state.store((r + 1) << 16, std::memory_order_release);
  }

  // claims (and, with rescue >= 0, re-runs) chunks until the step is over (roving) or stop (fixed's thread 1)
  void claim_loop(bool roving, long rescue) {
    long idle = 0;
    for (;;) {
      if (stop.load(std::memory_order_relaxed)) return;
      long s = state.load(std::memory_order_acquire);
      const long r = s >> 16, next = s & 0xffff;
      if (roving && r >= end) return;
      if (next >= chunks) {
        if (rescue < 0 || ++idle < rescue) {
          _mm_pause();
          continue;
        }
        idle = 0;
        int c = -1;
        for (int i = 0; i < chunks && c < 0; ++i)
          if (!chunk_done[i].load(std::memory_order_acquire)) c = i;
        if (c < 0 || (state.load(std::memory_order_acquire) >> 16) != r) continue;
        chunk_work(r, c);
        if ((state.load(std::memory_order_acquire) >> 16) == r) finish(r, c, roving);
        continue;
      }
      idle = 0;
      if (!state.compare_exchange_weak(s, s + 1)) continue;
      chunk_work(r, int(next));
      if ((state.load(std::memory_order_acquire) >> 16) == r) finish(r, int(next), roving);
    }
  }

  // fixed: thread 0's loop (serial segment, open, claim, wait for every chunk; with rescue >= 0, run a chunk still
  // in flight instead of waiting)
  void caller_loop(long rescue) {
    for (long r = 0; r < end; ++r) {
      serial_work(r);
      for (int i = 0; i < chunks; ++i) chunk_done[i].store(0, std::memory_order_relaxed);
      done.store(0, std::memory_order_relaxed);
      state.store(r << 16, std::memory_order_release);
      for (;;) {
        long s = state.load(std::memory_order_acquire);
        const long next = s & 0xffff;
        if (next >= chunks) break;
        if (!state.compare_exchange_weak(s, s + 1)) continue;
        chunk_work(r, int(next));
        finish(r, int(next), false);
      }
      for (long idle = 0; done.load(std::memory_order_acquire) < chunks;) {
        if (rescue < 0 || ++idle < rescue) {
          _mm_pause();
          continue;
        }
        idle = 0;
        for (int i = 0; i < chunks; ++i)
          if (!chunk_done[i].load(std::memory_order_acquire)) {
            chunk_work(r, i);
            finish(r, i, false);
            break;
          }
      }
    }
    state.store(0xffff, std::memory_order_release);
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s one|fixed|fixed_rescueN|roving|rescueN seconds work_floats serial_iters chunks\n", argv[0]);
    return 2;
  }
  const char* mode = argv[1];
  const double secs = std::atof(argv[2]);
  work_floats = std::atol(argv[3]);
  serial_iters = std::atol(argv[4]);
  chunks = std::max(1, std::min(64, std::atoi(argv[5])));
  A.assign(work_floats, 1.f);
  B.assign(work_floats, 0.f);
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  long steps = 0;
  pin(0);
  while (elapsed() < secs) {
    const long end = kRegions * kStepsPerRound;
    if (!std::strcmp(mode, "one")) {
      for (long r = 0; r < end; ++r) {
        serial_work(r);
        for (int c = 0; c < chunks; ++c) chunk_work(r, c);
      }
    } else {
      Team team;
      team.end = end;
      const bool fixed = !std::strncmp(mode, "fixed", 5);
      const long rescue = !std::strncmp(mode, "rescue", 6)          ? std::atol(mode + 6)
                          : !std::strncmp(mode, "fixed_rescue", 12) ? std::atol(mode + 12)
                                                                    : -1;
      if (!fixed) {
        serial_work(0);
        team.state.store(0, std::memory_order_release);
      }
      std::thread worker([&] {
        pin(1);
        team.claim_loop(!fixed, fixed ? -1 : rescue);
      });
      if (fixed) {
        team.caller_loop(rescue);
        team.stop.store(true);
      } else {
        team.claim_loop(true, rescue);
      }
      worker.join();
    }
    steps += kStepsPerRound;
  }
  std::printf("%.2f\n", double(steps) / elapsed());
  return 0;
}
