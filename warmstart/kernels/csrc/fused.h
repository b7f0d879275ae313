// The decode step's glue, fused: at batch 1 a layer's matmuls take a few hundred microseconds, and the dozens of
// small aten ops around them (RMSNorm's pow/mean/rsqrt/mul, RoPE's slices/neg/cat, SiLU*up, two index_copy_ into
// the cache) cost as much again in dispatch alone. Each function below is one call doing one of those jobs in a
// single pass over its rows. All math is fp32, in the same order as the torch reference in warmstart/kernels, so
// results match it to rounding. add_rms_norm, rotary_, write_kv and silu_mul also take bfloat16 rows (a bfloat16
// model's decode step): math in fp32, rounded to bfloat16 where the torch reference rounds, each op's result. Rows
// are split across threads only when there are enough of them to pay for the wake-up (a decode step's handful of
// rows runs on the calling thread).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "pool.h"
#include "vec_math.h"

namespace ws::fused {

constexpr int64_t kRowGrain = 16;

void check_f32_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

// float32 or bfloat16 rows (the activations' dtypes these kernels take).
void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16), name,
              " must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

inline float f32(float v) { return v; }
inline float f32(at::BFloat16 v) { return static_cast<float>(v); }
// v as T: bfloat16 rounds to nearest even (as torch's ops store their bfloat16 results); float32 keeps it.
template <typename T>
inline T as(float v) { return static_cast<T>(v); }
// v rounded as a T op would store it, back in float32 (the identity for float32).
template <typename T>
inline float rounded(float v) { return f32(static_cast<T>(v)); }

// normed = rmsnorm(h) * w where h = x + residual (then residual <- h, in place) or h = x when there is no residual.
// bfloat16: h rounded to bfloat16 (x + residual is a bfloat16 add), the normalised row rounded, then w * it rounded,
// as `w * F.rms_norm(h.float()).to(h.dtype)` rounds.
template <typename T>
void add_rms_norm_rows(const T* xp, int64_t xs, T* res, int64_t rs, const T* w, T* op, int64_t T_, int64_t D,
                       float feps) {
  ws::pool::parallel_for(0, T_, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* xr = xp + t * xs;
      T* o = op + t * D;
      const T* h = xr;
      if (res) {
        T* r = res + t * rs;
        for (int64_t i = 0; i < D; ++i) r[i] = as<T>(f32(r[i]) + f32(xr[i]));
        h = r;
      }
      float ss = 0.f;
      for (int64_t i = 0; i < D; ++i) ss += f32(h[i]) * f32(h[i]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + feps);
      for (int64_t i = 0; i < D; ++i) o[i] = as<T>(f32(w[i]) * rounded<T>(f32(h[i]) * inv));
    }
  });
}

torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  const auto dt = x.scalar_type();
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == dt && weight.numel() == x.size(1),
              "weight must be [D] in x's dtype");
  const int64_t T = x.size(0), D = x.size(1);
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->size(0) == T && residual->size(1) == D && residual->scalar_type() == dt,
                "residual must match x");
  }
  auto out = torch::empty({T, D}, x.options());
  const float feps = static_cast<float>(eps);
  const int64_t rs = residual ? residual->stride(0) : 0;
  if (dt == torch::kFloat)
    add_rms_norm_rows<float>(x.data_ptr<float>(), x.stride(0), residual ? residual->data_ptr<float>() : nullptr, rs,
                             weight.data_ptr<float>(), out.data_ptr<float>(), T, D, feps);
  else
    add_rms_norm_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), x.stride(0),
                                    residual ? residual->data_ptr<at::BFloat16>() : nullptr, rs,
                                    weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), T, D, feps);
  return out;
}

// Rotate-half RoPE in place on x [T, n, D] (rows of any stride, heads contiguous): for i < D/2,
// x[i] <- x[i] cos[i] - x[i+D/2] sin[i], x[i+D/2] <- x[i+D/2] cos[i+D/2] + x[i] sin[i+D/2]. cos, sin [T, D] in x's
// dtype. bfloat16: each product rounded, then their sum, as `x * cos + rotate_half(x) * sin` rounds.
template <typename T>
void rotary_rows(T* xp, int64_t xs, const T* c, const T* s, int64_t T_, int64_t n, int64_t D) {
  const int64_t half = D / 2;
  ws::pool::parallel_for(0, T_, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* ct = c + t * D;
      const T* st = s + t * D;
      for (int64_t h = 0; h < n; ++h) {
        T* v = xp + t * xs + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float a = f32(v[i]), b = f32(v[i + half]);
          if constexpr (std::is_same_v<T, float>) {
            v[i] = a * ct[i] - b * st[i];
            v[i + half] = b * ct[i + half] + a * st[i + half];
          } else {
            v[i] = as<T>(rounded<T>(a * f32(ct[i])) + rounded<T>(-b * f32(st[i])));
            v[i + half] = as<T>(rounded<T>(b * f32(ct[i + half])) + rounded<T>(a * f32(st[i + half])));
          }
        }
      }
    }
  });
}

