// Float linears at a few rows (decode steps): y[m, n] = sum_k x[m, k] * w[n, k] + b[n], with x, w (and y, b) all
// float32 or all bfloat16, as nn.Linear computes them.
//
// Why not at::linear: at one to a few rows the product is a stream over the weight, and torch's CPU GEMM (MKL for
// float32, oneDNN for bfloat16) read SmolLM2's weights from DRAM at ~16 GB/s on the 2-core EPYC, where the memory
// gives ~45: a float32 decode step spent 33 of its 36 ms there, a bfloat16 one 17 of 20 (torch.profiler,
// benchmarks/decode.py's batch 1). Here each thread streams whole weight rows, a pair at a time, with the rows ahead
// prefetched (as the quantized kernels do, qlinear_vnni.h) and every activation row of the step (at most kMaxRows)
// multiplied by each pair while it is in L1, so the weight is read from memory once per step.
//
// Results: every output is one thread's sum over k in a fixed order (16 lanes on AVX-512, 8 on AVX2, reduced at the
// end), so they do not depend on the thread count or on who ran a row; they differ from torch's GEMM by float
// rounding only. bfloat16: products and sums in float32 (AVX512-BF16's vdpbf16ps where the CPU has it, else the
// bfloat16 values widened exactly to float32), the bias added in float32, one rounding to bfloat16 at the end, as
// oneDNN does. Anything else (more rows, other dtypes, strided tensors, CUDA) goes to at::linear.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#include "isa.h"
#include "pool.h"
#include "qlinear_vnni.h"  // prefetch_ahead, prefetch_distance
#include "vec_math.h"      // hsum

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ws::dense {

// The most rows this kernel takes (kernels.DENSE_GEMV_MAX_ROWS reads it). At 8 rows it was still 1.1-1.6x torch's
// GEMM (benchmarks/dense_linear.py); further up the GEMM's reuse of each weight tile over many rows takes over, and
// batch-32 decode ran as fast on it as transformers' own.
constexpr int64_t kMaxRows = 8;

inline float bf16_to_f32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float value_of(float v) { return v; }
inline float value_of(uint16_t v) { return bf16_to_f32(v); }

// AVX512-BF16 (cpuid leaf 7 subleaf 1, eax bit 5), probed once.
inline bool cpu_has_avx512_bf16() {
#if WS_VNNI512
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1);
  }();
  return has;
#else
  return false;
#endif
}

// One pair of weight rows (or a single row: C = 1) against R activation rows; T is float or uint16_t (bf16 bits).
// sums[r][c] = sum_k x[r, k] * w[c, k] in float32.
template <typename T, int R, int C>
inline void tile_scalar(const T* x, int64_t K, const T* w, float sums[R][C]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        if constexpr (std::is_same_v<T, float>) s += x[r * K + k] * w[c * K + k];
        else s += bf16_to_f32(x[r * K + k]) * bf16_to_f32(w[c * K + k]);
      }
      sums[r][c] = s;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

template <typename T, int R, int C>
inline void tile_avx2(const T* x, int64_t K, const T* w, float sums[R][C]) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load8(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = load8(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = ws::hsum(acc[r][c]);
      for (int64_t j = k; j < K; ++j) s += value_of(x[r * K + j]) * value_of(w[c * K + j]);
      sums[r][c] = s;
    }
}
#endif

#if WS_VNNI512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on its own _mm512_undefined_* in the intrinsics
#pragma GCC diagnostic ignored "-Wuninitialized"
// float32 on 16 lanes; the tail (K % 16) by masked loads, zeros elsewhere. The loop body is written out twice, not
// shared through a lambda: with the accumulators captured by reference GCC 12 stored all of them to the stack on
// every step, and from 2 rows on the stores, not the memory, set the speed (4 rows: 18.8 ms a SmolLM2 step).
template <int R, int C>
inline void tile_f32_512(const float* x, int64_t K, const float* w, float sums[R][C]) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t full = K & ~int64_t(15);
  for (int64_t k = 0; k < full; k += 16) {
    __m512 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_ps(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  if (full < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - full)) - 1);
    __m512 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_maskz_loadu_ps(m, w + c * K + full);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + r * K + full);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}

// bfloat16 by vdpbf16ps: 32 products a instruction, summed in pairs into 16 float32 lanes (written out as above).
template <int R, int C>
inline void tile_bf16_512(const uint16_t* x, int64_t K, const uint16_t* w, float sums[R][C]) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t full = K & ~int64_t(31);
  for (int64_t k = 0; k < full; k += 32) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  if (full < K) {
    const __mmask32 m = static_cast<__mmask32>((1ull << (K - full)) - 1);
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + c * K + full);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * K + full);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

