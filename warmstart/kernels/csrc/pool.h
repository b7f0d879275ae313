// The kernels' thread pool: a parallel loop that does not wait for a thread which never got the CPU.
//
// Why not at::parallel_for (OpenMP): an OpenMP region hands every team thread a fixed share and ends at a barrier
// that every team thread must reach. On a host where another process keeps the cores busy, a worker that lost its
// core holds up the region until the scheduler gives it a slice back, even if the caller could have done its share,
// and a decode step runs about 180 such regions. Here the range is cut into chunks (large ones first, single grains
// at the end) that threads claim one at a time from a shared counter. The caller claims chunks too, and the loop
// ends when every chunk is done: a worker that is asleep, descheduled or late simply claims nothing, and the others
// do its part. Only a chunk a worker has claimed and then lost its core in the middle of is waited for.
//
// Results never depend on the thread count or on who ran a chunk: chunk boundaries are multiples of the grain from
// `begin` (a function of the range, the grain and the team size only), and the kernels' bodies compute each index
// on its own. Workers spin a short while after a chunk (WARMSTART_POOL_SPIN_US, default 200 us: a decode step's regions
// come microseconds apart), then sleep on a futex; the caller wakes them only when one sleeps. A call made from
// inside a chunk, or while another thread is using the pool, runs on the calling thread / through at::parallel_for.
// WARMSTART_THREAD_POOL=0 sends every loop to at::parallel_for (the OpenMP team), as before this pool existed.
//
// One pool serves the whole process (see the namespace below); ws::pool::set_cpus pins worker t to cpus[t] as
// warmstart/runner/affinity.py pins the OpenMP team (affinity.h), and ws::pool::set_spread lets every worker run on
// any of those CPUs while the host is busy (affinity.py says why).
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#define WS_POOL 1
#else
#define WS_POOL 0
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define WS_PAUSE() _mm_pause()
#else
#define WS_PAUSE() std::this_thread::yield()
#endif

// The pool object is one per process, not per module: a function-local static of an inline function is a
// STB_GNU_UNIQUE symbol, which the dynamic loader binds once for every module that defines it. So every module must
// be built from the same pool.h; the inline namespace names the layout (bump it when the class changes) so that a
// module built from another version (a benchmark's baseline build) gets a pool of its own instead.
namespace ws::pool {
inline namespace v3 {

// Chunk sizes are guided: chunk i takes 1/(kGuide * threads) of what is left (whole grains, at least one), so a loop
// starts with large pieces and ends with single grains. A thread that joins late, or is slow, leaves less behind,
// and the caller's wait at the end for the last piece another thread is running is short. kGuide 1 rather than 2
// (half as many chunks, each claimed by a compare-exchange on one shared line): on the 2-core Zen 4 EPYC, default
// model, batch 1, separate processes alternated, 341-358 tok/s vs 314-321 (3 pairs; 276-322 vs 237-273 in 4 more
// under OpenMP's active wait); batch 32 alike (940-970 vs 904-992); two busy loops with a fixed team of 2: 145 and
// 153 vs 135 and 133 tok/s.
constexpr int64_t kGuide = 1;
constexpr int64_t kMaxChunks = 1024;

#if WS_POOL
inline void futex_wait(std::atomic<uint32_t>* a, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(a), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}
inline void futex_wake_all(std::atomic<uint32_t>* a) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(a), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

inline int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  return (end != nullptr && *end == '\0') ? int64_t(x) : fallback;
}

class Pool {
 public:
  using Body = void (*)(const void* ctx, int64_t b, int64_t e);

  static Pool& get() {
    static Pool* p = new Pool();  // never destroyed: detached workers may outlive static destruction (and fork)
    return *p;
  }

  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  void set_enabled(bool on) { enabled_.store(on, std::memory_order_relaxed); }

