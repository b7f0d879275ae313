// Weight-only quantized linears for CPUs without AMX: y[m, n] = sum_k x[m, k] * w[n, k], with w stored as
//   int4: uint8 [N, K/2], element 2i in the low nibble of byte i, w = q * scale[n, g] + min[n, g], groups of 32
//   int8: int8 [N, K], w = q * scale[n, g] (g = k / 32; a per-row scale is passed expanded to [N, K/32])
// Scales and mins are float16, as GGUF's Q4_0/Q4_1/Q8_0 blocks store them (exact for those): 20 bytes per 32 int4
// weights and 34 per 32 int8 ones, the GGUF file's own size, instead of 24 and 36 with float32. At one row the
// kernel streams the weights at the read bandwidth, so the bytes are the time.
// Activations are quantized to int8 per row and block of 32 (scale max|x|/127, as llama.cpp's Q8 does), so each
// block's dot product is 32 unsigned-by-signed byte products summed by _mm256_maddubs_epi16: a few instructions
// per 32 weights, where converting weights to float would take ~20. Accumulation in int32 per block, then fp32.
// int4 runs two blocks per step (the activation codes laid out to match: act_row_bytes), ~5 instructions a block
// where one block at a time took ~12 with its scale converted in the loop. Against that, on a 2-core AVX2-only
// EPYC (Zen 3), in one process alternated: SmolLM2's 121 linears from memory 1.09x at 1 row, 1.28x at 2, 1.36x at
// 3, 1.12x at 4 (2 and 3 rows then took one pass over the weight, not one per row); one int4 matrix in cache
// 1.16-1.49x, int8 1.02-1.12x (its scales alone moved out of the loop).
// Why here and not torch: on AVX2 hosts aten::_weight_int4pack_mm_for_cpu runs at ~3.5 G weights/s (compute
// bound at M=1, no faster than fp32 from DRAM) and aten::_weight_int8pack_mm needs bf16 activations to be fast;
// see benchmarks/decode.py.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define WS_AVX2 1
#else
#define WS_AVX2 0
#endif

#include "pool.h"
#include "qlinear_vnni.h"
#include "vec_math.h"

namespace ws::qlinear {

constexpr int64_t G = 32;

inline float h2f(half_t h) {
#if WS_AVX2
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// int4 activation codes are laid out per pair of blocks, 64 bytes a pair: [block 2p even elements, block 2p+1 even,
// block 2p odd, block 2p+1 odd] (16 codes each), so that one 32-byte load of two blocks' weight nibbles, masked
// (low nibbles: even elements) and shifted (high: odd), lines up with two 32-byte loads of codes. A missing second
// block (an odd count) has zero codes. int8 codes stay in element order, K a row.
inline int64_t act_row_bytes(bool int4, int64_t K) { return int4 ? (K / G + 1) / 2 * 64 : K; }

#if WS_AVX2
// One block of quantize_rows below on 8 lanes: for finite x the same codes, scale and sum (max is order-free; x * inv
// and the round-to-nearest-even of cvtps, in the default MXCSR mode, are std::nearbyint's; a NaN element is left out
// of the max, as std::max leaves it). The scalar loop was a few percent of a decode step's 121 calls.
inline void quantize_block_avx2(const float* src, bool int4, int8_t* dst, float* dx, float* sx) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4];
  __m256 vm = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_loadu_ps(src + 8 * k);
    vm = _mm256_max_ps(_mm256_and_ps(v[k], abs_mask), vm);
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  const __m256 vi = _mm256_set1_ps(inv);
  __m256i q[4];
  for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], vi));
  const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  // codes in element order: the packs interleave 4-element groups per 128-bit lane, the permute restores the order
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  const __m256i codes = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (int4) {  // evens then odds per lane, then [16 evens | 16 odds]
    const __m256i eo = _mm256_shuffle_epi8(codes, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                                   0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    const __m256i split = _mm256_permute4x64_epi64(eo, 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(split));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32), _mm256_extracti128_si256(split, 1));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), codes);
  }
  *dx = d;
  *sx = static_cast<float>(_mm_cvtsi128_si32(s)) * d;
}
#endif

