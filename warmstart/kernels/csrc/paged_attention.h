// Paged attention on CPU: each query attends over its sequence's context by reading K/V where they live in the paged
// cache (no gather into a padded copy). The work of a (query t, kv head g, context chunk) is done for the G = H / Hkv
// query heads that share kv head g together: per tile of context positions every K row is loaded into registers once
// and dotted with all G queries (a G x tile score block), and every V row once for the G accumulators, so each K/V
// element is read from the cache, and converted to fp32 (bf16/fp16/int8 caches, in registers), exactly once. An
// int8 cache row carries its own float32 scale after its D codes (kScaled below). Softmax is streamed (online) over
// the tiles; all arithmetic is fp32, except an int8 cache's q.k on x86 (exact int16 x int8 integer sums, see
// "int8 cache in integer arithmetic"). The next tile's rows are prefetched (into L2) while the current one
// is computed. Queries arrive fp32 (the Python wrapper converts the small q tensor).
//
// Built with -O3 -mavx2 -mfma -mf16c on x86-64 (see setup.py); the scalar paths below are what other ISAs compile.
// An int8 cache's tile step also has a 16-lane version (paged_attention_avx512.h) for CPUs with AVX-512 VNNI.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define WS_AVX2 1
#else
#define WS_AVX2 0
#endif

#include "isa.h"
#include "pool.h"
#include "vec_math.h"

namespace ws::paged {

constexpr int64_t kTile = 32;  // context positions per online-softmax step (scores of G heads x kTile stay in L1)
constexpr int kMaxGH = 3;      // query heads per register-blocked pass over a K/V tile (4 rows x 3 heads = 12 ymm)

// ---- scalar element -> fp32 ----------------------------------------------------------------------------------------
inline float to_f(float x) { return x; }
inline float to_f(at::BFloat16 x) {
  uint32_t w = uint32_t(reinterpret_cast<const uint16_t&>(x)) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}
inline float to_f(at::Half x) { return static_cast<float>(x); }
inline float to_f(int8_t x) { return static_cast<float>(x); }

// An int8 cache row is D codes followed by its float32 scale (x = code * scale; see fused.h write_kv): scores are
// scaled per K row after the dot product, and P per V row before P.V, so the inner loops only convert codes.
template <typename T>
constexpr bool kScaled = std::is_same_v<T, int8_t>;
template <typename T>
constexpr int64_t kRowExtra = kScaled<T> ? int64_t(sizeof(float)) : 0;  // bytes after the D elements of a row
template <typename T>
inline float row_scale(const T* row, int64_t D) {
  float s = 1.f;
  if constexpr (kScaled<T>) std::memcpy(&s, row + D, sizeof(float));
  return s;
}

#if WS_AVX2
// ---- 8 cache elements -> 8 fp32 lanes, converted in registers (no scratch pass) ------------------------------------
inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 ld8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 ld8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 ld8(const at::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

using ws::hsum;  // vec_math.h
#endif

// Into L2 (T1), not L1: a tile's rows are many lines (batch 8 x 2,048 positions streams 354 MB a step), and
// prefetches into L1 are capped by L1's few outstanding misses. On a 2-core Zen 4 EPYC, fp16 cache, batch 8 x 2,048
// positions (us per layer call, interleaved builds): T0 2533 -> T1 1232 at 1 thread, 1473 -> 893 at 2; int8 1118 ->
// 921 and 611 -> 490 (T2 alike, NTA as T0, two tiles ahead slower). On a Sapphire Rapids Xeon L2 and L1 measured
// alike (0.93-1.03x; issue 8's notes).
template <typename T>
inline void prefetch_row(const T* p, int64_t bytes) {
#if WS_AVX2
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t l = a & ~uintptr_t(63); l < a + uintptr_t(bytes); l += 64)
    _mm_prefetch(reinterpret_cast<const char*>(l), _MM_HINT_T1);
#else
  (void)p;
  (void)bytes;
#endif
}

// Scores of GH query heads against R consecutive K rows: s[i * ld + r] = q_i . k[r] (q pre-scaled, rows of D).
// Every K element is loaded (and converted) once and used for all GH heads.
template <typename T, int R, int GH>
inline void score_block(const float* q, int64_t D, const T* const* kp, int64_t ko, float* s, int64_t ld) {
  const T* k[R];
  for (int r = 0; r < R; ++r) k[r] = kp[r] + ko;
  int64_t c = 0;
#if WS_AVX2
  __m256 acc[R][GH];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < GH; ++i) acc[r][i] = _mm256_setzero_ps();
  for (; c + 8 <= D; c += 8) {
    __m256 qv[GH];
    for (int i = 0; i < GH; ++i) qv[i] = _mm256_loadu_ps(q + i * D + c);
    for (int r = 0; r < R; ++r) {
      const __m256 kv = ld8(k[r] + c);
      for (int i = 0; i < GH; ++i) acc[r][i] = _mm256_fmadd_ps(qv[i], kv, acc[r][i]);
    }
  }
  if constexpr (R == 4) {
    for (int i = 0; i < GH; ++i) {
      const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[0][i], acc[1][i]), _mm256_hadd_ps(acc[2][i], acc[3][i]));
      _mm_storeu_ps(s + i * ld, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
    }
  } else {
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < GH; ++i) s[i * ld + r] = hsum(acc[r][i]);
  }
