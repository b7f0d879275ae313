// The int8-activation route of qlinear.h (decode steps of a few rows) on CPUs with AVX-512 VNNI: the same integer
// dot products, 64 weights per instruction; the float32 panel route's multiply (decode batches) on 16 lanes; and,
// on CPUs with AMX-BF16, the panel route on tiles (namespace amx at the end).
// The extension is built for x86-64-v3 (AVX2), so this code is compiled
// for AVX-512 by a target pragma and runs only where the CPU has it, chosen at run time (isa.h).
//
// Why: on AVX2 a block of 32 int4 weights costs ~5 instructions (half of a pair's unpack, vpmaddubsw, add,
// vpmaddwd, convert, FMA: qlinear.h), so at one row the kernel is compute-bound below the memory bandwidth. vpdpbusd multiplies 64 unsigned
// bytes by 64 signed ones and sums each group of 4 into an int32 lane in one instruction; with the unpack and the
// per-block scale a pair of blocks (64 weights) costs ~8.
//
// Integer sums are exactly those of the AVX2 path (same activation codes, same block scales); only the float
// accumulation order differs, so outputs agree to float rounding, not bit for bit.
//   int4: the weight codes (0..15, unsigned) x activation codes (-127..127, signed).
//   int8: the activation codes + 128 (unsigned) x weight codes (signed), minus 128 * sum(weights) per block.
// Activations are laid out per pair of blocks (64 bytes), in the lane order the weight unpacking produces:
//   int4: [block 0 even elements, block 1 even, block 0 odd, block 1 odd] (16 codes each: a 32-byte load of two
//         blocks' nibbles, broadcast to both halves and shifted by 0 or 4, gives exactly these lanes);
//   int8: [block 0, block 1] (32 codes each, as stored).
// An odd last block is a pair with zero weights in its second half.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "isa.h"
#include "pool.h"