// x [M, K] fp32 -> per (row, block) int8 codes (rows of act_row_bytes), their scale, and (for the int4 min term) the
// sum of codes.
void quantize_rows(const float* x, int64_t M, int64_t K, bool int4, int8_t* qx, float* dx, float* sx) {
  const int64_t nb = K / G, ldq = act_row_bytes(int4, K);
  if (int4 && nb % 2)  // the missing block of each row's last pair
    for (int64_t m = 0; m < M; ++m)
      for (int64_t h = 0; h < 2; ++h) std::fill_n(qx + m * ldq + (nb / 2) * 64 + h * 32 + 16, 16, int8_t(0));
  ws::pool::parallel_for(0, M * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / nb, b = i % nb;
      const float* src = x + m * K + b * G;
      int8_t* dst = qx + m * ldq + (int4 ? (b / 2) * 64 + (b % 2) * 16 : b * G);
#if WS_AVX2
      quantize_block_avx2(src, int4, dst, dx + i, sx + i);
#else
      float amax = 0.f;
      for (int j = 0; j < G; ++j) amax = std::max(amax, std::fabs(src[j]));
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      int sum = 0;
      for (int j = 0; j < G; ++j) {
        const int q = static_cast<int>(std::nearbyint(src[j] * inv));
        dst[int4 ? (j % 2) * 32 + j / 2 : j] = static_cast<int8_t>(q);
        sum += q;
      }
      dx[i] = d;
      sx[i] = static_cast<float>(sum) * d;
#endif
    }
  });
}

#if WS_AVX2
using ws::hsum;  // vec_math.h
#endif

#if WS_AVX2
inline float dot_f32(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// sum_i h[i] * b[i]: float16 a (the int4 mins), float32 b
inline float dot_h32(const half_t* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i))),
                          _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += h2f(a[i]) * b[i];
  return s;
}

// A block's float factor, f[b] = scale[b] * dx[b] for b in [b0, b1): 8 at a time, ahead of the blocks' loop, so the
// loop takes each as one broadcast load (converting and multiplying it there, per block and row, was ~5 of the ~14
// instructions a block cost). The same float32 products as h2f(scale) * dx.
constexpr int64_t kFactorChunk = 128;  // blocks per pass (even: the alternation of accumulators is unchanged)
inline void block_factors(const half_t* sc, const float* dx, int64_t b0, int64_t b1, float* f) {
  int64_t b = b0;
  for (; b + 8 <= b1; b += 8)
    _mm256_storeu_ps(f + (b - b0), _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b))),
                                                 _mm256_loadu_ps(dx + b)));
  for (; b < b1; ++b) f[b - b0] = h2f(sc[b]) * dx[b];
}

// The same factors for int4's pairs of blocks, spread over the lanes that hold each block's sums: f[4 * (b - b0) + l]
// = scale[b] * dx[b] for l < 4 (b0 even), and 0 for the missing block of an odd count (b1 == nb odd).
inline void pair_factors(const half_t* sc, const float* dx, int64_t b0, int64_t b1, int64_t nb, float* f) {
  int64_t b = b0;
  for (; b + 8 <= b1; b += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b))),
                                   _mm256_loadu_ps(dx + b));
    for (int k = 0; k < 4; ++k)
      _mm256_storeu_ps(f + 4 * (b - b0) + 8 * k,
                       _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(2 * k, 2 * k, 2 * k, 2 * k, 2 * k + 1, 2 * k + 1,
                                                                     2 * k + 1, 2 * k + 1)));
  }
  for (; b < b1; ++b) std::fill_n(f + 4 * (b - b0), 4, h2f(sc[b]) * dx[b]);
  if (b1 == nb && nb % 2) std::fill_n(f + 4 * (b1 - b0), 4, 0.f);
}