#else
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < GH; ++i) s[i * ld + r] = 0.f;
#endif
  for (; c < D; ++c)  // head_dim not a multiple of 8 (all of it on scalar builds)
    for (int r = 0; r < R; ++r) {
      const float kv = to_f(k[r][c]);
      for (int i = 0; i < GH; ++i) s[i * ld + r] += q[i * D + c] * kv;
    }
}

// Rows of the tile after the current one (same head offset), prefetched a few at a time while the current tile is
// computed, so the memory reads overlap the arithmetic without flooding the miss queues.
template <typename T>
struct Next {
  const T* const* k;
  const T* const* v;
  int64_t n;  // 0: nothing to prefetch
  int64_t ko, vo, bytes;  // prefetched: bytes from k[j] + ko and from v[j] + vo
};

// s[i * ld + j] = q_i . k[j] for i < GH, j < n
template <typename T, int GH>
inline void scores(const float* q, int64_t D, const T* const* k, int64_t ko, int64_t n, float* s, int64_t ld,
                   const Next<T>& nx) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int64_t r = j; r < std::min(j + 4, nx.n); ++r) prefetch_row(nx.k[r] + nx.ko, nx.bytes);
    score_block<T, 4, GH>(q, D, k + j, ko, s + j, ld);
  }
  for (; j < n; ++j) score_block<T, 1, GH>(q, D, k + j, ko, s + j, ld);
}

// acc_i[d0 .. d0 + 8*NV) += sum_j p[i * ld + j] * v[j][same range] for i < GH, accumulators in registers over the
// tile; every V element is loaded (and converted) once for all GH heads.
template <typename T, int GH, int NV>
inline void pv_block(float* acc, int64_t D, const float* p, int64_t ld, const T* const* v, int64_t vo, int64_t n,
                     int64_t d0, const Next<T>* nx = nullptr) {
#if WS_AVX2
  const int64_t npf = nx ? nx->n : 0;
  __m256 a[GH][NV];
  for (int i = 0; i < GH; ++i)
    for (int k = 0; k < NV; ++k) a[i][k] = _mm256_loadu_ps(acc + i * D + d0 + 8 * k);
  for (int64_t j = 0; j < n; ++j) {
    if (j < npf) prefetch_row(nx->v[j] + nx->vo, nx->bytes);
    const T* vj = v[j] + vo + d0;
    __m256 pj[GH];
    for (int i = 0; i < GH; ++i) pj[i] = _mm256_broadcast_ss(p + i * ld + j);
    for (int k = 0; k < NV; ++k) {
      const __m256 vv = ld8(vj + 8 * k);
      for (int i = 0; i < GH; ++i) a[i][k] = _mm256_fmadd_ps(pj[i], vv, a[i][k]);
    }
  }
  for (int i = 0; i < GH; ++i)
    for (int k = 0; k < NV; ++k) _mm256_storeu_ps(acc + i * D + d0 + 8 * k, a[i][k]);
#else
  (void)acc, (void)D, (void)p, (void)ld, (void)v, (void)vo, (void)n, (void)d0;
#endif
}