namespace ws::qlinear {

using half_t = uint16_t;  // float16 bits (at::Half's storage): the weights' scales and mins

// Software prefetch (both ISAs' int8-activation routes; outside the AVX-512 target region, as the AVX2 route calls
// it). At one row the VNNI kernel runs at ~22 GB/s per core on weights in cache but only ~7.5 from
// DRAM, where a plain read streams 12: the hardware prefetcher alone leaves the loads' latency exposed, so compute
// and memory took turns. Each tile prefetches its own rows' bytes this far ahead (the rows that follow, which this
// thread or its neighbour reads next). 1.5-3 KiB measured alike on the 2-core Xeon (a step's 121 matmuls over
// 96 MB: 7.1-7.6 ms without, 4.6-5.2 ms with; the AVX2 route 8.8-8.9 -> 6.0-6.4); WARMSTART_QLINEAR_PREFETCH=0
// turns it off (bytes), for A/B runs.
inline int64_t prefetch_distance() {
  static const int64_t d = [] {
    const char* e = std::getenv("WARMSTART_QLINEAR_PREFETCH");
    return e && *e ? std::max<long long>(0, std::atoll(e)) : 2048LL;
  }();
  return d;
}

// Prefetches [p, p + bytes) shifted by dist, a line at a time.
inline void prefetch_ahead(const void* p, int64_t bytes, int64_t dist) {
  if (dist <= 0) return;
  const char* c = static_cast<const char*>(p) + dist;
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
}

// A tile's rows n..n+C-1: the weight codes `dist` ahead, their float16 scales (and mins) as far in rows.
inline void prefetch_tile(bool int4, const void* w, const half_t* sc, const half_t* mn, int64_t n, int64_t C,
                          int64_t K) {
  const int64_t dist = prefetch_distance(), nb = K / 32, row = int4 ? K / 2 : K;
  if (dist <= 0) return;
  prefetch_ahead(static_cast<const uint8_t*>(w) + n * row, C * row, dist);
  const int64_t sdist = dist * nb * 2 / row;  // as many rows ahead (int4: dist / 8, int8: dist / 16)
  prefetch_ahead(sc + n * nb, C * nb * 2, sdist);
  if (mn) prefetch_ahead(mn + n * nb, C * nb * 2, sdist);
}

#if WS_VNNI512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on its own _mm512_undefined_* in the intrinsics
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace vnni {

// x [M, K] fp32 -> per row: np pairs of 64 code bytes (layout above), the block scales [np * 2] (0 for a missing
// last block), and for int4 sum(codes) * scale per block [nb]. Codes and scales equal quantize_rows' exactly:
// the same max|x| / 127 scale and round-to-nearest-even (the default MXCSR mode, as std::nearbyint).
inline void quantize_rows(const float* x, int64_t M, int64_t K, bool int4, uint8_t* q, float* dx, float* sx) {
  const int64_t nb = K / 32, np = (nb + 1) / 2;
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  // 64 pairs (4 KiB of codes) a chunk: a decode row (up to K = 4096) quantizes on the calling thread, without a
  // parallel region of its own (a down projection's 1536 inputs were 2 chunks: a pool round trip for ~1 us of work).
  ws::pool::parallel_for(0, M * np, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / np, p = i % np;
      uint8_t* dst = q + i * 64;
      float* d2 = dx + m * np * 2 + p * 2;
      for (int64_t j = 0; j < 2; ++j) {
        const int64_t b = 2 * p + j;
        if (b >= nb) {  // the missing second block of an odd count: weights there are zero
          d2[j] = 0.f;
          if (int4) {
            std::memset(dst + 16, 0, 16);
            std::memset(dst + 48, 0, 16);
          } else {
            std::memset(dst + 32, 128, 32);
          }
          continue;
        }
        const float* src = x + m * K + b * 32;
        const __m512 a = _mm512_loadu_ps(src), c = _mm512_loadu_ps(src + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        const __m512 vi = _mm512_set1_ps(inv);
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, vi)), qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, vi));
        d2[j] = d;
        if (int4) {
          const __m512i qe = _mm512_permutex2var_epi32(qa, even, qc), qo = _mm512_permutex2var_epi32(qa, odd, qc);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * j), _mm512_cvtepi32_epi8(qe));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32 + 16 * j), _mm512_cvtepi32_epi8(qo));
          sx[m * nb + b] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc))) * d;
        } else {
          const __m512i off = _mm512_set1_epi32(128);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32 * j), _mm512_cvtepi32_epi8(_mm512_add_epi32(qa, off)));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32 * j + 16),
                           _mm512_cvtepi32_epi8(_mm512_add_epi32(qc, off)));
        }
      }
    }
  });
}

// Two floats (a pair's two block scales; the second 0 past the last block) spread over the 16 int32 lanes that
// hold each block's partial sums.
inline __m512 spread(const float* s, bool both, __m512i idx) {
  const __m128 v = both ? _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(s))) : _mm_load_ss(s);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
}

// The same from two float16 weight scales (GGUF's own).
inline __m512 spread(const half_t* s, bool both, __m512i idx) {
  int32_t bits = s[0];
  if (both) std::memcpy(&bits, s, 4);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(bits))));
}

