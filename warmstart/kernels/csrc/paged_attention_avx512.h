// Paged attention's int8-cache tile step on 16 lanes (AVX-512 VNNI), for CPUs that have it. paged_attention.h calls
// tile_heads_i8 below instead of its own tile_heads where isa_level() >= 2 (isa.h: WARMSTART_KERNEL_ISA=avx2 holds
// a process at AVX2) and the cache is int8 with a head_dim that is a multiple of 32. The extension is built for
// x86-64-v3, so this code is compiled for AVX-512 by a target pragma and runs only where the CPU has it.
//
// Why: an int8 cache's step is bound by instructions, not by its bytes (half of float16's). Here q.k is one vpdpwssd
// (int16 x int16 pairs summed into int32 lanes) per 32 codes of a K row and query head, instead of a vpmaddwd and
// an add per 16; and P.V converts a V row's codes 16 at a time and covers 64 columns of 3 query heads in one pass
// over the tile (12 accumulators of the 32 registers) instead of two. Batch 8 x 2,048 positions on a 2-core Zen 4
// EPYC, 2 threads, built side by side: 636 us per layer call on 8 lanes, 550 with this q.k alone, 478 with this
// P.V alone, 425 with both. The softmax's exps on 16 lanes as well (exp512): 3-5% more (hot in L2, 1 thread:
// 28.2-29.2 -> 27.2-27.6 ns per sequence-position; caches in memory, 2 threads: 296-303 -> 284-303 us per call).
// Tried there and slower or no faster: P.V in integers (P rounded to int16 per tile, two positions per vpdpwssd:
// 0.97x), each P times its V row's scale at the broadcast instead of scale_cols (0.95x), scores stored 16 at a time
// (1.0x). vpdpwssd and a 16-lane FMA measured the same throughput there (one per cycle, sharing pipes).
// Not bound by its vector instructions either (session of 2026-12-06, batch 8 x 2,048, same harness): q in int8 with
// vpdpbusd over 16 positions in the lanes (K rows transposed in registers, K + 128 by an xor, 128 * sum(q) taken
// off) and P rounded to uint8 per tile with 4 positions per vpdpbusd (V rows interleaved by unpacks) halve the
// vector instructions of q.k and P.V, and ran 0.94-1.0x; with the transposes, unpacks and scale gathers also left
// out (the upper bound of a cache layout that would store K transposed and V interleaved) 1.08-1.10x. Timed with
// rdtsc, q.k took ~8 and P.V ~6-8 cycles per position and kv head in all three, even with the cache in L1.
// Float caches stay on the 8-lane step: the same 16-lane step measured slower for them there (float32 0.77-0.81x,
// bfloat16 0.83-0.89x, float16 0.93-1.0x).
//
// Same results as the 8-lane step, bit for bit: the integer q.k is exact in both, and P.V sums the same products in
// the same order in every output lane.
#pragma once

#if WS_AVX2 && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WS_PAGED512 1
#else
#define WS_PAGED512 0
#endif