// One int8 block's integer dot product with R activation rows' codes, scaled by f[r * kFactorChunk] into acc[r]:
// |w| (unsigned) against x with w's sign moved onto it.
template <int R>
inline void int8_block_dot(__m256i wv, const int8_t* qx, int64_t K, int64_t b, const float* f, __m256* acc) {
  const __m256i ones = _mm256_set1_epi16(1), aw = _mm256_sign_epi8(wv, wv);
  for (int r = 0; r < R; ++r) {
    const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * K + b * G)), wv);
    const __m256i prod = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(prod), _mm256_broadcast_ss(f + r * kFactorChunk), acc[r]);
  }
}

// Two int4 blocks' codes as bytes: lo = [block 2p low nibbles (even elements) | block 2p+1 low], hi = the high
// nibbles (odd elements) likewise, which is the activations' pair layout. The missing block of an odd count is zero
// (only its 16 bytes are read).
struct Nibbles {
  __m256i lo, hi;
};
inline Nibbles split_nibbles(__m256i v) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)};
}
inline Nibbles pair_nibbles(const uint8_t* w, int64_t p) {
  return split_nibbles(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32)));
}
inline Nibbles last_nibbles(const uint8_t* w, int64_t p) {  // block 2p alone (odd count): 16 bytes, the rest zero
  return split_nibbles(_mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + p * 32))));
}

// acc += (a pair of blocks' integer sums, lanes 0-3 the first block's and 4-7 the second's) * its factors
inline __m256 pair_dot(const Nibbles& q, const int8_t* x, const float* f, __m256 acc) {
  const __m256i lo = _mm256_maddubs_epi16(q.lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  const __m256i hi = _mm256_maddubs_epi16(q.hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32)));
  const __m256i sum = _mm256_madd_epi16(_mm256_add_epi16(lo, hi), _mm256_set1_epi16(1));  // |lo + hi| <= 7620
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_loadu_ps(f), acc);
}
#endif