  // Runs body(ctx, b, e) over [begin, end) cut at multiples of `grain` from begin into guided chunks (above) on up
  // to `threads` threads, this one included. Returns false, having run nothing, when the pool is busy with another
  // caller.
  bool run(int64_t begin, int64_t end, int64_t grain, int64_t threads, Body body, const void* ctx) {
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    bounds_.clear();
    for (int64_t b = begin; b < end;) {
      bounds_.push_back(b);
      const int64_t left = (end - b + grain - 1) / grain;  // grains left
      const int64_t share = kGuide * threads;
      const int64_t take = int64_t(bounds_.size()) == kMaxChunks ? left : (left + share - 1) / share;
      b = std::min(end, b + std::max<int64_t>(1, take) * grain);
    }
    bounds_.push_back(end);
    const int64_t n = int64_t(bounds_.size()) - 1;
    spawn(threads - 1);
    body_ = body;
    ctx_ = ctx;
    error_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    allowed_.store(threads - 1, std::memory_order_relaxed);
    if (++gen_count_ == 0) gen_count_ = 1;  // 0 is the idle state's generation
    const uint32_t gen = gen_count_;
    state_.store((uint64_t(gen) << 32) | (uint64_t(n) << 16), std::memory_order_release);
    wake_.store(gen, std::memory_order_seq_cst);  // before reading sleepers_: a worker going to sleep sees it
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&wake_);
    const int64_t mine = work(gen);
    if (done_.load(std::memory_order_acquire) < n) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t spins = 0; done_.load(std::memory_order_acquire) < n; ++spins) {
        WS_PAUSE();
        if (spins > (1 << 16)) std::this_thread::yield();  // a worker lost its core mid-chunk: let the host run
      }
      count(3, std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
    }
    count(0, 1);
    count(1, mine);
    count(2, n - mine);
    if (error_) std::rethrow_exception(error_);
    return true;
  }

  // loops run on the pool, chunks the caller ran, chunks workers ran, ns the caller waited for workers' chunks
  std::vector<int64_t> stats() const {
    std::vector<int64_t> v;
    for (const auto& x : stats_) v.push_back(x.load(std::memory_order_relaxed));
    return v;
  }

  void set_cpus(const std::vector<int64_t>& cpus) {
    std::lock_guard<std::mutex> lock(cpu_mu_);
    cpus_ = cpus;
    spread_ = false;
    cpu_epoch_.fetch_add(1, std::memory_order_release);
  }

  // Every worker may run on any of the CPUs set_cpus named (on: from its next loop on), or pinned one each again.
  void set_spread(bool on) {
    std::lock_guard<std::mutex> lock(cpu_mu_);
    spread_ = on;
    cpu_epoch_.fetch_add(1, std::memory_order_release);
  }

 private:
  Pool()
      : enabled_(env_int("WARMSTART_THREAD_POOL", 1) != 0),
        spin_us_(std::max<int64_t>(0, env_int("WARMSTART_POOL_SPIN_US", 200))) {}

  // state_: generation (high 32 bits) | chunk count (bits 16-31) | next unclaimed chunk (bits 0-15). A thread owns a
  // chunk once its compare-exchange of the current generation succeeds; until that chunk is done the job cannot end,
  // so the job's fields (written before the generation was published) stay valid while it runs. work() claims and
  // runs chunks of job `gen` until none is left, and returns how many this thread ran.
  int64_t work(uint32_t gen) {
    int64_t ran = 0;
    uint64_t s = state_.load(std::memory_order_acquire);
    for (;;) {
      if (uint32_t(s >> 32) != gen) return ran;
      const uint64_t n = (s >> 16) & 0xffff, next = s & 0xffff;
      if (next >= n) return ran;
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      const int64_t b = bounds_[next], e = bounds_[next + 1];
      in_chunk() = true;
      try {
        body_(ctx_, b, e);
      } catch (...) {
        std::lock_guard<std::mutex> lock(err_mu_);
        if (!error_) error_ = std::current_exception();
      }
      in_chunk() = false;
      done_.fetch_add(1, std::memory_order_release);
      ++ran;
      s = state_.load(std::memory_order_acquire);
    }
  }

  // Workers are started on first use and never stopped. A thread that cannot be started is not an error: the
  // caller and the workers that exist claim its chunks.
  void spawn(int64_t want) {
    while (workers_ < want) {
      const int64_t t = ++workers_;  // team index: the caller is 0
      try {
        std::thread([this, t] { worker(t); }).detach();
      } catch (const std::exception&) {
        return;
      }
    }
  }

  void pin(int64_t t, uint64_t& epoch) {
    const uint64_t now = cpu_epoch_.load(std::memory_order_acquire);
    if (now == epoch) return;
    epoch = now;
    std::lock_guard<std::mutex> lock(cpu_mu_);
    if (t < int64_t(cpus_.size())) {
      cpu_set_t set;
      CPU_ZERO(&set);
      if (spread_)
        for (const int64_t c : cpus_) CPU_SET(static_cast<int>(c), &set);
      else
        CPU_SET(static_cast<int>(cpus_[t]), &set);
      sched_setaffinity(0, sizeof(set), &set);
    }
  }

  void worker(int64_t t) {
    uint64_t epoch = 0;
    uint32_t seen = 0;
    for (;;) {
      uint32_t w = wake_.load(std::memory_order_acquire);
      if (w == seen) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
        for (int i = 0; w == seen; ++i) {
          WS_PAUSE();
          if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) {
            sleepers_.fetch_add(1, std::memory_order_seq_cst);
            while ((w = wake_.load(std::memory_order_seq_cst)) == seen) futex_wait(&wake_, seen);
            sleepers_.fetch_sub(1, std::memory_order_relaxed);
            break;
          }
          w = wake_.load(std::memory_order_acquire);
        }
      }
      seen = w;
      pin(t, epoch);
      const uint64_t s = state_.load(std::memory_order_acquire);
      if (uint32_t(s >> 32) != w) continue;  // that job is over, or a newer one began: look again
      if (t > allowed_.load(std::memory_order_relaxed)) continue;  // this job asked for fewer threads
      work(w);
    }
  }

  static bool& in_chunk() {
    thread_local bool v = false;
    return v;
  }

 public:
  static bool inside() { return in_chunk(); }

 private:
  std::atomic<bool> enabled_;
  const int64_t spin_us_;
  std::mutex mu_, err_mu_, cpu_mu_;
  alignas(64) std::atomic<uint64_t> state_{0};
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) std::atomic<uint32_t> wake_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int64_t> allowed_{0};
  std::atomic<uint64_t> cpu_epoch_{0};
  uint32_t gen_count_ = 0;
  int64_t workers_ = 0;  // started so far (under mu_)
  Body body_ = nullptr;
  const void* ctx_ = nullptr;
  std::vector<int64_t> bounds_;  // chunk i is [bounds_[i], bounds_[i + 1])
  std::exception_ptr error_;
  std::vector<int64_t> cpus_;
  bool spread_ = false;  // (under cpu_mu_) every worker on all of cpus_, not one each
  std::atomic<int64_t> stats_[4] = {};  // see stats(); added to by the caller under mu_
  void count(int i, int64_t by) { stats_[i].fetch_add(by, std::memory_order_relaxed); }
};
#endif