#if WS_PAGED512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on its own _mm512_undefined_* in the intrinsics
#pragma GCC diagnostic ignored "-Wuninitialized"
namespace ws::paged::avx512 {

// head dims this step takes (the rest of the int8 integer path stays on 8 lanes)
inline bool int8_usable(int64_t D) { return D % 32 == 0 && int8_integer_path(D); }

// 16 int8 codes -> 16 fp32 lanes
inline __m512 ld16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// the sum of a 16-lane vector's halves (8 lanes), for scores_from_i32 (paged_attention.h)
inline __m256i fold(__m512i a) {
  return _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
}

// s[i * ld + r] = (q16_i . k[r]) * qs_i * kscale_r for R rows and GH heads (as score_block_i8 of paged_attention.h)
template <int R, int GH>
inline void score_block_i8(const int16_t* q, const float* qs, int64_t D, const int8_t* const* kp, int64_t ko,
                           float* s, int64_t ld) {
  const int8_t* k[R];
  for (int r = 0; r < R; ++r) k[r] = kp[r] + ko;
  __m512i acc[R][GH];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < GH; ++i) acc[r][i] = _mm512_setzero_si512();
  for (int64_t c = 0; c < D; c += 32) {
    __m512i qv[GH];
    for (int i = 0; i < GH; ++i) qv[i] = _mm512_loadu_si512(q + i * D + c);
    for (int r = 0; r < R; ++r) {
      const __m512i kv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k[r] + c)));
      for (int i = 0; i < GH; ++i) acc[r][i] = _mm512_dpwssd_epi32(acc[r][i], kv, qv[i]);
    }
  }
  __m256i half[R][GH];  // 16 lanes folded to 8, then the 8-lane step's reduction
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < GH; ++i) half[r][i] = fold(acc[r][i]);
  scores_from_i32<R, GH>(half, k, D, qs, s, ld);
}

template <int GH>
inline void scores_i8(const int16_t* q16, const float* qs, int64_t D, const int8_t* const* k, int64_t ko, int64_t n,
                      float* s, int64_t ld, const Next<int8_t>& nx) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int64_t r = j; r < std::min(j + 4, nx.n); ++r) prefetch_row(nx.k[r] + nx.ko, nx.bytes);
    avx512::score_block_i8<4, GH>(q16, qs, D, k + j, ko, s + j, ld);
  }
  for (; j < n; ++j) avx512::score_block_i8<1, GH>(q16, qs, D, k + j, ko, s + j, ld);
}

// acc_i[d0 .. d0 + 16*NV) += sum_j p[i * ld + j] * v[j][same range] (as pv_block of paged_attention.h)
template <int GH, int NV>
inline void pv_block(float* acc, int64_t D, const float* p, int64_t ld, const int8_t* const* v, int64_t vo,
                     int64_t n, int64_t d0, const Next<int8_t>* nx) {
  const int64_t npf = nx ? nx->n : 0;
  __m512 a[GH][NV];
  for (int i = 0; i < GH; ++i)
    for (int k = 0; k < NV; ++k) a[i][k] = _mm512_loadu_ps(acc + i * D + d0 + 16 * k);
  for (int64_t j = 0; j < n; ++j) {
    if (j < npf) prefetch_row(nx->v[j] + nx->vo, nx->bytes);
    const int8_t* vj = v[j] + vo + d0;
    __m512 pj[GH];
    for (int i = 0; i < GH; ++i) pj[i] = _mm512_set1_ps(p[i * ld + j]);
    for (int k = 0; k < NV; ++k) {
      const __m512 vv = ld16(vj + 16 * k);
      for (int i = 0; i < GH; ++i) a[i][k] = _mm512_fmadd_ps(pj[i], vv, a[i][k]);
    }
  }
  for (int i = 0; i < GH; ++i)
    for (int k = 0; k < NV; ++k) _mm512_storeu_ps(acc + i * D + d0 + 16 * k, a[i][k]);
}

// 64 columns per pass (a 64-wide head in one pass over the tile), then 32 (D is a multiple of 32)
template <int GH>
inline void pv(float* acc, int64_t D, const float* p, int64_t ld, const int8_t* const* v, int64_t vo, int64_t n,
               const Next<int8_t>& nx) {
  int64_t d0 = 0;
  const Next<int8_t>* pf = &nx;  // the first pass prefetches the next tile's V rows
  for (; d0 + 64 <= D; d0 += 64, pf = nullptr) avx512::pv_block<GH, 4>(acc, D, p, ld, v, vo, n, d0, pf);
  for (; d0 < D; d0 += 32, pf = nullptr) avx512::pv_block<GH, 2>(acc, D, p, ld, v, vo, n, d0, pf);
}