// R rows of x against one int4 weight row: each pair of weight blocks is unpacked once and used R times (decode
// batches). Pairs alternate between two sets of accumulators so consecutive FMAs do not wait on each other, and
// the min term, sum_b min[b] * sum(x in block b), is one vector dot product after the loop. Per row the same
// operations in the same order whatever R is (and in dot_int4_pair): a row's result does not depend on its batch.
// qx: rows of ldq bytes in the pair layout (act_row_bytes).
template <int R>
void dot_int4(const uint8_t* w, const half_t* sc, const half_t* mn, const int8_t* qx, int64_t ldq, const float* dx,
              const float* sx, int64_t nb, float* out) {
#if WS_AVX2
  __m256 acc[2][R];
  for (int r = 0; r < R; ++r) acc[0][r] = _mm256_setzero_ps(), acc[1][r] = _mm256_setzero_ps();
  float f[R * 4 * kFactorChunk];
  auto pair = [&](const Nibbles& q, int64_t p, int64_t c, __m256* a) {
    for (int r = 0; r < R; ++r) a[r] = pair_dot(q, qx + r * ldq + p * 64, f + r * 4 * kFactorChunk + 8 * (p - c / 2), a[r]);
  };
  for (int64_t c = 0; c < nb; c += kFactorChunk) {  // pair p into acc[p % 2] (c / 2 is even)
    const int64_t e = std::min(nb, c + kFactorChunk), pe = e / 2;
    for (int r = 0; r < R; ++r) pair_factors(sc, dx + r * nb, c, e, nb, f + r * 4 * kFactorChunk);
    int64_t p = c / 2;
    for (; p + 2 <= pe; p += 2) {
      pair(pair_nibbles(w, p), p, c, acc[0]);
      pair(pair_nibbles(w, p + 1), p + 1, c, acc[1]);
    }
    if (p < pe) pair(pair_nibbles(w, p), p, c, acc[0]), ++p;
    if (e % 2) {
      if (p % 2)
        pair(last_nibbles(w, p), p, c, acc[1]);
      else
        pair(last_nibbles(w, p), p, c, acc[0]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(acc[0][r], acc[1][r])) + dot_h32(mn, sx + r * nb, nb);
#else
  for (int r = 0; r < R; ++r) {
    float total = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* xb = qx + r * ldq + (b / 2) * 64 + (b % 2) * 16;  // even elements at xb, odd at xb + 32
      int s = 0;
      for (int j = 0; j < 16; ++j) s += (w[b * 16 + j] & 0x0F) * xb[j] + (w[b * 16 + j] >> 4) * xb[32 + j];
      total += h2f(sc[b]) * dx[r * nb + b] * static_cast<float>(s) + h2f(mn[b]) * sx[r * nb + b];
    }
    out[r] = total;
  }
#endif
}

template <int R>
void dot_int8(const int8_t* w, const half_t* sc, const int8_t* qx, const float* dx, int64_t nb, int64_t K,
              float* out) {
#if WS_AVX2
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = _mm256_setzero_ps(), a1[r] = _mm256_setzero_ps();
  float f[R * kFactorChunk];
  auto step = [&](int64_t b, int64_t c, __m256* acc) {
    int8_block_dot<R>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * G)), qx, K, b, f + (b - c), acc);
  };
  for (int64_t c = 0; c < nb; c += kFactorChunk) {
    const int64_t e = std::min(nb, c + kFactorChunk);
    for (int r = 0; r < R; ++r) block_factors(sc, dx + r * nb, c, e, f + r * kFactorChunk);
    int64_t b = c;
    for (; b + 2 <= e; b += 2) {
      step(b, c, a0);
      step(b + 1, c, a1);
    }
    if (b < e) step(b, c, a0);
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(a0[r], a1[r]));
#else
  for (int r = 0; r < R; ++r) {
    float total = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      int s = 0;
      for (int j = 0; j < G; ++j) s += w[b * G + j] * qx[r * K + b * G + j];
      total += h2f(sc[b]) * dx[r * nb + b] * static_cast<float>(s);
    }
    out[r] = total;
  }
#endif
}

#if WS_AVX2
// One activation row (a decode step of one sequence) against two int4 weight rows: four independent FMA chains and
// one load of activation codes per pair of blocks for both rows. out_a = dot(w_a, x), out_b = dot(w_b, x), each
// exactly as dot_int4<1> computes it.
void dot_int4_pair(const uint8_t* wa, const uint8_t* wb, const half_t* sca, const half_t* scb, const half_t* mna,
                   const half_t* mnb, const int8_t* qx, const float* dx, const float* sx, int64_t nb, float* out_a,
                   float* out_b) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  float fa[4 * kFactorChunk], fb[4 * kFactorChunk];
  auto pair = [&](const Nibbles& qa, const Nibbles& qb, int64_t p, int64_t c, __m256& acc_a, __m256& acc_b) {
    const int8_t* x = qx + p * 64;
    const int64_t o = 8 * (p - c / 2);
    acc_a = pair_dot(qa, x, fa + o, acc_a);
    acc_b = pair_dot(qb, x, fb + o, acc_b);
  };
  for (int64_t c = 0; c < nb; c += kFactorChunk) {  // as dot_int4: pair p into the accumulators p % 2
    const int64_t e = std::min(nb, c + kFactorChunk), pe = e / 2;
    pair_factors(sca, dx, c, e, nb, fa);
    pair_factors(scb, dx, c, e, nb, fb);
    int64_t p = c / 2;
    for (; p + 2 <= pe; p += 2) {
      pair(pair_nibbles(wa, p), pair_nibbles(wb, p), p, c, a0, b0);
      pair(pair_nibbles(wa, p + 1), pair_nibbles(wb, p + 1), p + 1, c, a1, b1);
    }
    if (p < pe) pair(pair_nibbles(wa, p), pair_nibbles(wb, p), p, c, a0, b0), ++p;
    if (e % 2) {
      if (p % 2)
        pair(last_nibbles(wa, p), last_nibbles(wb, p), p, c, a1, b1);
      else
        pair(last_nibbles(wa, p), last_nibbles(wb, p), p, c, a0, b0);
    }
  }
  *out_a = hsum(_mm256_add_ps(a0, a1)) + dot_h32(mna, sx, nb);
  *out_b = hsum(_mm256_add_ps(b0, b1)) + dot_h32(mnb, sx, nb);
}
#endif