// Which inner loop runs: 2 = AVX-512 (float32), with vdpbf16ps for bfloat16 where the CPU has AVX512-BF16; 1 = AVX2;
// 0 = scalar. Follows isa_level() (WARMSTART_KERNEL_ISA=avx2 holds it at 1).
inline int level(bool bf16) {
  const int isa = ws::qlinear::isa_level();
  if (isa >= 2 && (!bf16 || cpu_has_avx512_bf16())) return 2;
  return isa >= 1 ? 1 : 0;
}

template <typename T, int R, int C>
inline void tile(int lvl, const T* x, int64_t K, const T* w, float sums[R][C]) {
#if WS_VNNI512
  if (lvl == 2) {
    if constexpr (std::is_same_v<T, float>) return tile_f32_512<R, C>(x, K, w, sums);
    else return tile_bf16_512<R, C>(x, K, w, sums);
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (lvl >= 1) return tile_avx2<T, R, C>(x, K, w, sums);
#endif
  tile_scalar<T, R, C>(x, K, w, sums);
}

inline void store(float* y, float v) { *y = v; }
inline void store(uint16_t* y, float v) { *y = c10::BFloat16(v).x; }  // round to nearest even

// Output rows n..n+C-1 for every activation row, 4 at a time (the pair stays in L1 across them).
template <typename T, int C>
inline void rows(int lvl, const T* x, int64_t M, int64_t K, const T* w, const T* bias, int64_t n, int64_t N, T* y) {
  ws::qlinear::prefetch_ahead(w + n * K, C * K * int64_t(sizeof(T)), ws::qlinear::prefetch_distance());
  float add[C];
  for (int c = 0; c < C; ++c) add[c] = bias ? value_of(bias[n + c]) : 0.f;
  int64_t m = 0;
  auto emit = [&](auto sums, int r_count, int64_t m0) {
    for (int r = 0; r < r_count; ++r)
      for (int c = 0; c < C; ++c) store(y + (m0 + r) * N + n + c, sums[r][c] + add[c]);
  };
  for (; m + 4 <= M; m += 4) {
    float s[4][C];
    tile<T, 4, C>(lvl, x + m * K, K, w + n * K, s);
    emit(s, 4, m);
  }
  switch (M - m) {
    case 3: { float s[3][C]; tile<T, 3, C>(lvl, x + m * K, K, w + n * K, s); emit(s, 3, m); break; }
    case 2: { float s[2][C]; tile<T, 2, C>(lvl, x + m * K, K, w + n * K, s); emit(s, 2, m); break; }
    case 1: { float s[1][C]; tile<T, 1, C>(lvl, x + m * K, K, w + n * K, s); emit(s, 1, m); break; }
    default: break;
  }
}

// Whether linear() below runs this kernel for these tensors (else at::linear).
inline bool eligible(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  const auto dt = w.scalar_type();
  if (!(dt == at::kFloat || dt == at::kBFloat16) || x.scalar_type() != dt || x.dim() != 2 || w.dim() != 2) return false;
  if (!x.device().is_cpu() || !w.device().is_cpu() || x.size(0) < 1 || x.size(0) > kMaxRows) return false;
  if (!x.is_contiguous() || !w.is_contiguous() || x.size(1) != w.size(1) || x.size(1) == 0) return false;
  if (bias && (bias->scalar_type() != dt || !bias->is_contiguous() || bias->dim() != 1 || bias->size(0) != w.size(0)))
    return false;
  return true;
}

inline at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  if (!eligible(x, w, bias)) return bias ? at::linear(x, w, *bias) : at::linear(x, w);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  const int lvl = level(bf16);
  // 16 output rows a chunk (36 KiB of a float32 576-wide weight): enough to amortise a claim, small enough that the
  // pool's last chunks balance the threads.
  auto run = [&](auto* xp, auto* wp, auto* bp, auto* yp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    ws::pool::parallel_for(0, (N + 1) / 2, 8, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n = 2 * p;
        if (n + 2 <= N) rows<T, 2>(lvl, xp, M, K, wp, bp, n, N, yp);
        else rows<T, 1>(lvl, xp, M, K, wp, bp, n, N, yp);
      }
    });
  };
  if (bf16) {
    auto u16 = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    run(static_cast<const uint16_t*>(u16(x)), static_cast<const uint16_t*>(u16(w)),
        bias ? static_cast<const uint16_t*>(u16(*bias)) : static_cast<const uint16_t*>(nullptr), u16(y));
  } else {
    run(static_cast<const float*>(x.data_ptr<float>()), static_cast<const float*>(w.data_ptr<float>()),
        bias ? static_cast<const float*>(bias->data_ptr<float>()) : static_cast<const float*>(nullptr),
        y.data_ptr<float>());
  }
  return y;
}

}  // namespace ws::dense