template <typename T, int GH>
inline void pv(float* acc, int64_t D, const float* p, int64_t ld, const T* const* v, int64_t vo, int64_t n,
               const Next<T>& nx) {
  int64_t d0 = 0;
#if WS_AVX2
  // 32 columns per pass: up to 12 independent accumulators keep both FMA pipes busy (16 columns left 6 chains of
  // 4-cycle FMAs for 3 heads); 9% faster at batch 8 x 2,048 (fp16), bit-identical (same sums, same order per lane)
  constexpr int NV = 4;
  if (d0 + 8 * NV <= D) {
    pv_block<T, GH, NV>(acc, D, p, ld, v, vo, n, d0, &nx);
    d0 += 8 * NV;
  }
  for (; d0 + 8 * NV <= D; d0 += 8 * NV) pv_block<T, GH, NV>(acc, D, p, ld, v, vo, n, d0);
  for (; d0 + 8 <= D; d0 += 8) pv_block<T, GH, 1>(acc, D, p, ld, v, vo, n, d0);
#endif
  if (d0 < D)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = d0; d < D; ++d) {
        const float vv = to_f(v[j][vo + d]);
        for (int i = 0; i < GH; ++i) acc[i * D + d] += p[i * ld + j] * vv;
      }
}

inline void scale_row(float* acc, float c, int64_t d) {
  for (int64_t i = 0; i < d; ++i) acc[i] *= c;
}

#if WS_AVX2
using ws::exp256;  // vec_math.h
#endif

// max of s[0 .. n), n >= 1 (a scalar max is a 4-cycle dependency chain per element; 8 lanes cut it 8x)
inline float row_max(const float* s, int64_t n) {
  int64_t i = 0;
  float m = -std::numeric_limits<float>::infinity();
#if WS_AVX2
  if (n >= 8) {
    __m256 vm = _mm256_loadu_ps(s);
    for (i = 8; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + i));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    m = _mm_cvtss_f32(h);
  }
#endif
  for (; i < n; ++i) m = std::max(m, s[i]);
  return m;
}

// p[i] = exp(s[i] - m) for i < n; returns the sum.
inline float exp_sum(const float* s, float* p, int64_t n, float m) {
  int64_t i = 0;
  float sum = 0.f;
#if WS_AVX2
  __m256 vm = _mm256_set1_ps(m), vs = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
    _mm256_storeu_ps(p + i, e);
    vs = _mm256_add_ps(vs, e);
  }
  alignas(32) float buf[8];
  _mm256_store_ps(buf, vs);
  for (int k = 0; k < 8; ++k) sum += buf[k];
#endif
  for (; i < n; ++i) {
    p[i] = std::exp(s[i] - m);
    sum += p[i];
  }
  return sum;
}

#if WS_AVX2
// ---- int8 cache in integer arithmetic ------------------------------------------------------------------------------
// Widening int8 codes to fp32 takes two instructions per 8 elements before any FMA: with fp32 q.k an int8 cache ran
// 1.6x slower than a float16 one. For an int8 cache whose head_dim is a multiple of 16 (at most 256), q.k runs in
// int16 x int16 -> int32 instead (vpmaddwd: 16 products per instruction, K codes widened 16 at a time): each query
// head is quantized once per task to int16 codes with its own scale, max|q| / 32767 (a step of 1.5e-5 of its largest
// element; the cache's own step is 1/127 of a row's largest). The sums are exact and stay inside int32
// (|q.k| <= 32767 * 127 * 256 < 2^31); each score is then (integer dot) * q scale * K row scale in fp32. P.V stays
// fp32 (an int16 P.V measured no faster here: the multiplies then all queue on the one integer-multiply pipe).
constexpr int64_t kI8MaxD = 256;
inline bool int8_integer_path(int64_t D) { return D % 16 == 0 && D <= kI8MaxD; }