template <int R>
void rows_block(bool int4, const uint8_t* w4, const int8_t* w8, const half_t* sc, const half_t* mn, const int8_t* qx,
                const float* dx, const float* sx, int64_t n, int64_t m0, int64_t N, int64_t K, int64_t nb,
                float* out) {
  float tmp[R];
  if (int4)
    dot_int4<R>(w4 + n * (K / 2), sc + n * nb, mn + n * nb, qx + m0 * act_row_bytes(true, K), act_row_bytes(true, K),
                dx + m0 * nb, sx + m0 * nb, nb, tmp);
  else
    dot_int8<R>(w8 + n * K, sc + n * nb, qx + m0 * K, dx + m0 * nb, nb, K, tmp);
  for (int r = 0; r < R; ++r) out[(m0 + r) * N + n] = tmp[r];
}

// Rows [n0, n1) of the weight as float32 into dst [N, K]: w = q * scale (+ min for int4).
void dequantize_rows(bool int4, const uint8_t* w4, const int8_t* w8, const half_t* sc, const half_t* mn, int64_t n0,
                     int64_t n1, int64_t K, float* dst) {
  const int64_t nb = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    float* row = dst + n * K;
    for (int64_t b = 0; b < nb; ++b) {
      const float s = h2f(sc[n * nb + b]), m = int4 ? h2f(mn[n * nb + b]) : 0.f;
      float* o = row + b * G;
#if WS_AVX2
      const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
      __m128i lo, hi;   // the block's 32 codes in element order, 16 per register
      if (int4) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w4 + n * (K / 2) + b * 16));
        const __m128i l = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
        const __m128i h = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
        lo = _mm_unpacklo_epi8(l, h);
        hi = _mm_unpackhi_epi8(l, h);
      } else {
        lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w8 + n * K + b * G));
        hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w8 + n * K + b * G + 16));
      }
      const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      for (int k = 0; k < 4; ++k) {
        const __m256i v = int4 ? _mm256_cvtepu8_epi32(parts[k]) : _mm256_cvtepi8_epi32(parts[k]);
        _mm256_storeu_ps(o + 8 * k, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), vs, vm));
      }
      continue;
#endif
      if (int4) {
        const uint8_t* q = w4 + n * (K / 2) + b * 16;
        for (int j = 0; j < 16; ++j) {
          o[2 * j] = static_cast<float>(q[j] & 0x0F) * s + m;
          o[2 * j + 1] = static_cast<float>(q[j] >> 4) * s + m;
        }
      } else {
        const int8_t* q = w8 + n * K + b * G;
        for (int j = 0; j < G; ++j) o[j] = static_cast<float>(q[j]) * s;
      }
    }
  }
}

// Many rows (long prefill chunks): from `dense_min_rows` rows on the weight is expanded to float32, a tile of output
// columns at a time into a reused buffer (at most kDenseTile floats: 8 MiB), and multiplied by torch's float32 GEMM:
// full-precision activations, exact weight values. The boot's profiling forward runs this path and the panel path
// below, so their buffers are part of the process size the memory plan reconciles.
constexpr int64_t kDenseTile = int64_t(1) << 21;