// sum_b a[b] * b[b] over n: float16 a (the int4 mins), float32 b
inline float dot(const half_t* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i))),
                          _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, a + i)), _mm512_maskz_loadu_ps(k, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// R activation rows x C consecutive weight rows (starting at row n) into out[r * N + n + c].
template <int R, int C>
inline void int4_tile(const uint8_t* w, const half_t* sc, const half_t* mn, int64_t n, int64_t K, int64_t N,
                      const uint8_t* q, const float* dx, const float* sx, float* out) {
  const int64_t nb = K / 32, np = (nb + 1) / 2, full = nb / 2;
  prefetch_tile(true, w, sc, mn, n, C, K);
  const __m512i shifts = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0), low = _mm512_set1_epi8(0x0F);
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  auto pair = [&](int64_t p, bool both) __attribute__((always_inline)) {
    __m512i wv[C];
    __m512 ws[C];
    for (int c = 0; c < C; ++c) {
      const uint8_t* row = w + (n + c) * (K / 2) + p * 32;
      const __m256i bytes = both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row))
                                 : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
      wv[c] = _mm512_and_si512(_mm512_srlv_epi64(_mm512_broadcast_i64x4(bytes), shifts), low);
      ws[c] = spread(sc + (n + c) * nb + 2 * p, both, idx);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(q + (r * np + p) * 64);
      const __m512 dv = spread(dx + r * np * 2 + 2 * p, true, idx);
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[c], xv)),
                                    _mm512_mul_ps(ws[c], dv), acc[r][c]);
    }
  };
  for (int64_t p = 0; p < full; ++p) pair(p, true);
  if (full < np) pair(full, false);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      out[r * N + n + c] = _mm512_reduce_add_ps(acc[r][c]) + dot(mn + (n + c) * nb, sx + r * nb, nb);
}

template <int R, int C>
inline void int8_tile(const int8_t* w, const half_t* sc, int64_t n, int64_t K, int64_t N, const uint8_t* q,
                      const float* dx, float* out) {
  const int64_t nb = K / 32, np = (nb + 1) / 2, full = nb / 2;
  prefetch_tile(false, w, sc, nullptr, n, C, K);
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i c128 = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  auto pair = [&](int64_t p, bool both) __attribute__((always_inline)) {
    __m512i wv[C], corr[C];
    __m512 ws[C];
    for (int c = 0; c < C; ++c) {
      const int8_t* row = w + (n + c) * K + p * 64;
      wv[c] = both ? _mm512_loadu_si512(row)
                   : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
      // -128 * (sum of each lane's 4 weights): the offset the unsigned activation codes carry
      corr[c] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), c128, wv[c]));
      ws[c] = spread(sc + (n + c) * nb + 2 * p, both, idx);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(q + (r * np + p) * 64);
      const __m512 dv = spread(dx + r * np * 2 + 2 * p, true, idx);
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr[c], xv, wv[c])),
                                    _mm512_mul_ps(ws[c], dv), acc[r][c]);
    }
  };
  for (int64_t p = 0; p < full; ++p) pair(p, true);
  if (full < np) pair(full, false);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * N + n + c] = _mm512_reduce_add_ps(acc[r][c]);
}

// One activation row (a decode step at batch 1). The tiles above spread each pair's weight and activation scales
// and multiply them, per weight row and per pair; here each weight row's scales are converted and multiplied by the
// activation's 16 blocks at a time, and a pair takes its lanes from that product with one permute (3 fewer
// instructions a pair; the matmuls of a step measured 1.04x, as the DRAM stream, above, bounds them). The products
// are the same floats in the same order, so the outputs are bit-identical to int4_tile / int8_tile <1, C> (test).
// Weight rows n..n+C-1's scales of blocks [b0, b0 + 16) times the activation's (0 past the last block).
template <int C>
inline void chunk_scales(const half_t* sc, int64_t n, int64_t nb, int64_t b0, const float* dx, __m512 (&s)[C]) {
  const int64_t nblk = std::min<int64_t>(16, nb - b0);
  const __mmask16 k = static_cast<__mmask16>(nblk == 16 ? 0xFFFF : (1u << nblk) - 1);
  const __m512 d = _mm512_maskz_loadu_ps(k, dx + b0);
  for (int c = 0; c < C; ++c)
    s[c] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, sc + (n + c) * nb + b0)), d);
}