// q: rows of D floats (pre-scaled) -> int16 codes, per-row scales (code * scale = q within scale / 2). Vectorized
// (D is a multiple of 16 here); for finite q the same codes and scales as a scalar loop (max is order-free; the
// rounding, in the current mode, nearest-even, the clamp and the conversion are the same operations). Against that
// scalar loop, batch 8 x 128 positions, built side by side: 32.5 vs 34.7 us a call at 1 thread, even at 2.
inline void quantize_q16(const float* q, int64_t rows, int64_t D, int16_t* codes, float* scales) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 lo = _mm256_set1_ps(-32767.f), hi = _mm256_set1_ps(32767.f);
  for (int64_t i = 0; i < rows; ++i) {
    const float* x = q + i * D;
    int16_t* c = codes + i * D;
    __m256 vm = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8)  // max(|x|, running): a NaN element leaves the running max, as std::max does
      vm = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + d), abs_mask), vm);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int64_t d = 0; d < D; d += 16) {
      __m256 a = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + d), vinv), _MM_FROUND_CUR_DIRECTION);
      __m256 b = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + d + 8), vinv), _MM_FROUND_CUR_DIRECTION);
      a = _mm256_min_ps(_mm256_max_ps(a, lo), hi);
      b = _mm256_min_ps(_mm256_max_ps(b, lo), hi);
      const __m256i w = _mm256_packs_epi32(_mm256_cvttps_epi32(a), _mm256_cvttps_epi32(b));  // a0-3 b0-3 a4-7 b4-7
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + d), _mm256_permute4x64_epi64(w, 0xD8));
    }
    scales[i] = amax / 32767.f;
  }
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// s[i * ld + r] = (the sum of acc[r][i]'s int32 lanes) * qs_i * (K row r's scale): score_block_i8's reduction
template <int R, int GH>
inline void scores_from_i32(const __m256i (&acc)[R][GH], const int8_t* const* k, int64_t D, const float* qs,
                            float* s, int64_t ld) {
  float ks[R];
  for (int r = 0; r < R; ++r) ks[r] = row_scale(k[r], D);
  if constexpr (R == 4) {
    const __m128 ksv = _mm_loadu_ps(ks);
    for (int i = 0; i < GH; ++i) {
      const __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0][i], acc[1][i]),
                                          _mm256_hadd_epi32(acc[2][i], acc[3][i]));
      const __m128i x = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
      _mm_storeu_ps(s + i * ld, _mm_mul_ps(_mm_cvtepi32_ps(x), _mm_mul_ps(ksv, _mm_set1_ps(qs[i]))));
    }
  } else {
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < GH; ++i) s[i * ld + r] = static_cast<float>(hsum_epi32(acc[r][i])) * (ks[r] * qs[i]);
  }
}

// s[i * ld + r] = (q16_i . k[r]) * qs_i * kscale_r for R rows and GH heads (exact integer dot products)
template <int R, int GH>
inline void score_block_i8(const int16_t* q, const float* qs, int64_t D, const int8_t* const* kp, int64_t ko,
                           float* s, int64_t ld) {
  const int8_t* k[R];
  for (int r = 0; r < R; ++r) k[r] = kp[r] + ko;
  __m256i acc[R][GH];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < GH; ++i) acc[r][i] = _mm256_setzero_si256();
  for (int64_t c = 0; c < D; c += 16)
    for (int r = 0; r < R; ++r) {
      const __m256i kv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k[r] + c)));
      for (int i = 0; i < GH; ++i)
        acc[r][i] = _mm256_add_epi32(
            acc[r][i], _mm256_madd_epi16(kv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * D + c))));
    }
  scores_from_i32<R, GH>(acc, k, D, qs, s, ld);
}

template <int GH>
inline void scores_i8(const int16_t* q16, const float* qs, int64_t D, const int8_t* const* k, int64_t ko, int64_t n,
                      float* s, int64_t ld, const Next<int8_t>& nx) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int64_t r = j; r < std::min(j + 4, nx.n); ++r) prefetch_row(nx.k[r] + nx.ko, nx.bytes);
    score_block_i8<4, GH>(q16, qs, D, k + j, ko, s + j, ld);
  }
  for (; j < n; ++j) score_block_i8<1, GH>(q16, qs, D, k + j, ko, s + j, ld);
}
#endif

// Row scales of an int8 tile: out[j] = the scale of rows[j] + off, j < n
inline void gather_scales(const int8_t* const* rows, int64_t off, int64_t D, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = row_scale(rows[j] + off, D);
}

// x[i * kTile + j] *= f[j] for i < GH, j < n
template <int GH>
inline void scale_cols(float* x, const float* f, int64_t n) {
  for (int i = 0; i < GH; ++i)
    for (int64_t j = 0; j < n; ++j) x[i * kTile + j] *= f[j];
}

// The online-softmax update of one tile for GH heads: s (GH rows of kTile scores) -> p = exp(s - new max), with the
// running max m, sum l and accumulators acc (GH rows of D) rescaled when the max grows. Always inlined: called out of
// line (as gcc 12 chose inside the int8 tile step) the int8 step ran 20% slower. exps: exp_sum, or the same on
// wider vectors (paged_attention_avx512.h).
struct ExpSum8 {
  float operator()(const float* s, float* p, int64_t n, float m) const { return exp_sum(s, p, n, m); }
};
template <int GH, typename ExpSum = ExpSum8>
__attribute__((always_inline)) inline void softmax_tile(const float* s, float* p, int64_t n, float* acc, int64_t D,
                                                        float* m, float* l, ExpSum exps = {}) {
  for (int i = 0; i < GH; ++i) {
    const float* si = s + i * kTile;
    const float mt = row_max(si, n);
    const float mnew = std::max(m[i], mt);
    if (mnew > m[i] && l[i] > 0.f) {
      const float cr = std::exp(m[i] - mnew);
      l[i] *= cr;
      scale_row(acc + i * D, cr, D);
    }
    m[i] = mnew;
    l[i] += exps(si, p + i * kTile, n, mnew);
  }
}