void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && (dt == torch::kFloat || dt == torch::kBFloat16) && x.dim() == 3,
              "x must be float32 or bfloat16 [T, n, D]");
  const int64_t T = x.size(0), n = x.size(1), D = x.size(2);
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == D && D % 2 == 0, "x must have contiguous heads of even size");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == dt && sin.scalar_type() == dt &&
              cos.numel() == T * D && sin.numel() == T * D, "cos and sin must be contiguous [T, D] in x's dtype");
  if (dt == torch::kFloat)
    rotary_rows<float>(x.data_ptr<float>(), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), T, n, D);
  else
    rotary_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), x.stride(0), cos.data_ptr<at::BFloat16>(),
                              sin.data_ptr<at::BFloat16>(), T, n, D);
}

template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }

// Where (token t, kv head h)'s row goes: caches are one layer's [blocks, block_size, Hkv, row] with any strides but a
// contiguous row (the runner's is head-major: each head's rows of a block side by side, see kernels.kv_blocks).
struct CacheRows {
  int64_t bs, s0, s1, s2;
  CacheRows(const torch::Tensor& c) : bs(c.size(1)), s0(c.stride(0)), s1(c.stride(1)), s2(c.stride(2)) {}
  int64_t offset(int64_t slot, int64_t h) const { return (slot / bs) * s0 + (slot % bs) * s1 + h * s2; }
};

template <typename C, typename S>
void write_rows(const torch::Tensor& src, torch::Tensor& cache, const int64_t* slots, int64_t T, int64_t Hkv,
                int64_t D) {
  const S* sp = src.data_ptr<S>();
  const int64_t ss = src.stride(0);
  C* cp = cache.data_ptr<C>();
  const CacheRows at(cache);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hkv; ++h) {
      const S* row = sp + t * ss + h * D;
      C* dst = cp + at.offset(slots[t], h);
      if constexpr (std::is_same_v<C, S>) std::memcpy(dst, row, D * sizeof(C));
      else for (int64_t i = 0; i < D; ++i) dst[i] = from_float<C>(f32(row[i]));
    }
}

// int8 rows: each (token, head) row of D values becomes D codes and its float32 scale, stored after them (rows of
// D + 4 int8): scale = max|x| / 127, code = round-half-even(x / scale), 0 for an all-zero row.
// kernels.write_kv's torch path computes exactly this (same float32 divisions), so both write the same bytes.
template <typename S>
inline void write_rows_i8(const torch::Tensor& src, torch::Tensor& cache, const int64_t* slots, int64_t T,
                          int64_t Hkv, int64_t D) {
  const S* sp = src.data_ptr<S>();
  const int64_t ss = src.stride(0);
  int8_t* cp = cache.data_ptr<int8_t>();
  const CacheRows at(cache);
  std::vector<float> xf(std::is_same_v<S, float> ? 0 : D);  // a bfloat16 row widened
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hkv; ++h) {
      const S* xs = sp + t * ss + h * D;
      const float* x;
      if constexpr (std::is_same_v<S, float>) {
        x = xs;
      } else {
        for (int64_t i = 0; i < D; ++i) xf[i] = f32(xs[i]);
        x = xf.data();
      }
      int8_t* dst = cp + at.offset(slots[t], h);
      float amax = 0.f;
      for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float d = amax / 127.f;
      for (int64_t i = 0; i < D; ++i)
        dst[i] = d > 0.f ? static_cast<int8_t>(std::clamp(std::nearbyint(x[i] / d), -127.f, 127.f)) : int8_t(0);
      std::memcpy(dst + D, &d, sizeof(float));
    }
}

// cache[slots[t] / bs, slots[t] % bs] = k[t] (and v); k, v [T, Hkv, D] float32 or bfloat16 (rows of any stride, heads
// contiguous); caches [blocks, bs, Hkv, D] (rows contiguous, see CacheRows) in float32, bfloat16 or float16 (round to
// nearest even), or int8 [blocks, bs, Hkv, D + 4] (write_rows_i8).
template <typename S>
void write_kv_rows(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache, torch::Tensor& v_cache,
                   const int64_t* sl, int64_t T) {
  const int64_t Hkv = k.size(1), D = k.size(2);
  switch (k_cache.scalar_type()) {
    case torch::kFloat:
      write_rows<float, S>(k, k_cache, sl, T, Hkv, D); write_rows<float, S>(v, v_cache, sl, T, Hkv, D); break;
    case torch::kBFloat16:
      write_rows<at::BFloat16, S>(k, k_cache, sl, T, Hkv, D); write_rows<at::BFloat16, S>(v, v_cache, sl, T, Hkv, D);
      break;
    case torch::kHalf:
      write_rows<at::Half, S>(k, k_cache, sl, T, Hkv, D); write_rows<at::Half, S>(v, v_cache, sl, T, Hkv, D); break;
    case torch::kChar:
      write_rows_i8<S>(k, k_cache, sl, T, Hkv, D);
      write_rows_i8<S>(v, v_cache, sl, T, Hkv, D);
      break;
    default: TORCH_CHECK(false, "cache dtype must be float32, bfloat16, float16 or int8");
  }
}