torch::Tensor dense_qlinear(const torch::Tensor& xf, bool int4, const uint8_t* w4, const int8_t* w8, const half_t* sc,
                            const half_t* mn, int64_t N, int64_t K) {
  const int64_t rows = std::max<int64_t>(64, (kDenseTile / K) / 64 * 64);
  thread_local std::vector<float> buf;
  const int64_t need = std::min(N, rows) * K;
  if (static_cast<int64_t>(buf.size()) < need) buf.resize(need);
  float* dst = buf.data();
  const int64_t M = xf.size(0);
  auto y = torch::empty({M, N}, xf.options());
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    const int64_t n1 = std::min(N, n0 + rows);
    ws::pool::parallel_for(n0, n1, 64, [&](int64_t begin, int64_t end) {
      dequantize_rows(int4, w4, w8, sc, mn, begin, end, K, dst - n0 * K);
    });
    auto w = torch::from_blob(dst, {n1 - n0, K}, xf.options());
    if (n0 == 0 && n1 == N) return at::mm(xf, w.t());
    y.narrow(1, n0, n1 - n0).copy_(at::mm(xf, w.t()));
  }
  return y;
}

// A middle number of rows (decode batches): the weight is expanded to float32 a panel of kPanel output rows at a time
// into a per-thread buffer that stays in L2, and multiplied there by a register-blocked float32 kernel (4 x rows by
// 3 weight rows: 12 accumulators, 7 loads per 12 FMAs), so each weight byte is read from memory once per step and
// the arithmetic runs near the FMA units' peak. Full-precision activations, exact weight values; panels are fixed
// by kPanel, not by the thread count, so results do not depend on it.
constexpr int64_t kPanel = 48;
// On AMX the panel route takes every row count from panel_min_rows on (the dense route's float32 GEMM measured
// 2.2-4x slower than the tiles at 256-512 rows), in slices of this many rows.
constexpr int64_t kAmxRows = 256;

#if WS_AVX2
template <int R, int C>
inline void dot_block(const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {  // K is a multiple of 32
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = hsum(acc[r][c]);
}

template <int R>
inline void dot_rows(const float* x, int64_t K, const float* w, int64_t n, float* y, int64_t ldy) {
  int64_t c = 0;
  for (; c + 3 <= n; c += 3) dot_block<R, 3>(x, K, w + c * K, y + c, ldy);
  for (; c < n; ++c) dot_block<R, 1>(x, K, w + c * K, y + c, ldy);
}
#endif

torch::Tensor panel_qlinear(const torch::Tensor& xf, bool int4, const uint8_t* w4, const int8_t* w8, const half_t* sc,
                            const half_t* mn, int64_t N, int64_t K) {
  const int64_t M = xf.size(0);
  auto y = torch::empty({M, N}, xf.options());
  const float* x = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if WS_VNNI512
  if (isa_level() >= 3) {  // AMX tiles (qlinear_vnni.h), 256 rows at a time: their activation tiles stay in L2
    for (int64_t m = 0; m < M; m += kAmxRows)
      amx::panel_qlinear(x + m * K, std::min(kAmxRows, M - m), K, N, int4, w4, w8, sc, mn, yp + m * N);
    return y;
  }
#endif
  ws::pool::parallel_for(0, (N + kPanel - 1) / kPanel, 1, [&](int64_t pb, int64_t pe) {
    thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < kPanel * K) buf.resize(kPanel * K);
    for (int64_t p = pb; p < pe; ++p) {
      const int64_t n0 = p * kPanel, n1 = std::min(N, n0 + kPanel);
      dequantize_rows(int4, w4, w8, sc, mn, n0, n1, K, buf.data() - n0 * K);
#if WS_VNNI512
      if (isa_level() >= 2) {
        vnni::panel_dots(x, M, K, buf.data(), n1 - n0, yp + n0, N);
        continue;
      }
#endif
#if WS_AVX2
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) dot_rows<4>(x + m * K, K, buf.data(), n1 - n0, yp + m * N + n0, N);
      switch (M - m) {
        case 3: dot_rows<3>(x + m * K, K, buf.data(), n1 - n0, yp + m * N + n0, N); break;
        case 2: dot_rows<2>(x + m * K, K, buf.data(), n1 - n0, yp + m * N + n0, N); break;
        case 1: dot_rows<1>(x + m * K, K, buf.data(), n1 - n0, yp + m * N + n0, N); break;
        default: break;
      }
#else
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n) {
          float acc = 0.f;
          for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * buf[(n - n0) * K + k];
          yp[m * N + n] = acc;
        }
#endif
    }
  });
  return y;
}