// One tile of n positions for GH query heads (q: GH pre-scaled rows of D; acc: GH rows of D; m, l: GH running max
// and sum): scores for all GH heads in one pass over K, online-softmax update per head, then P.V for all GH heads in
// one pass over V. An int8 tile scales each score by its K row's scale and each P by its V row's.
template <typename T, int GH>
inline void tile_step(const float* q, int64_t D, const T* const* krow, int64_t ko, const T* const* vrow, int64_t vo,
                      int64_t n, const Next<T>& nx, float* s, float* p, float* acc, float* m, float* l) {
  [[maybe_unused]] float rs[kTile];
  scores<T, GH>(q, D, krow, ko, n, s, kTile, nx);
  if constexpr (kScaled<T>) {
    gather_scales(krow, ko, D, n, rs);
    scale_cols<GH>(s, rs, n);
  }
  softmax_tile<GH>(s, p, n, acc, D, m, l);
  if constexpr (kScaled<T>) {
    gather_scales(vrow, vo, D, n, rs);
    scale_cols<GH>(p, rs, n);
  }
  pv<T, GH>(acc, D, p, kTile, vrow, vo, n, nx);
}

#if WS_AVX2
// tile_step for an int8 tile on the integer path: q16/qs are the GH heads' int16 codes and scales. Always inlined
// (into run): out of line, gcc 12's code for it ran 20% slower.
template <int GH>
__attribute__((always_inline)) inline void tile_step_i8(const int16_t* q16, const float* qs, int64_t D,
                                                        const int8_t* const* krow, int64_t ko,
                                                        const int8_t* const* vrow, int64_t vo, int64_t n,
                                                        const Next<int8_t>& nx, float* s, float* p, float* acc,
                                                        float* m, float* l) {
  float rs[kTile];
  scores_i8<GH>(q16, qs, D, krow, ko, n, s, kTile, nx);  // already times the K row scales
  softmax_tile<GH>(s, p, n, acc, D, m, l);
  gather_scales(vrow, vo, D, n, rs);
  scale_cols<GH>(p, rs, n);
  pv<int8_t, GH>(acc, D, p, kTile, vrow, vo, n, nx);
}
#endif

}  // namespace ws::paged
#include "paged_attention_avx512.h"  // the same tile step on 16 lanes (needs the definitions above)
namespace ws::paged {

// Whether an int8 cache of this head_dim takes the 16-lane step (paged_attention_avx512.h): the CPU has AVX-512
// VNNI, the kernels may use it (isa.h), and head_dim is a multiple of 32.
inline bool int8_wide(int64_t D) {
#if WS_PAGED512
  return ws::qlinear::isa_level() >= 2 && avx512::int8_usable(D);
#else
  (void)D;
  return false;
#endif
}

// q16/qs: the int8 integer path's query codes and scales (int8 caches with int8_integer_path(D)), else null.
template <typename T>
inline void tile_heads(int64_t G, const float* q, const int16_t* q16, const float* qs, int64_t D, const T* const* krow,
                       int64_t ko, const T* const* vrow, int64_t vo, int64_t n, Next<T> nx, float* s, float* p,
                       float* acc, float* m, float* l) {
  for (int64_t i0 = 0; i0 < G; i0 += kMaxGH, nx.n = 0) {  // the first group of heads prefetches
    const int64_t gh = std::min<int64_t>(kMaxGH, G - i0);
    const float* qi = q + i0 * D;
    float* ai = acc + i0 * D;
#if WS_AVX2
    if constexpr (kScaled<T>)
      if (q16) {
        const int16_t* ci = q16 + i0 * D;
        switch (gh) {
          case 3: tile_step_i8<3>(ci, qs + i0, D, krow, ko, vrow, vo, n, nx, s, p, ai, m + i0, l + i0); break;
          case 2: tile_step_i8<2>(ci, qs + i0, D, krow, ko, vrow, vo, n, nx, s, p, ai, m + i0, l + i0); break;
          default: tile_step_i8<1>(ci, qs + i0, D, krow, ko, vrow, vo, n, nx, s, p, ai, m + i0, l + i0); break;
        }
        continue;
      }
#endif
    (void)q16, (void)qs;
    switch (gh) {
      case 3: tile_step<T, 3>(qi, D, krow, ko, vrow, vo, n, nx, s, p, ai, m + i0, l + i0); break;
      case 2: tile_step<T, 2>(qi, D, krow, ko, vrow, vo, n, nx, s, p, ai, m + i0, l + i0); break;
      default: tile_step<T, 1>(qi, D, krow, ko, vrow, vo, n, nx, s, p, ai, m + i0, l + i0); break;
    }
  }
}

struct Scratch {
  std::vector<float> q, acc, s, p, m, l, qs;
  std::vector<int16_t> q16;
};

// Long contexts are split into chunks of kSplit positions, each its own task, merged afterwards (flash-decoding): a
// decode batch of one still spreads over the threads. The split depends only on ctx_lens, never on the thread count,
// so results do not change with it.
constexpr int64_t kSplit = 512;

template <typename T>
void run(const float* q, float* out, const T* kc, const T* vc, const int32_t* bt, const int32_t* seq_idx,
         const int32_t* ctx_lens, int64_t T_, int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t bt_stride,
         int64_t kc_s0, int64_t kc_s1, int64_t kc_s2, int64_t vc_s0, int64_t vc_s1, int64_t vc_s2, float scale) {
  const int64_t G = H / Hkv;
  // work items: (query t, chunk c); task = item * Hkv + g
  std::vector<int64_t> item_t, item_c, first_item(T_ + 1, 0);
  bool split = false;
  for (int64_t t = 0; t < T_; ++t) {
    const int64_t nc = std::max<int64_t>(1, (int64_t(ctx_lens[t]) + kSplit - 1) / kSplit);
    split |= nc > 1;
    first_item[t + 1] = first_item[t] + nc;
    for (int64_t c = 0; c < nc; ++c) {
      item_t.push_back(t);
      item_c.push_back(c);
    }
  }
  const int64_t n_items = first_item[T_];
  // partials per task when split: [G] m, [G] l, [G * D] unnormalized acc
  const int64_t part_sz = G * (D + 2);
  std::vector<float> part(split ? n_items * Hkv * part_sz : 0);
  // Heads per task: all Hkv heads of an item when there are enough items to keep the threads busy, so a task reads
  // every head's rows of a block (head-major in the runner's cache: Hkv runs of block_size rows); one head per task
  // otherwise (a decode batch of one). Each (item, kv head) is computed the same way either way: the grouping never
  // changes a result. With the head-major cache one head per task measured the same at batch 8 (0.95-0.98x).
  const int64_t hpt = n_items >= 4 * int64_t(at::get_num_threads()) ? Hkv : 1;
  const int64_t n_hgroups = Hkv / hpt;
  const int64_t row_bytes = D * int64_t(sizeof(T)) + kRowExtra<T>;
#if WS_AVX2
  const bool int_path = kScaled<T> && int8_integer_path(D);
#else
  const bool int_path = false;
#endif
#if WS_PAGED512
  const bool wide = int_path && int8_wide(D);
#endif

  ws::pool::parallel_for(0, n_items * n_hgroups, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch sc;
    sc.q.resize(hpt * G * D);
    sc.acc.resize(hpt * G * D);
    sc.s.resize(kMaxGH * kTile);
    sc.p.resize(kMaxGH * kTile);
    sc.m.resize(hpt * G);
    sc.l.resize(hpt * G);
    sc.q16.resize(int_path ? hpt * G * D : 0);
    sc.qs.resize(int_path ? hpt * G : 0);
    // head-0 row pointers of the current tile and the next one (prefetched while the current one is computed)
    const T* rows[2][2][kTile];
    // a task's item, query, first kv head, positions [p_begin, p_end) and block table
    struct Span {
      int64_t item, t, g0, p_begin, p_end;
      const int32_t* table;
    };
    auto span = [&](int64_t task) {
      const int64_t item = task / n_hgroups, t = item_t[item], p_begin = item_c[item] * kSplit;
      return Span{item, t, (task % n_hgroups) * hpt, p_begin, std::min<int64_t>(ctx_lens[t], p_begin + kSplit),
                  bt + int64_t(seq_idx[t]) * bt_stride};
    };
    for (int64_t task = begin; task < end; ++task) {
      const Span cur_span = span(task);
      const int64_t item = cur_span.item, t = cur_span.t, g0 = cur_span.g0;
      const int64_t p_begin = cur_span.p_begin, p_end = cur_span.p_end;
      const int32_t* table = cur_span.table;
      const float* qg = q + (t * H + g0 * G) * D;
      for (int64_t i = 0; i < hpt * G * D; ++i) sc.q[i] = qg[i] * scale;
#if WS_AVX2
      if (int_path) quantize_q16(sc.q.data(), hpt * G, D, sc.q16.data(), sc.qs.data());
#endif
      std::fill(sc.acc.begin(), sc.acc.end(), 0.f);
      std::fill(sc.m.begin(), sc.m.end(), -std::numeric_limits<float>::infinity());
      std::fill(sc.l.begin(), sc.l.end(), 0.f);
      auto fill = [&](const int32_t* tb, int64_t p0, int64_t pe, const T** kr, const T** vr) {
        const int64_t n = std::min(kTile, pe - p0);
        int64_t b = p0 / bs, off = p0 - b * bs;  // one division per tile, not per position
        const T* kb = kc + int64_t(tb[b]) * kc_s0;
        const T* vb = vc + int64_t(tb[b]) * vc_s0;
        for (int64_t j = 0; j < n; ++j, ++off) {
          if (off == bs) {
            off = 0;
            ++b;
            kb = kc + int64_t(tb[b]) * kc_s0;
            vb = vc + int64_t(tb[b]) * vc_s0;
          }
          kr[j] = kb + off * kc_s1;
          vr[j] = vb + off * vc_s1;
        }
        return n;
      };
      // The tile after a task's last is the next task's first (this thread runs it next), prefetched the same way,
      // so a task does not start on rows still in memory. Batch 8 x 2,048 positions (32 tasks of 512), caches
      // cycled over 24 layers, on the 2-core Zen 4 EPYC, us per layer call, interleaved builds: float16 773/762 ->
      // 698/710 at 2 threads, 1612/1616 -> 1442/1468 at 1; int8 616/612 -> 573/577 and 895/912 -> 844/835.
      const Span nxt = task + 1 < end ? span(task + 1) : Span{0, 0, 0, 0, 0, nullptr};
      int cur = 0;
      int64_t n = p_begin < p_end ? fill(table, p_begin, p_end, rows[0][0], rows[0][1]) : 0;
      for (int64_t p0 = p_begin; p0 < p_end; p0 += kTile) {
        const bool last = p0 + kTile >= p_end;
        const int64_t nn = !last ? fill(table, p0 + kTile, p_end, rows[cur ^ 1][0], rows[cur ^ 1][1])
                           : nxt.p_begin < nxt.p_end
                               ? fill(nxt.table, nxt.p_begin, nxt.p_end, rows[cur ^ 1][0], rows[cur ^ 1][1])
                               : 0;
        Next<T> nx{rows[cur ^ 1][0], rows[cur ^ 1][1], nn, 0, 0, row_bytes};
        for (int64_t h = 0; h < hpt; ++h) {
          const int64_t g = g0 + h;
          nx.ko = ((last ? nxt.g0 : g0) + h) * kc_s2;  // each head's pass prefetches its own rows of the next tile
          nx.vo = ((last ? nxt.g0 : g0) + h) * vc_s2;
          const float* qh = sc.q.data() + h * G * D;
          const int16_t* q16 = int_path ? sc.q16.data() + h * G * D : nullptr;
          const float* qs = int_path ? sc.qs.data() + h * G : nullptr;
          float *acc = sc.acc.data() + h * G * D, *m = sc.m.data() + h * G, *l = sc.l.data() + h * G;
#if WS_PAGED512
          if constexpr (kScaled<T>)
            if (wide) {
              avx512::tile_heads_i8(G, q16, qs, D, rows[cur][0], g * kc_s2, rows[cur][1], g * vc_s2, n, nx,
                                    sc.s.data(), sc.p.data(), acc, m, l);
              continue;
            }
#endif
          tile_heads<T>(G, qh, q16, qs, D, rows[cur][0], g * kc_s2, rows[cur][1], g * vc_s2, n, nx, sc.s.data(),
                        sc.p.data(), acc, m, l);
        }
        cur ^= 1;
        n = nn;
      }
      for (int64_t h = 0; h < hpt; ++h) {
        const int64_t g = g0 + h;
        const float* acc = sc.acc.data() + h * G * D;
        const float* m = sc.m.data() + h * G;
        const float* l = sc.l.data() + h * G;
        if (split) {
          float* pp = part.data() + (item * Hkv + g) * part_sz;
          std::copy(m, m + G, pp);
          std::copy(l, l + G, pp + G);
          std::copy(acc, acc + G * D, pp + 2 * G);
        } else {
          float* og = out + (t * H + g * G) * D;
          for (int64_t i = 0; i < G; ++i) {
            const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;  // ctx 0: output zeros
            for (int64_t d = 0; d < D; ++d) og[i * D + d] = acc[i * D + d] * inv;
          }
        }
      }
    }
  });
  if (!split) return;
  // merge the chunks of each (t, g): rescale to the common max, sum, normalize
  ws::pool::parallel_for(0, T_ * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tg = begin; tg < end; ++tg) {
      const int64_t t = tg / Hkv, g = tg % Hkv;
      float* og = out + (t * H + g * G) * D;
      for (int64_t i = 0; i < G; ++i) {
        float M = -std::numeric_limits<float>::infinity();
        for (int64_t it = first_item[t]; it < first_item[t + 1]; ++it) {
          const float* pp = part.data() + (it * Hkv + g) * part_sz;
          if (pp[G + i] > 0.f) M = std::max(M, pp[i]);
        }
        float L = 0.f;
        float* o = og + i * D;
        std::fill(o, o + D, 0.f);
        for (int64_t it = first_item[t]; it < first_item[t + 1]; ++it) {
          const float* pp = part.data() + (it * Hkv + g) * part_sz;
          if (!(pp[G + i] > 0.f)) continue;
          const float w = std::exp(pp[i] - M);
          L += pp[G + i] * w;
          const float* a = pp + 2 * G + i * D;
          for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
        }
        const float inv = L > 0.f ? 1.f / L : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_idx, const at::Tensor& ctx_lens,
                           double scale) {
  TORCH_CHECK(q_in.dim() == 3, "q must be [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache dtypes differ");
  TORCH_CHECK(k_cache.device().is_cpu() && q_in.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "cache head_dim must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_idx.scalar_type() == at::kInt &&
                  ctx_lens.scalar_type() == at::kInt, "block_tables, seq_idx, ctx_lens must be int32");
  const int64_t T = q_in.size(0), H = q_in.size(1), D = q_in.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  const bool scaled = k_cache.scalar_type() == at::kChar;  // int8 rows: D codes + a float32 scale
  TORCH_CHECK(k_cache.size(3) == D + (scaled ? kRowExtra<int8_t> : 0), "head_dim of q and cache differ");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "H must be a multiple of Hkv");
  TORCH_CHECK(seq_idx.numel() == T && ctx_lens.numel() == T, "seq_idx and ctx_lens must have T entries");
  at::Tensor q = q_in.to(at::kFloat).contiguous();
  at::Tensor bt = block_tables.contiguous(), si = seq_idx.contiguous(), cl = ctx_lens.contiguous();
  TORCH_CHECK(bt.dim() == 2, "block_tables must be [S, max_blocks]");
  // Bounds: a bad table must raise, not read outside the cache.
  {
    const int32_t* sp = si.data_ptr<int32_t>();
    const int32_t* cp = cl.data_ptr<int32_t>();
    const int32_t* bp = bt.data_ptr<int32_t>();
    const int64_t S = bt.size(0), MB = bt.size(1), NB = k_cache.size(0);
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "seq_idx out of range");
      TORCH_CHECK(cp[t] >= 0 && cp[t] <= MB * bs, "ctx_len exceeds the block table");
      const int64_t nblk = (cp[t] + bs - 1) / bs;
      for (int64_t b = 0; b < nblk; ++b) {
        const int32_t id = bp[sp[t] * MB + b];
        TORCH_CHECK(id >= 0 && id < NB, "block id out of range");
      }
    }
  }
  at::Tensor out = at::empty({T, H, D}, q.options());
  if (T == 0) return out;
  const float sc = static_cast<float>(scale);
#define WS_RUN(CT)                                                                                                  \
  run<CT>(q.data_ptr<float>(), out.data_ptr<float>(), k_cache.data_ptr<CT>(), v_cache.data_ptr<CT>(),              \
          bt.data_ptr<int32_t>(), si.data_ptr<int32_t>(), cl.data_ptr<int32_t>(), T, H, Hkv, D, bs, bt.size(1),    \
          k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),           \
          v_cache.stride(2), sc)
  switch (k_cache.scalar_type()) {
    case at::kFloat: WS_RUN(float); break;
    case at::kBFloat16: WS_RUN(at::BFloat16); break;
    case at::kHalf: WS_RUN(at::Half); break;
    case at::kChar: WS_RUN(int8_t); break;
    default: TORCH_CHECK(false, "cache dtype must be float32, bfloat16, float16 or int8");
  }
#undef WS_RUN
  return out;
}

}  // namespace ws::paged
