// Small AVX2 math shared by the kernels: the horizontal sum and exp of 8 floats; and whether this build has OpenMP.
#pragma once

namespace ws {
// at::parallel_for runs threads only in code compiled with OpenMP (setup.py passes -fopenmp); each extension exports
// this as its `openmp` attribute so a build that silently lost it fails a test instead of running on one thread.
#ifdef _OPENMP
constexpr bool kOpenMP = true;
#else
constexpr bool kOpenMP = false;
#endif
}  // namespace ws

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace ws {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp for 8 floats: Cephes-style range reduction + degree-5 polynomial, ~1 ulp; inputs clamped to +-88.38.
inline __m256 exp256(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  // 2^fx: fx is in [-127, 128]; at 128 (x near +88.38) the exponent field overflows, so scale in two halves.
  const __m256i n = _mm256_cvttps_epi32(fx);
  const __m256i h = _mm256_srai_epi32(n, 1);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, _mm256_set1_epi32(127)), 23));
  const __m256 p2 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(n, h), _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
}

}  // namespace ws
#endif