torch::Tensor qlinear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                      int64_t dense_min_rows, int64_t panel_min_rows = 0) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x must be a 2-D CPU tensor");
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == torch::kHalf,
              "qweight and float16 scales must be contiguous");
  const bool int4 = mins.has_value();
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), nb = K / G;
  TORCH_CHECK(K % G == 0, "K must be a multiple of 32");
  TORCH_CHECK(qweight.size(1) == (int4 ? K / 2 : K), "qweight does not match K");
  TORCH_CHECK(scales.size(0) == N && scales.size(1) == nb, "scales must be [N, K/32]");
  if (int4)
    TORCH_CHECK(mins->is_contiguous() && mins->sizes() == scales.sizes() && mins->scalar_type() == torch::kHalf,
                "mins must be float16 and match scales");
  auto xf = x.to(torch::kFloat).contiguous();
  const half_t* sc = reinterpret_cast<const half_t*>(scales.data_ptr<at::Half>());
  const half_t* mn = int4 ? reinterpret_cast<const half_t*>(mins->data_ptr<at::Half>()) : nullptr;
  const uint8_t* w4 = int4 ? qweight.data_ptr<uint8_t>() : nullptr;
  const int8_t* w8 = int4 ? nullptr : qweight.data_ptr<int8_t>();
  if (panel_min_rows > 0 && M >= panel_min_rows && (dense_min_rows <= 0 || M < dense_min_rows || isa_level() >= 3))
    return panel_qlinear(xf, int4, w4, w8, sc, mn, N, K);
  if (dense_min_rows > 0 && M >= dense_min_rows) return dense_qlinear(xf, int4, w4, w8, sc, mn, N, K);
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  float* out = y.data_ptr<float>();
#if WS_VNNI512
  if (isa_level() >= 2) {
    vnni::qlinear_int8_act(xf.data_ptr<float>(), M, K, N, int4, w4, w8, sc, mn, out);
    return y;
  }
#endif
  std::vector<int8_t> qx(M * act_row_bytes(int4, K));
  std::vector<float> dx(M * nb), sx(M * nb);
  quantize_rows(xf.data_ptr<float>(), M, K, int4, qx.data(), dx.data(), sx.data());
  ws::pool::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
#if WS_AVX2
    if (int4 && M == 1)
      for (; n + 2 <= end; n += 2) {
        prefetch_tile(true, w4, sc, mn, n, 2, K);
        dot_int4_pair(w4 + n * (K / 2), w4 + (n + 1) * (K / 2), sc + n * nb, sc + (n + 1) * nb, mn + n * nb,
                      mn + (n + 1) * nb, qx.data(), dx.data(), sx.data(), nb, out + n, out + n + 1);
      }
#endif
    for (; n < end; ++n) {
      prefetch_tile(int4, int4 ? static_cast<const void*>(w4) : w8, sc, mn, n, 1, K);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) rows_block<4>(int4, w4, w8, sc, mn, qx.data(), dx.data(), sx.data(), n, m, N, K, nb, out);
      switch (M - m) {  // the rest in one pass too: each weight block unpacked once for all rows
        case 3: rows_block<3>(int4, w4, w8, sc, mn, qx.data(), dx.data(), sx.data(), n, m, N, K, nb, out); break;
        case 2: rows_block<2>(int4, w4, w8, sc, mn, qx.data(), dx.data(), sx.data(), n, m, N, K, nb, out); break;
        case 1: rows_block<1>(int4, w4, w8, sc, mn, qx.data(), dx.data(), sx.data(), n, m, N, K, nb, out); break;
        default: break;
      }
    }
  });
  return y;
}

}  // namespace ws::qlinear