void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  const auto dt = k.scalar_type();
  TORCH_CHECK((dt == torch::kFloat || dt == torch::kBFloat16) && v.scalar_type() == dt && k.dim() == 3 &&
              v.dim() == 3, "k and v must be float32 or bfloat16 [T, Hkv, D], of one dtype");
  const int64_t T = k.size(0);
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2) &&
              v.sizes() == k.sizes(), "k and v must have contiguous heads and equal shapes");
  const bool i8 = k_cache.scalar_type() == torch::kChar;
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type() && k_cache.size(2) == k.size(1) &&
                  k_cache.size(3) == k.size(2) + (i8 ? int64_t(sizeof(float)) : 0) && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1,
              "caches must be [blocks, block_size, Hkv, D] ([..., D + 4] for int8) with contiguous rows");
  TORCH_CHECK(slots.is_contiguous() && slots.scalar_type() == torch::kLong && slots.numel() == T,
              "slots must be int64 [T]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < capacity, "slot out of range");
  if (dt == torch::kFloat) write_kv_rows<float>(k, v, k_cache, v_cache, sl, T);
  else write_kv_rows<at::BFloat16>(k, v, k_cache, v_cache, sl, T);
}

// [T, 2I] (gate | up) -> silu(gate) * up, [T, I]. bfloat16: silu(gate) rounded, then the product, as
// `F.silu(gate) * up` rounds.
torch::Tensor silu_mul(torch::Tensor x) {
  check_rows(x, "x");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  TORCH_CHECK(x.size(1) % 2 == 0, "x must have an even number of columns");
  auto out = torch::empty({T, I}, x.options());
  const int64_t xs = x.stride(0);
  if (x.scalar_type() == torch::kBFloat16) {
    const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
    at::BFloat16* op = out.data_ptr<at::BFloat16>();
    ws::pool::parallel_for(0, T, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const at::BFloat16* g = xp + t * xs;
        const at::BFloat16* u = g + I;
        at::BFloat16* o = op + t * I;
        for (int64_t i = 0; i < I; ++i) {
          const float gv = f32(g[i]);
          o[i] = as<at::BFloat16>(rounded<at::BFloat16>(gv / (1.f + std::exp(-gv))) * f32(u[i]));
        }
      }
    });
    return out;
  }
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  ws::pool::parallel_for(0, T, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * xs;
      const float* u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
      for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = ws::exp256(_mm256_sub_ps(zero, gv));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// The index of each row's maximum, as torch.argmax defines it: the first maximum, and a NaN counts as the maximum
// (the first NaN wins). x [B, V] float32 -> int64 [B]. Why not torch's: its reductions over a vocabulary row run on
// the OpenMP team, whose workers sleep between regions (passive wait, warmstart/threads.py) and share their CPU
// with this pool's spinning worker; inside a decode step, argmax of one [1, 49152] row took ~100 us that way against
// ~30 us standalone. This runs a row on one thread (rows across the pool when there are many), two passes: the
// maximum (noting any NaN), then its first index.
torch::Tensor argmax_rows(torch::Tensor x) {
  check_f32_rows(x, "x");
  const int64_t B = x.size(0), V = x.size(1), xs = x.stride(0);
  TORCH_CHECK(V > 0, "argmax of an empty row");
  auto out = torch::empty({B}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  ws::pool::parallel_for(0, B, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* r = xp + b * xs;
      float best = r[0];
      bool nan = false;
      int64_t i = 0;
#if defined(__AVX2__)
      if (V >= 8) {
        __m256 m = _mm256_loadu_ps(r), bad = _mm256_cmp_ps(m, m, _CMP_UNORD_Q);
        for (i = 8; i + 8 <= V; i += 8) {
          const __m256 v = _mm256_loadu_ps(r + i);
          m = _mm256_max_ps(m, v);
          bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        nan = _mm256_movemask_ps(bad) != 0;
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, m);
        for (int l = 0; l < 8; ++l) best = std::max(best, lanes[l]);
      }
#endif
      for (; i < V; ++i) {
        nan = nan || std::isnan(r[i]);
        best = std::max(best, r[i]);
      }
      int64_t at = 0;
      if (nan) {
        while (!std::isnan(r[at])) ++at;
      } else {
        while (r[at] != best) ++at;  // the first maximum (0.0 == -0.0: the first of them, as torch keeps it)
      }
      op[b] = at;
    }
  });
  return out;
}

}  // namespace ws::fused