template <int C>
inline void int4_row(const uint8_t* w, const half_t* sc, const half_t* mn, int64_t n, int64_t K, const uint8_t* q,
                     const float* dx, const float* sx, float* out) {
  const int64_t nb = K / 32, np = (nb + 1) / 2, full = nb / 2;
  prefetch_tile(true, w, sc, mn, n, C, K);
  const __m512i shifts = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0), low = _mm512_set1_epi8(0x0F);
  const __m512i idx0 = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0), two = _mm512_set1_epi32(2);
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += 16) {  // 16 blocks: 8 pairs
    __m512 s[C];
    chunk_scales<C>(sc, n, nb, b0, dx, s);
    __m512i idx = idx0;
    for (int64_t p = b0 / 2; p < std::min(np, (b0 + 16) / 2); ++p, idx = _mm512_add_epi32(idx, two)) {
      const bool both = p < full;
      const __m512i xv = _mm512_loadu_si512(q + p * 64);
      for (int c = 0; c < C; ++c) {
        const uint8_t* row = w + (n + c) * (K / 2) + p * 32;
        const __m256i bytes = both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row))
                                   : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
        const __m512i wv = _mm512_and_si512(_mm512_srlv_epi64(_mm512_broadcast_i64x4(bytes), shifts), low);
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv)),
                                 _mm512_permutexvar_ps(idx, s[c]), acc[c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) out[n + c] = _mm512_reduce_add_ps(acc[c]) + dot(mn + (n + c) * nb, sx, nb);
}

template <int C>
inline void int8_row(const int8_t* w, const half_t* sc, int64_t n, int64_t K, const uint8_t* q, const float* dx,
                     float* out) {
  const int64_t nb = K / 32, np = (nb + 1) / 2, full = nb / 2;
  prefetch_tile(false, w, sc, nullptr, n, C, K);
  const __m512i idx0 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), two = _mm512_set1_epi32(2);
  const __m512i c128 = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += 16) {
    __m512 s[C];
    chunk_scales<C>(sc, n, nb, b0, dx, s);
    __m512i idx = idx0;
    for (int64_t p = b0 / 2; p < std::min(np, (b0 + 16) / 2); ++p, idx = _mm512_add_epi32(idx, two)) {
      const bool both = p < full;
      const __m512i xv = _mm512_loadu_si512(q + p * 64);
      for (int c = 0; c < C; ++c) {
        const int8_t* row = w + (n + c) * K + p * 64;
        const __m512i wv = both ? _mm512_loadu_si512(row)
                                : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
        const __m512i corr =
            _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), c128, wv));
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr, xv, wv)),
                                 _mm512_permutexvar_ps(idx, s[c]), acc[c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) out[n + c] = _mm512_reduce_add_ps(acc[c]);
}

// R rows of activations against weight rows [begin, end): C rows at a time, then one.
template <int R, int C>
inline void rows(bool int4, const uint8_t* w4, const int8_t* w8, const half_t* sc, const half_t* mn, int64_t begin,
                 int64_t end, int64_t K, int64_t N, const uint8_t* q, const float* dx, const float* sx, float* out) {
  int64_t n = begin;
  if constexpr (R == 1) {
    if (int4) {
      for (; n + C <= end; n += C) int4_row<C>(w4, sc, mn, n, K, q, dx, sx, out);
      for (; n < end; ++n) int4_row<1>(w4, sc, mn, n, K, q, dx, sx, out);
    } else {
      for (; n + C <= end; n += C) int8_row<C>(w8, sc, n, K, q, dx, out);
      for (; n < end; ++n) int8_row<1>(w8, sc, n, K, q, dx, out);
    }
    return;
  }
  if (int4) {
    for (; n + C <= end; n += C) int4_tile<R, C>(w4, sc, mn, n, K, N, q, dx, sx, out);
    for (; n < end; ++n) int4_tile<R, 1>(w4, sc, mn, n, K, N, q, dx, sx, out);
  } else {
    for (; n + C <= end; n += C) int8_tile<R, C>(w8, sc, n, K, N, q, dx, out);
    for (; n < end; ++n) int8_tile<R, 1>(w8, sc, n, K, N, q, dx, out);
  }
}

