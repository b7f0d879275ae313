// Paged attention on CPU: each query attends over its sequence's context by reading K/V where they live in the paged
// cache (no gather into a padded copy). One task per (query t, kv head g) handles the G = H / Hkv query heads that
// share kv head g, so every K/V row is loaded from memory once per group. Softmax is streamed (online) over tiles of
// context positions; all arithmetic is fp32. Queries arrive fp32 (the Python wrapper converts the small q tensor);
// the cache may be fp32, bf16 or fp16 and is converted on load.
//
// Built with -O3 -mavx2 -mfma -mf16c on x86-64 (see setup.py); the scalar paths below are what other ISAs compile.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define WS_AVX2 1
#else
#define WS_AVX2 0
#endif

namespace {

constexpr int64_t kMaxTile = 64;  // context positions per online-softmax step
// Tile length for head_dim d: K and V tiles (converted ones live in scratch) stay around 32 KiB, i.e. in L1/L2 while
// the G query heads of the group reuse them.
inline int64_t tile_for(int64_t d) { return std::max<int64_t>(8, std::min<int64_t>(kMaxTile, 4096 / std::max<int64_t>(d, 1))); }

// ---- loads: a row of D cache elements -> fp32 ----------------------------------------------------------------------
inline void load_row(const float* src, float* dst, int64_t d) { std::memcpy(dst, src, d * sizeof(float)); }

inline void load_row(const at::BFloat16* src, float* dst, int64_t d) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
#if WS_AVX2
  for (; i + 8 <= d; i += 8) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
#endif
  for (; i < d; ++i) {
    uint32_t w = uint32_t(s[i]) << 16;
    std::memcpy(dst + i, &w, 4);
  }
}

inline void load_row(const at::Half* src, float* dst, int64_t d) {
  int64_t i = 0;
#if WS_AVX2
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
#endif
  for (; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

// ---- fp32 primitives ----------------------------------------------------------------------------------------------
inline float dot(const float* a, const float* b, int64_t d) {
  int64_t i = 0;
  float s = 0.f;
#if WS_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= d; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  s = _mm_cvtss_f32(h);
#endif
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

#if WS_AVX2
// Four dot products of q with rows k0..k3 at once (independent FMA chains, one combined horizontal sum).
inline __m128 dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3, int64_t d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), a3);
  }
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  if (i < d) {  // head_dim not a multiple of 8
    alignas(16) float tail[4] = {0.f, 0.f, 0.f, 0.f};
    for (; i < d; ++i) {
      tail[0] += q[i] * k0[i];
      tail[1] += q[i] * k1[i];
      tail[2] += q[i] * k2[i];
      tail[3] += q[i] * k3[i];
    }
    r = _mm_add_ps(r, _mm_load_ps(tail));
  }
  return r;
}

// acc[d0 .. d0 + 8*NV) += sum_j p[j] * v[j][same range], the accumulator held in NV registers across the tile.
template <int NV>
inline void pv_block(float* acc, const float* p, const float* const* v, int64_t n, int64_t d0) {
  __m256 a[NV];
  for (int k = 0; k < NV; ++k) a[k] = _mm256_loadu_ps(acc + d0 + 8 * k);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vj = v[j] + d0;
    for (int k = 0; k < NV; ++k) a[k] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * k), a[k]);
  }
  for (int k = 0; k < NV; ++k) _mm256_storeu_ps(acc + d0 + 8 * k, a[k]);
}
#endif

// s[j] = q . k[j] for j < n
inline void scores(const float* q, const float* const* k, float* s, int64_t n, int64_t d) {
  int64_t j = 0;
#if WS_AVX2
  for (; j + 4 <= n; j += 4) _mm_storeu_ps(s + j, dot4(q, k[j], k[j + 1], k[j + 2], k[j + 3], d));
#endif
  for (; j < n; ++j) s[j] = dot(q, k[j], d);
}

// acc[0..d) += sum_j p[j] * v[j][0..d)
inline void pv(float* __restrict acc, const float* p, const float* const* v, int64_t n, int64_t d) {
  int64_t d0 = 0;
#if WS_AVX2
  for (; d0 + 64 <= d; d0 += 64) pv_block<8>(acc, p, v, n, d0);
  for (; d0 + 32 <= d; d0 += 32) pv_block<4>(acc, p, v, n, d0);
  for (; d0 + 8 <= d; d0 += 8) pv_block<1>(acc, p, v, n, d0);
#endif
  if (d0 < d)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = d0; i < d; ++i) acc[i] += p[j] * v[j][i];
}

inline void scale_row(float* acc, float c, int64_t d) {
  for (int64_t i = 0; i < d; ++i) acc[i] *= c;
}