// at::parallel_for's contract (f(b, e) over disjoint pieces of [begin, end), each of at least `grain` indices but the
// last), run on the pool.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t range = end - begin;
  const int64_t threads = at::in_parallel_region() ? 1 : int64_t(at::get_num_threads());
#if WS_POOL
  Pool& pool = Pool::get();
  if (!pool.enabled()) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  if (threads <= 1 || range <= grain || Pool::inside()) {
    f(begin, end);
    return;
  }
  const auto body = [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); };
  if (!pool.run(begin, end, grain, std::min(threads, (range + grain - 1) / grain), body, &f))
    at::parallel_for(begin, end, grain, f);  // another thread is using the pool
#else
  at::parallel_for(begin, end, grain, f);
#endif
}

inline std::vector<int64_t> stats() {
#if WS_POOL
  return Pool::get().stats();
#else
  return {0, 0, 0, 0};
#endif
}

// On (the pool) or off (at::parallel_for) from the next loop on: WARMSTART_THREAD_POOL's choice, for A/B measurement.
inline void set_enabled(bool on) {
#if WS_POOL
  Pool::get().set_enabled(on);
#else
  (void)on;
#endif
}

inline void set_cpus(const std::vector<int64_t>& cpus) {
#if WS_POOL
  Pool::get().set_cpus(cpus);
#else
  (void)cpus;
#endif
}

inline void set_spread(bool on) {
#if WS_POOL
  Pool::get().set_spread(on);
#else
  (void)on;
#endif
}

}  // namespace v3
}  // namespace ws::pool