// y [M, N] = x [M, K] times the weight, activations quantized to int8 per block of 32.
__attribute__((noinline)) inline void qlinear_int8_act(const float* x, int64_t M, int64_t K, int64_t N, bool int4,
                                                       const uint8_t* w4, const int8_t* w8, const half_t* sc,
                                                       const half_t* mn, float* out) {
  const int64_t nb = K / 32, np = (nb + 1) / 2;
  thread_local std::vector<uint8_t> qbuf;
  thread_local std::vector<float> dbuf, sbuf;
  if (static_cast<int64_t>(qbuf.size()) < M * np * 64) qbuf.resize(M * np * 64);
  if (static_cast<int64_t>(dbuf.size()) < M * np * 2) dbuf.resize(M * np * 2);
  if (static_cast<int64_t>(sbuf.size()) < M * nb) sbuf.resize(M * nb);
  uint8_t* q = qbuf.data();
  float *dx = dbuf.data(), *sx = sbuf.data();
  quantize_rows(x, M, K, int4, q, dx, sx);
  ws::pool::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    int64_t m = 0;
    if (M == 1) {
      rows<1, 4>(int4, w4, w8, sc, mn, begin, end, K, N, q, dx, sx, out);
      return;
    }
    for (; m + 4 <= M; m += 4)
      rows<4, 2>(int4, w4, w8, sc, mn, begin, end, K, N, q + m * np * 64, dx + m * np * 2, sx + m * nb,
                 out + m * N);
    const uint8_t* qm = q + m * np * 64;
    const float *dm = dx + m * np * 2, *sm = sx + m * nb;
    switch (M - m) {
      case 3: rows<3, 2>(int4, w4, w8, sc, mn, begin, end, K, N, qm, dm, sm, out + m * N); break;
      case 2: rows<2, 2>(int4, w4, w8, sc, mn, begin, end, K, N, qm, dm, sm, out + m * N); break;
      case 1: rows<1, 4>(int4, w4, w8, sc, mn, begin, end, K, N, qm, dm, sm, out + m * N); break;
      default: break;
    }
  });
}