#if WS_AVX2
// exp for 8 floats: Cephes-style range reduction + degree-5 polynomial, ~1 ulp over the softmax range (x <= 0).
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
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

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

struct Scratch {
  std::vector<float> q, acc, kt, vt, s, p, m, l;
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

  at::parallel_for(0, n_items * Hkv, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch sc;
    sc.q.resize(G * D);
    sc.acc.resize(G * D);
    const int64_t tile = tile_for(D);
    sc.kt.resize(tile * D);
    sc.vt.resize(tile * D);
    sc.s.resize(tile + 8);
    sc.p.resize(tile + 8);
    sc.m.resize(G);
    sc.l.resize(G);
    const float* krow[kMaxTile];
    const float* vrow[kMaxTile];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t item = task / Hkv, g = task % Hkv;
      const int64_t t = item_t[item], c = item_c[item];
      const int64_t ctx = ctx_lens[t];
      const int64_t p_begin = c * kSplit, p_end = std::min(ctx, p_begin + kSplit);
      const int32_t* table = bt + int64_t(seq_idx[t]) * bt_stride;
      const float* qg = q + (t * H + g * G) * D;
      for (int64_t i = 0; i < G * D; ++i) sc.q[i] = qg[i] * scale;
      std::fill(sc.acc.begin(), sc.acc.end(), 0.f);
      std::fill(sc.m.begin(), sc.m.end(), -std::numeric_limits<float>::infinity());
      std::fill(sc.l.begin(), sc.l.end(), 0.f);
      for (int64_t p0 = p_begin; p0 < p_end; p0 += tile) {
        const int64_t n = std::min(tile, p_end - p0);
        // Row pointers for this tile's positions (fp32 caches are read in place; others are converted once per group).
        for (int64_t j = 0; j < n; ++j) {
          const int64_t pos = p0 + j;
          const int64_t blk = table[pos / bs], off = pos % bs;
          const T* kr = kc + blk * kc_s0 + off * kc_s1 + g * kc_s2;
          const T* vr = vc + blk * vc_s0 + off * vc_s1 + g * vc_s2;
          if constexpr (std::is_same_v<T, float>) {
            krow[j] = kr;
            vrow[j] = vr;
          } else {
            load_row(kr, sc.kt.data() + j * D, D);
            load_row(vr, sc.vt.data() + j * D, D);
            krow[j] = sc.kt.data() + j * D;
            vrow[j] = sc.vt.data() + j * D;
          }
        }
        for (int64_t i = 0; i < G; ++i) {
          const float* qi = sc.q.data() + i * D;
          float* s = sc.s.data();
          scores(qi, krow, s, n, D);
          float mt = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < n; ++j) mt = std::max(mt, s[j]);
          const float mnew = std::max(sc.m[i], mt);
          float* acc = sc.acc.data() + i * D;
          if (mnew > sc.m[i] && sc.l[i] > 0.f) {
            const float cr = std::exp(sc.m[i] - mnew);
            sc.l[i] *= cr;
            scale_row(acc, cr, D);
          }
          sc.m[i] = mnew;
          float* p = sc.p.data();
          sc.l[i] += exp_sum(s, p, n, mnew);
          pv(acc, p, vrow, n, D);
        }
      }
      if (split) {
        float* pp = part.data() + task * part_sz;
        std::copy(sc.m.begin(), sc.m.end(), pp);
        std::copy(sc.l.begin(), sc.l.end(), pp + G);
        std::copy(sc.acc.begin(), sc.acc.end(), pp + 2 * G);
      } else {
        float* og = out + (t * H + g * G) * D;
        for (int64_t i = 0; i < G; ++i) {
          const float inv = sc.l[i] > 0.f ? 1.f / sc.l[i] : 0.f;  // ctx 0: output zeros
          for (int64_t d = 0; d < D; ++d) og[i * D + d] = sc.acc[i * D + d] * inv;
        }
      }
    }
  });
  if (!split) return;
  // merge the chunks of each (t, g): rescale to the common max, sum, normalize
  at::parallel_for(0, T_ * Hkv, 1, [&](int64_t begin, int64_t end) {
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
  TORCH_CHECK(k_cache.size(3) == D, "head_dim of q and cache differ");
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
    default: TORCH_CHECK(false, "cache dtype must be float32, bfloat16 or float16");
  }
#undef WS_RUN
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over a block-table KV cache (fp32 output)",
        py::call_guard<py::gil_scoped_release>());
  m.attr("simd") = WS_AVX2 ? "avx2+fma+f16c" : "scalar";
}