// exp256 (vec_math.h) on 16 lanes: the same operations in the same order, so the same result in every lane
inline __m512 exp512(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-88.3762626647949f);
  x = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i n = _mm512_cvttps_epi32(fx);
  const __m512i h = _mm512_srai_epi32(n, 1);
  const __m512 p1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(h, _mm512_set1_epi32(127)), 23));
  const __m512 p2 = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(n, h), _mm512_set1_epi32(127)), 23));
  return _mm512_mul_ps(_mm512_mul_ps(y, p1), p2);
}

// exp_sum of paged_attention.h, 16 lanes at a time: the same exps, and the same sum (its 8-lane partial sums take
// each 16-lane block's low half, then its high half, as the 8-lane loop takes consecutive blocks of 8)
inline float exp_sum(const float* s, float* p, int64_t n, float m) {
  int64_t i = 0;
  float sum = 0.f;
  const __m512 vm = _mm512_set1_ps(m);
  __m256 vs = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), vm));
    _mm512_storeu_ps(p + i, e);
    vs = _mm256_add_ps(_mm256_add_ps(vs, _mm512_castps512_ps256(e)), _mm512_extractf32x8_ps(e, 1));
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm512_castps512_ps256(vm)));
    _mm256_storeu_ps(p + i, e);
    vs = _mm256_add_ps(vs, e);
  }
  alignas(32) float buf[8];
  _mm256_store_ps(buf, vs);
  for (int k = 0; k < 8; ++k) sum += buf[k];
  for (; i < n; ++i) {
    p[i] = std::exp(s[i] - m);
    sum += p[i];
  }
  return sum;
}

// tile_step_i8 of paged_attention.h on 16 lanes
template <int GH>
inline void tile_step_i8(const int16_t* q16, const float* qs, int64_t D, const int8_t* const* krow, int64_t ko,
                         const int8_t* const* vrow, int64_t vo, int64_t n, const Next<int8_t>& nx, float* s, float* p,
                         float* acc, float* m, float* l) {
  avx512::scores_i8<GH>(q16, qs, D, krow, ko, n, s, kTile, nx);  // already times the K row scales
  softmax_tile<GH>(s, p, n, acc, D, m, l, [](const float* x, float* e, int64_t k, float mx) {
    return avx512::exp_sum(x, e, k, mx);
  });
  float rs[kTile];
  gather_scales(vrow, vo, D, n, rs);
  scale_cols<GH>(p, rs, n);
  avx512::pv<GH>(acc, D, p, kTile, vrow, vo, n, nx);
}

// tile_heads of paged_attention.h for an int8 cache on the integer path (a call per tile and kv head; everything
// below it is inlined here)
__attribute__((noinline)) inline void tile_heads_i8(int64_t G, const int16_t* q16, const float* qs, int64_t D,
                                                    const int8_t* const* krow, int64_t ko, const int8_t* const* vrow,
                                                    int64_t vo, int64_t n, Next<int8_t> nx, float* s, float* p,
                                                    float* acc, float* m, float* l) {
  for (int64_t i0 = 0; i0 < G; i0 += kMaxGH, nx.n = 0) {  // the first group of heads prefetches
    const int64_t gh = std::min<int64_t>(kMaxGH, G - i0);
    const int16_t* ci = q16 + i0 * D;
    float* ai = acc + i0 * D;
    switch (gh) {
      case 3: avx512::tile_step_i8<3>(ci, qs + i0, D, krow, ko, vrow, vo, n, nx, s, p, ai, m + i0, l + i0); break;
      case 2: avx512::tile_step_i8<2>(ci, qs + i0, D, krow, ko, vrow, vo, n, nx, s, p, ai, m + i0, l + i0); break;
      default: avx512::tile_step_i8<1>(ci, qs + i0, D, krow, ko, vrow, vo, n, nx, s, p, ai, m + i0, l + i0); break;
    }
  }
}

}  // namespace ws::paged::avx512
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