// ---- the panel route (decode batches, 8-255 rows): float32 x float32 on 16 lanes --------------------------------
// qlinear.h's panel_qlinear expands 48 weight rows to float32 in L2; this multiplies them by R activation rows, C
// weight rows at a time: 4 x 6 = 24 accumulators of the 32 zmm registers, 10 loads per 24 FMAs (the AVX2 kernel:
// 4 x 3 on 8 lanes). Exact float32 like it; the sums run in another order (16 lanes).
template <int R, int C>
inline void dot_block(const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {  // K is a multiple of 32
    __m512 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_ps(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = _mm512_reduce_add_ps(acc[r][c]);
}

template <int R>
inline void dot_rows(const float* x, int64_t K, const float* w, int64_t n, float* y, int64_t ldy) {
  int64_t c = 0;
  for (; c + 6 <= n; c += 6) dot_block<R, 6>(x, K, w + c * K, y + c, ldy);
  for (; c + 3 <= n; c += 3) dot_block<R, 3>(x, K, w + c * K, y + c, ldy);
  for (; c < n; ++c) dot_block<R, 1>(x, K, w + c * K, y + c, ldy);
}

// y[m, 0 .. n) (row stride ldy) = x [M, K] times the n float32 weight rows in w.
__attribute__((noinline)) inline void panel_dots(const float* x, int64_t M, int64_t K, const float* w, int64_t n,
                                                 float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dot_rows<4>(x + m * K, K, w, n, y + m * ldy, ldy);
  switch (M - m) {
    case 3: dot_rows<3>(x + m * K, K, w, n, y + m * ldy, ldy); break;
    case 2: dot_rows<2>(x + m * K, K, w, n, y + m * ldy, ldy); break;
    case 1: dot_rows<1>(x + m * K, K, w, n, y + m * ldy, ldy); break;
    default: break;
  }
}

}  // namespace vnni

#pragma GCC diagnostic pop
#pragma GCC pop_options

// ---- the panel route on AMX (ISA level 3: Intel AMX-BF16 tiles) ------------------------------------------------
// The float32 panel kernel above is bound by its FMAs (16 products each; measured ~90 GFLOPS a core on a Sapphire
// Rapids VM, and vdpbf16ps, 32 products, ran no faster there). An AMX tile multiply (tdpbf16ps) does a 16 x 16 x 32
// product, 8192 multiply-adds, in one instruction. Here the weight panel (32 rows, two 16-row tiles) is expanded to
// bfloat16 and is the left operand; the activations, rounded to bfloat16 once per call, are the right one, laid out
// as the tiles want it (pairs of elements, one 16-row tile per 32 of K, transposed: [K/2][M rounded up to 16]). Each
// output tile is therefore y transposed (16 weight rows x 16 activation rows), stored to a scratch tile and
// transposed into y in registers. Sums stay float32; weights and activations carry a relative rounding of at most
// 2^-9 each, so an output is off by about 2^-9 of the sum of |w x| (the tests state the bound), not exact like the
// float32 route. WARMSTART_KERNEL_ISA=avx512-vnni holds the float32 route.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,avx2,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace amx {

using bf16_t = uint16_t;
constexpr int64_t kPanel = 32;  // weight rows a panel: two tiles

// Weight rows [n0, n1) as bfloat16 into dst [n1 - n0, K]: w = q * scale (+ min for int4), computed in float32
// exactly as the float32 route's expansion, then rounded to nearest even. The expansion is most of this route's
// time (the tiles' multiplies are cheap), so int4 takes a table: a block's 16 possible values, code * scale + min,
// rounded once (16 lanes), and one word permute (vpermw) of them by the 32 codes; the same values, fewer shuffles.
inline void dequantize_rows(bool int4, const uint8_t* w4, const int8_t* w8, const half_t* sc, const half_t* mn,
                            int64_t n0, int64_t n1, int64_t K, bf16_t* dst) {
  const int64_t nb = K / 32;
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
  for (int64_t n = n0; n < n1; ++n) {
    bf16_t* row = dst + (n - n0) * K;
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 s = _mm512_set1_ps(_cvtsh_ss(sc[n * nb + b]));
      __m512i out;
      if (int4) {
        const __m512 m = _mm512_set1_ps(_cvtsh_ss(mn[n * nb + b]));
        const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(codes, s, m)));
        // byte j holds elements 2j (low nibble) and 2j + 1 (high): as a 32-bit lane, the words (low, high nibble)
        const __m128i* q = reinterpret_cast<const __m128i*>(w4 + n * (K / 2) + b * 16);
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(q));
        out = _mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), nibbles, 0xA8), table);
      } else {
        const __m128i* q = reinterpret_cast<const __m128i*>(w8 + n * K + b * 32);
        const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), s);
        const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), s);
        out = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
      }
      _mm512_storeu_si512(row + b * 32, out);
    }
  }
}

// r[i] (row i of a 16 x 16 matrix of 32-bit elements) becomes column i, in registers.
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {  // 32-bit interleave within 128-bit lanes
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // 64-bit interleave: r[4i + c] lane L = column 4L + c of rows 4i..4i+3
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  __m512 o[16];
  for (int c = 0; c < 4; ++c) {  // 128-bit lanes: column 4L + c gathers lane L of r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512 a = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44), b = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
    const __m512 d = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
    const __m512 e = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
    o[c] = _mm512_shuffle_f32x4(a, d, 0x88);
    o[4 + c] = _mm512_shuffle_f32x4(a, d, 0xDD);
    o[8 + c] = _mm512_shuffle_f32x4(b, e, 0x88);
    o[12 + c] = _mm512_shuffle_f32x4(b, e, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = o[i];
}

// x [M, K] float32 -> xt [K/2][Mp] pairs of bfloat16 (Mp: M rounded up to 16; rows past M are zero): each 32 of K
// is one right-hand tile per 16 rows.
inline void pack_activations(const float* x, int64_t M, int64_t K, int64_t Mp, uint32_t* xt) {
  for (int64_t m0 = 0; m0 < Mp; m0 += 16)
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t m = m0 + i;
        const float* row = x + m * K + k0;
        r[i] = m < M ? (__m512)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row))
                     : _mm512_setzero_ps();
      }
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(xt + (k0 / 2 + i) * Mp + m0, r[i]);
    }
}

