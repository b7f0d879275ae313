// Weight-only quantized linears for CPUs without AMX: y[m, n] = sum_k x[m, k] * w[n, k], with w stored as
//   int4: uint8 [N, K/2], element 2i in the low nibble of byte i, w = q * scale[n, g] + min[n, g], groups of 32
//   int8: int8 [N, K], w = q * scale[n, g] (g = k / 32; a per-row scale is passed expanded to [N, K/32])
// Scales and mins are float16, as GGUF's Q4_0/Q4_1/Q8_0 blocks store them (exact for those): 20 bytes per 32 int4
// weights and 34 per 32 int8 ones, the GGUF file's own size, instead of 24 and 36 with float32. At one row the
// kernel streams the weights at the read bandwidth, so the bytes are the time.
// Activations are quantized to int8 per row and block of 32 (scale max|x|/127, as llama.cpp's Q8 does), so each
// block's dot product is 32 unsigned-by-signed byte products summed by _mm256_maddubs_epi16: a few instructions
// per 32 weights, where converting weights to float would take ~20. Accumulation in int32 per block, then fp32.
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

// x [M, K] fp32 -> per (row, block) int8 codes, their scale, and (for the int4 min term) the sum of codes.
// For int4 each block's codes are stored deinterleaved, [x0, x2, ..., x30, x1, x3, ..., x31], to match the
// weights' nibble order (low nibbles = even elements, high = odd).
void quantize_rows(const float* x, int64_t M, int64_t K, bool deinterleave, int8_t* qx, float* dx, float* sx) {
  const int64_t nb = K / G;
  ws::pool::parallel_for(0, M * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* src = x + (i / nb) * K + (i % nb) * G;
      float amax = 0.f;
      for (int j = 0; j < G; ++j) amax = std::max(amax, std::fabs(src[j]));
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      int8_t* dst = qx + i * G;
      int sum = 0;
      for (int j = 0; j < G; ++j) {
        const int q = static_cast<int>(std::nearbyint(src[j] * inv));
        const int pos = deinterleave ? (j % 2) * 16 + j / 2 : j;
        dst[pos] = static_cast<int8_t>(q);
        sum += q;
      }
      dx[i] = d;
      sx[i] = static_cast<float>(sum) * d;
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

// One int4 block (32 weights) against R quantized activation rows, into acc[r].
template <int R>
inline void int4_block(const uint8_t* w, float scale, const int8_t* qx, const float* dx, int64_t b, int64_t nb,
                       int64_t K, __m256* acc) {
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 16));
  const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
  for (int r = 0; r < R; ++r) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * K + b * G));
    const __m256i prod = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(prod), _mm256_set1_ps(scale * dx[r * nb + b]), acc[r]);
  }
}

template <int R>
inline void int8_block(const int8_t* w, float scale, const int8_t* qx, const float* dx, int64_t b, int64_t nb,
                       int64_t K, __m256* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * G));
  const __m256i aw = _mm256_sign_epi8(wv, wv);            // |w|: maddubs wants one unsigned operand
  for (int r = 0; r < R; ++r) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * K + b * G));
    const __m256i prod = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(prod), _mm256_set1_ps(scale * dx[r * nb + b]), acc[r]);
  }
}
#endif

// R rows of x against one weight row at a time: each weight block is unpacked once and used R times (decode
// batches). Blocks alternate between two sets of accumulators so consecutive FMAs do not wait on each other, and
// the int4 min term, sum_b min[b] * sum(x in block b), is one vector dot product after the loop.
template <int R>
void dot_int4(const uint8_t* w, const half_t* sc, const half_t* mn, const int8_t* qx, const float* dx,
              const float* sx, int64_t nb, int64_t K, float* out) {
#if WS_AVX2
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = _mm256_setzero_ps(), a1[r] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    int4_block<R>(w, h2f(sc[b]), qx, dx, b, nb, K, a0);
    int4_block<R>(w, h2f(sc[b + 1]), qx, dx, b + 1, nb, K, a1);
  }
  if (b < nb) int4_block<R>(w, h2f(sc[b]), qx, dx, b, nb, K, a0);
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(a0[r], a1[r])) + dot_h32(mn, sx + r * nb, nb);
#else
  for (int r = 0; r < R; ++r) {
    float total = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      int s = 0;
      for (int j = 0; j < 16; ++j) {
        s += (w[b * 16 + j] & 0x0F) * qx[r * K + b * G + j];
        s += (w[b * 16 + j] >> 4) * qx[r * K + b * G + 16 + j];
      }
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
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    int8_block<R>(w, h2f(sc[b]), qx, dx, b, nb, K, a0);
    int8_block<R>(w, h2f(sc[b + 1]), qx, dx, b + 1, nb, K, a1);
  }
  if (b < nb) int8_block<R>(w, h2f(sc[b]), qx, dx, b, nb, K, a0);
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
// one activation load per block for both rows. out_a = dot(w_a, x), out_b = dot(w_b, x).
void dot_int4_pair(const uint8_t* wa, const uint8_t* wb, const half_t* sca, const half_t* scb, const half_t* mna,
                   const half_t* mnb, const int8_t* qx, const float* dx, const float* sx, int64_t nb, float* out_a,
                   float* out_b) {
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  auto step = [&](int64_t b, __m256& acc_a, __m256& acc_b) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + b * G));
    const __m128i ba = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wa + b * 16));
    const __m128i bb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + b * 16));
    const __m256i qa = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(ba, 4), low), _mm_and_si128(ba, low));
    const __m256i qb = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bb, 4), low), _mm_and_si128(bb, low));
    const __m256 pa = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(qa, xv), ones));
    const __m256 pb = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(qb, xv), ones));
    acc_a = _mm256_fmadd_ps(pa, _mm256_set1_ps(h2f(sca[b]) * dx[b]), acc_a);
    acc_b = _mm256_fmadd_ps(pb, _mm256_set1_ps(h2f(scb[b]) * dx[b]), acc_b);
  };
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    step(b, a0, b0);
    step(b + 1, a1, b1);
  }
  if (b < nb) step(b, a0, b0);
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
    dot_int4<R>(w4 + n * (K / 2), sc + n * nb, mn + n * nb, qx + m0 * K, dx + m0 * nb, sx + m0 * nb, nb, K, tmp);
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
  std::vector<int8_t> qx(M * K);
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
      for (; m < M; ++m) rows_block<1>(int4, w4, w8, sc, mn, qx.data(), dx.data(), sx.data(), n, m, N, K, nb, out);
    }
  });
  return y;
}

}  // namespace ws::qlinear