// A scratch output tile (16 weight rows x 16 activation rows) into y [M, N] at (m0, n0), transposed; nv weight
// rows and mv activation rows of it are real.
inline void store_transposed(const float* tile, float* y, int64_t N, int64_t m0, int64_t n0, int64_t mv, int64_t nv) {
  if (mv <= 0 || nv <= 0) return;
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(tile + 16 * i);
  transpose16(r);
  const __mmask16 k = static_cast<__mmask16>(nv >= 16 ? 0xFFFF : (1u << nv) - 1);
  for (int64_t j = 0; j < std::min<int64_t>(mv, 16); ++j) _mm512_mask_storeu_ps(y + (m0 + j) * N + n0, k, r[j]);
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: outputs (weight tile a x activation tile b), 4-5: the panel's two weight tiles, 6-7: activations.
// Every tile is 16 rows of 64 bytes.
inline void configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

// y [M, N] = x [M, K] times the weight, the panel route in bfloat16 tiles.
__attribute__((noinline)) inline void panel_qlinear(const float* x, int64_t M, int64_t K, int64_t N, bool int4,
                                                    const uint8_t* w4, const int8_t* w8, const half_t* sc,
                                                    const half_t* mn, float* y) {
  const int64_t Mp = (M + 15) / 16 * 16;
  thread_local std::vector<uint32_t> xbuf;
  if (static_cast<int64_t>(xbuf.size()) < K / 2 * Mp) xbuf.resize(K / 2 * Mp);
  pack_activations(x, M, K, Mp, xbuf.data());
  const uint32_t* xt = xbuf.data();
  const int64_t ldw = K * 2, ldx = Mp * 4;
  ws::pool::parallel_for(0, (N + kPanel - 1) / kPanel, 1, [&](int64_t pb, int64_t pe) {
    thread_local std::vector<bf16_t> buf;
    if (static_cast<int64_t>(buf.size()) < kPanel * K) buf.resize(kPanel * K);
    alignas(64) float out[4][256];
    configure();
    for (int64_t p = pb; p < pe; ++p) {
      const int64_t n0 = p * kPanel, nv = std::min(N - n0, kPanel);
      dequantize_rows(int4, w4, w8, sc, mn, n0, n0 + nv, K, buf.data());
      if (nv < kPanel) std::memset(buf.data() + nv * K, 0, (kPanel - nv) * K * 2);
      const bf16_t* w0 = buf.data();
      const bf16_t* w1 = buf.data() + 16 * K;
      for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
        const bool two = m0 + 16 < Mp;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k0 = 0; k0 < K; k0 += 32) {
          _tile_loadd(4, w0 + k0, ldw);
          _tile_loadd(5, w1 + k0, ldw);
          _tile_loadd(6, xt + (k0 / 2) * Mp + m0, ldx);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(2, 5, 6);
          if (two) {
            _tile_loadd(7, xt + (k0 / 2) * Mp + m0 + 16, ldx);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, out[0], 64);
        _tile_stored(2, out[2], 64);
        store_transposed(out[0], y, N, m0, n0, M - m0, nv);
        store_transposed(out[2], y, N, m0, n0 + 16, M - m0, nv - 16);
        if (two) {
          _tile_stored(1, out[1], 64);
          _tile_stored(3, out[3], 64);
          store_transposed(out[1], y, N, m0 + 16, n0, M - m0 - 16, nv);
          store_transposed(out[3], y, N, m0 + 16, n0 + 16, M - m0 - 16, nv - 16);
        }
      }
    }
    _tile_release();
  });
}

}  // namespace amx

#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif  // WS_VNNI512

}  // namespace ws::qlinear
