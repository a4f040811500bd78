// Attention for tokens that each attend alone, one op per layer: specdec_attention::attend
// (and its scalar form, ::attend_reference, bit-identical to it); ::attend_rotary first
// applies the rotary embedding to the layer's fused q|k|v and writes k and v into the cache
// (what a layer otherwise spends a dozen small ATen ops per step on).
//
// Every token's query heads attend over the first n keys of its own KV slot (n = its
// position + 1). A batch-invariant target (q4k, int8) needs a token's attention to be the
// same arithmetic whether the token is decoded alone, verified among k others or prefilled
// in a chunk of hundreds: here a token's result depends only on its query, its slot's keys
// and values and its n, never on the other tokens of the batch or on the thread count.
// The cache may hold K/V in fp16 (half of fp32's bytes; llama.cpp's default too): they are
// widened to fp32 as they are read, and every sum is fp32.
//
// The arithmetic of one token and one query head, fixed:
//   score_j = reduce(P) * scale, P[i] = q[i] k_j[i] + q[16 + i] k_j[16 + i] + ... (16 lane
//     chains of fused steps), reduce: r8[i] = P[i] + P[8 + i], r4[i] = r8[i] + r8[4 + i],
//     r2[i] = r4[i] + r4[2 + i], r2[0] + r2[1] (sixteen keys' reductions run as one cascade)
//   per chunk of CHUNK keys: m = max score; e_j = exp(score_j - m) (exp16 below);
//     l = the 16 lane sums (lane i: e_j for j = i mod 16, in order) added in lane order;
//     acc[d] = sum over j, in order, of e_j * v_j[d] (fused)
//   chunks merged in order: w_c = exp(m_c - M), out = (sum_c acc_c w_c) / (sum_c l_c w_c).
// Chunk boundaries depend on n alone. The work is cut into items (up to GROUP consecutive
// tokens of one slot, one chunk of keys): an item widens the chunk's keys and values once for
// all its tokens and heads. Which tokens share an item changes only what is loaded once,
// never a token's sums.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define SPECDEC_ATTN_SIMD 1
#else
#define SPECDEC_ATTN_SIMD 0
#endif

namespace {

constexpr int64_t CHUNK = 128;  // keys per item (a multiple of 16)
constexpr int64_t GROUP = 16;   // tokens of one slot sharing an item's widened keys
constexpr int64_t MAX_D = 512;  // head dimension bound
constexpr int64_t PREFETCH_KEYS = 8;  // how far ahead the widening asks for keys
constexpr float LOG2E = 1.4426950408889634f;

// 2^f on [-0.5, 0.5], Taylor to degree 7 (relative error < 6e-9), Horner with fused steps.
constexpr float EXP_C[8] = {1.f, 0.6931471805599453f, 0.2402265069591007f,
                            0.05550410866482158f, 0.009618129107628477f,
                            0.0013333558146428443f, 0.00015403530393381606f,
                            1.525273380405984e-05f};

// exp(x) for x <= 0 (a score minus its chunk's maximum); below -87 it is taken as 0.
inline float exp_scalar(float x) {
  if (!(x >= -87.f)) return x != x ? x : 0.f;  // NaN stays NaN
  const float t = x * LOG2E;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = EXP_C[7];
  for (int i = 6; i >= 0; --i) p = std::fma(p, f, EXP_C[i]);
  return std::ldexp(p, static_cast<int>(n));
}

#if SPECDEC_ATTN_SIMD
// exp_scalar of 16 lanes, the same steps (scalef is ldexp).
inline __m512 exp16(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_NLT_UQ);
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(LOG2E));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(EXP_C[7]);
  for (int i = 6; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C[i]));
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}
#endif

// A chunk's keys and values widened to fp32, per kv head: [h][j][d], j rounded up to 16 keys
// (the padding is never read into a kept score).
struct Widened {
  std::vector<float> k, v;
  int64_t rows = 0;  // keys per head, rounded up to 16
  template <typename KV>
  void fill(const KV* kc, const KV* vc, int64_t stride, int64_t j0, int64_t count,
            int64_t Hkv, int64_t D) {
    rows = (count + 15) / 16 * 16;
    if (static_cast<int64_t>(k.size()) < Hkv * rows * D) {
      k.assign(Hkv * rows * D, 0.f);
      v.assign(Hkv * rows * D, 0.f);
    }
    // Key by key (all heads of a key are adjacent in the cache: one stream), prefetching a
    // few keys ahead: the cache is read from memory once per step, and this is where.
    for (int64_t j = 0; j < count; ++j) {
#if SPECDEC_ATTN_SIMD
      if (j + PREFETCH_KEYS < count) {
        const char* nk = reinterpret_cast<const char*>(kc + (j0 + j + PREFETCH_KEYS) * stride);
        const char* nv = reinterpret_cast<const char*>(vc + (j0 + j + PREFETCH_KEYS) * stride);
        for (int64_t b = 0; b < stride * static_cast<int64_t>(sizeof(KV)); b += 64) {
          _mm_prefetch(nk + b, _MM_HINT_T0);
          _mm_prefetch(nv + b, _MM_HINT_T0);
        }
      }
#endif
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t at = (j0 + j) * stride + h * D;
        widen(kc + at, k.data() + (h * rows + j) * D, D);
        widen(vc + at, v.data() + (h * rows + j) * D, D);
      }
    }
  }
  static void widen(const float* src, float* dst, int64_t D) { std::copy(src, src + D, dst); }
  static void widen(const c10::Half* src, float* dst, int64_t D) {
    int64_t d = 0;
#if SPECDEC_ATTN_SIMD
    for (; d + 16 <= D; d += 16) {
      _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d))));
    }
#endif
    for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
  }
};

// One score's reduction of its 16 lane sums, in the fixed tree.
inline float reduce16(const float* P) {
  float r8[8], r4[4], r2[2];
  for (int i = 0; i < 8; ++i) r8[i] = P[i] + P[8 + i];
  for (int i = 0; i < 4; ++i) r4[i] = r8[i] + r8[4 + i];
  for (int i = 0; i < 2; ++i) r2[i] = r4[i] + r4[2 + i];
  return r2[0] + r2[1];
}

// Scores of a kv head's query rows (q[r * D], r < rows) against `blocks` blocks of 16 widened
// keys ([j][d]): out[r * CHUNK + j]. A block of keys is read from L1 by every row in turn.
template <bool SIMD>
inline void scores_of(const float* q, int64_t rows, const float* k, int64_t blocks, int64_t D,
                      float scale, float* out) {
#if SPECDEC_ATTN_SIMD
  if (SIMD) {
    // Where key m of the block lands in the cascade's result (see below).
    const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t b = 0; b < blocks; ++b) {
      const float* kb = k + b * 16 * D;
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = q + r * D;
        __m512 A[16];
#pragma GCC unroll 16
        for (int m = 0; m < 16; ++m) A[m] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
          const __m512 x = _mm512_loadu_ps(qr + d);
#pragma GCC unroll 16
          for (int m = 0; m < 16; ++m) A[m] = _mm512_fmadd_ps(x, _mm512_loadu_ps(kb + m * D + d), A[m]);
        }
        // The 16 reductions at once: T_m holds r8 of keys m (low half) and m + 8 (high
        // half); U_m r4 of keys m, m + 8, m + 4, m + 12 (quarters); V_m r2 pairs; W the sums.
        __m512 T[8], U[4], V[2];
#pragma GCC unroll 8
        for (int m = 0; m < 8; ++m) {
          T[m] = _mm512_add_ps(_mm512_shuffle_f32x4(A[m], A[m + 8], 0x44),
                               _mm512_shuffle_f32x4(A[m], A[m + 8], 0xEE));
        }
#pragma GCC unroll 4
        for (int m = 0; m < 4; ++m) {
          U[m] = _mm512_add_ps(_mm512_shuffle_f32x4(T[m], T[m + 4], 0x88),
                               _mm512_shuffle_f32x4(T[m], T[m + 4], 0xDD));
        }
#pragma GCC unroll 2
        for (int m = 0; m < 2; ++m) {
          V[m] = _mm512_add_ps(_mm512_shuffle_ps(U[m], U[m + 2], 0x44),
                               _mm512_shuffle_ps(U[m], U[m + 2], 0xEE));
        }
        const __m512 W = _mm512_add_ps(_mm512_shuffle_ps(V[0], V[1], 0x88),
                                       _mm512_shuffle_ps(V[0], V[1], 0xDD));
        _mm512_storeu_ps(out + r * CHUNK + b * 16,
                         _mm512_mul_ps(_mm512_permutexvar_ps(order, W), sc));
      }
    }
    return;
  }
#endif
  alignas(64) float P[16];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < blocks * 16; ++j) {
      for (int i = 0; i < 16; ++i) P[i] = 0.f;
      for (int64_t d = 0; d < D; d += 16) {
        for (int i = 0; i < 16; ++i) P[i] = std::fma(q[r * D + d + i], k[j * D + d + i], P[i]);
      }
      out[r * CHUNK + j] = reduce16(P) * scale;
    }
  }
}

// The chunk's softmax pieces for one row of n scores (in place: the scores become e_j).
template <bool SIMD>
inline void softmax_piece(float* s, int64_t n, float* m_out, float* l_out) {
  float mx = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int64_t j = 0; j < n; ++j) {
    nan |= s[j] != s[j];
    mx = std::max(mx, s[j]);
  }
  if (nan) mx = std::numeric_limits<float>::quiet_NaN();  // a NaN input stays visible
  alignas(64) float lanes[16] = {0.f};
  int64_t j = 0;
#if SPECDEC_ATTN_SIMD
  if (SIMD) {
    const __m512 vm = _mm512_set1_ps(mx);
    __m512 acc = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
      _mm512_storeu_ps(s + j, e);
      acc = _mm512_add_ps(acc, e);
    }
    _mm512_store_ps(lanes, acc);
  }
#endif
  for (; j < n; ++j) {
    s[j] = exp_scalar(s[j] - mx);
    lanes[j % 16] += s[j];
  }
  float l = 0.f;
  for (int i = 0; i < 16; ++i) l += lanes[i];
  *m_out = mx;
  *l_out = l;
}

#if SPECDEC_ATTN_SIMD
// NR rows x 64 columns of accumulators in registers while the keys pass (see below).
template <int NR>
inline void weighted_block(const float* e, const float* v, int64_t n, int64_t D, int64_t d0,
                           float* acc) {
  __m512 a[NR][4];
#pragma GCC unroll 6
  for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + j * D + d0;
    const __m512 x0 = _mm512_loadu_ps(vj), x1 = _mm512_loadu_ps(vj + 16);
    const __m512 x2 = _mm512_loadu_ps(vj + 32), x3 = _mm512_loadu_ps(vj + 48);
#pragma GCC unroll 6
    for (int r = 0; r < NR; ++r) {
      const __m512 p = _mm512_set1_ps(e[r * CHUNK + j]);
      a[r][0] = _mm512_fmadd_ps(p, x0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(p, x1, a[r][1]);
      a[r][2] = _mm512_fmadd_ps(p, x2, a[r][2]);
      a[r][3] = _mm512_fmadd_ps(p, x3, a[r][3]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + r * D + d0 + 16 * c, a[r][c]);
  }
}
#endif

// acc[r * D + d] = sum over j < n, in order, of e[r * CHUNK + j] * v[j][d], for a kv head's
// rows r < rows. Up to six rows x 64 columns of accumulators stay in registers while the keys
// pass; a head dimension that is not a multiple of 64 takes the scalar form's loop (the same
// sums).
template <bool SIMD>
inline void weighted_values(const float* e, int64_t rows, const float* v, int64_t n, int64_t D,
                            float* acc) {
#if SPECDEC_ATTN_SIMD
  if (SIMD && D % 64 == 0) {
    for (int64_t r0 = 0; r0 < rows; r0 += 6) {
      const float* er = e + r0 * CHUNK;
      float* ar = acc + r0 * D;
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        switch (std::min<int64_t>(6, rows - r0)) {
          case 1: weighted_block<1>(er, v, n, D, d0, ar); break;
          case 2: weighted_block<2>(er, v, n, D, d0, ar); break;
          case 3: weighted_block<3>(er, v, n, D, d0, ar); break;
          case 4: weighted_block<4>(er, v, n, D, d0, ar); break;
          case 5: weighted_block<5>(er, v, n, D, d0, ar); break;
          default: weighted_block<6>(er, v, n, D, d0, ar); break;
        }
      }
    }
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r) {
    float* ar = acc + r * D;
    std::fill(ar, ar + D, 0.f);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t d = 0; d < D; ++d) ar[d] = std::fma(e[r * CHUNK + j], v[j * D + d], ar[d]);
    }
  }
}

struct Item {
  int64_t t0, t1;  // tokens [t0, t1), one slot
  int64_t chunk;
};

template <bool SIMD>
at::Tensor run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const std::vector<int64_t>& slot, const std::vector<int64_t>& n_keys,
               float scale) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t L = k.size(1), Hkv = k.size(2), stride = Hkv * D, g = Hq / Hkv;
  const bool half = k.scalar_type() == at::kHalf;
  // A token's chunks are its partials first[t] .. first[t + 1] - 1.
  std::vector<int64_t> first(T + 1, 0);
  for (int64_t t = 0; t < T; ++t) first[t + 1] = first[t] + (n_keys[t] + CHUNK - 1) / CHUNK;
  std::vector<Item> items;
  for (int64_t t0 = 0; t0 < T;) {
    int64_t t1 = t0 + 1, most = n_keys[t0];
    while (t1 < T && t1 - t0 < GROUP && slot[t1] == slot[t0]) most = std::max(most, n_keys[t1++]);
    for (int64_t c = 0; c * CHUNK < most; ++c) items.push_back({t0, t1, c});
    t0 = t1;
  }
  const int64_t per = Hq * (D + 2);  // per partial: m and l of every head, then acc
  // Scratch kept between calls (a fresh allocation of this size is fresh pages, faulted in
  // on every layer of every step).
  thread_local std::vector<float> part;  // the calling thread's (two models may attend at once)
  if (static_cast<int64_t>(part.size()) < first[T] * per) part.resize(first[T] * per);
  float* const partials = part.data();  // (inside the workers `part` would be their own)
  const float* qp = q.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    thread_local Widened wide;
    thread_local std::vector<float> scores;
    scores.resize(g * CHUNK);
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      const int64_t j0 = it.chunk * CHUNK;
      int64_t most = 0;
      for (int64_t t = it.t0; t < it.t1; ++t) most = std::max(most, n_keys[t]);
      const int64_t count = std::min(most, j0 + CHUNK) - j0;
      const int64_t base = slot[it.t0] * L * stride;
      if (half) {
        wide.fill(k.data_ptr<c10::Half>() + base, v.data_ptr<c10::Half>() + base, stride, j0,
                  count, Hkv, D);
      } else {
        wide.fill(k.data_ptr<float>() + base, v.data_ptr<float>() + base, stride, j0, count,
                  Hkv, D);
      }
      for (int64_t t = it.t0; t < it.t1; ++t) {
        if (n_keys[t] <= j0) continue;
        const int64_t n = std::min(n_keys[t], j0 + CHUNK) - j0;
        float* pt = partials + (first[t] + it.chunk) * per;
        // Per kv head, its g query rows: scores, their softmax pieces, the weighted values.
        for (int64_t h = 0; h < Hkv; ++h) {
          const float* kh = wide.k.data() + h * wide.rows * D;
          const float* vh = wide.v.data() + h * wide.rows * D;
          scores_of<SIMD>(qp + (t * Hq + h * g) * D, g, kh, (n + 15) / 16, D, scale,
                          scores.data());
          for (int64_t r = 0; r < g; ++r) {
            softmax_piece<SIMD>(scores.data() + r * CHUNK, n, pt + h * g + r,
                                pt + Hq + h * g + r);
          }
          weighted_values<SIMD>(scores.data(), g, vh, n, D, pt + 2 * Hq + h * g * D);
        }
      }
    }
  });
  at::Tensor out = at::empty({T, Hq, D}, q.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t qh = 0; qh < Hq; ++qh) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t c = first[t]; c < first[t + 1]; ++c) mx = std::max(mx, partials[c * per + qh]);
        float* o = op + (t * Hq + qh) * D;
        std::fill(o, o + D, 0.f);
        float total = 0.f;
        for (int64_t c = first[t]; c < first[t + 1]; ++c) {
          const float* pc = partials + c * per;
          const float w = exp_scalar(pc[qh] - mx);
          total = std::fma(pc[Hq + qh], w, total);
          const float* a = pc + 2 * Hq + qh * D;
          for (int64_t d = 0; d < D; ++d) o[d] = std::fma(a[d], w, o[d]);
        }
        const float inv = 1.f / total;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  });
  return out;
}

at::Tensor attend_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& slot, const at::Tensor& n_keys, double scale,
                       bool reference) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "attend: q must be a contiguous [tokens, heads, dim] float32 tensor");
  TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && v.sizes() == k.sizes() && v.is_contiguous()
              && v.scalar_type() == k.scalar_type(),
              "attend: k and v must be contiguous [slots, len, kv heads, dim] of one dtype");
  TORCH_CHECK(k.scalar_type() == at::kHalf || k.scalar_type() == at::kFloat,
              "attend: the cache must be float16 or float32");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t S = k.size(0), L = k.size(1), Hkv = k.size(2);
  TORCH_CHECK(k.size(3) == D && D <= MAX_D && D % 16 == 0, "attend: head dims differ (q ", D,
              ", cache ", k.size(3), "), exceed ", MAX_D, " or are not a multiple of 16");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "attend: ", Hq, " query heads over ", Hkv,
              " kv heads");
  TORCH_CHECK(slot.dim() == 1 && n_keys.dim() == 1 && slot.numel() == T && n_keys.numel() == T
              && slot.scalar_type() == at::kLong && n_keys.scalar_type() == at::kLong,
              "attend: slot and n_keys must be [tokens] int64");
  auto sc = slot.contiguous(), nc = n_keys.contiguous();
  std::vector<int64_t> s(sc.data_ptr<int64_t>(), sc.data_ptr<int64_t>() + T);
  std::vector<int64_t> n(nc.data_ptr<int64_t>(), nc.data_ptr<int64_t>() + T);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(s[t] >= 0 && s[t] < S, "attend: token ", t, " has slot ", s[t], " of ", S);
    TORCH_CHECK(n[t] >= 1 && n[t] <= L, "attend: token ", t, " sees ", n[t], " keys of ", L);
  }
  const bool simd = SPECDEC_ATTN_SIMD && !reference;
  const float f = static_cast<float>(scale);
  return simd ? run<true>(q, k, v, s, n, f) : run<false>(q, k, v, s, n, f);
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& slot, const at::Tensor& n_keys, double scale) {
  return attend_impl(q, k, v, slot, n_keys, scale, false);
}

at::Tensor attend_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& slot, const at::Tensor& n_keys, double scale) {
  return attend_impl(q, k, v, slot, n_keys, scale, true);
}

// The rotary embedding of one head (rotate-half form): out = x cos + rotate_half(x) sin.
inline void rotate(const float* x, const float* c, const float* sn, int64_t D, float* out) {
  const int64_t h = D / 2;
  for (int64_t d = 0; d < h; ++d) out[d] = x[d] * c[d] - x[d + h] * sn[d];
  for (int64_t d = h; d < D; ++d) out[d] = x[d] * c[d] + x[d - h] * sn[d];
}

template <typename KV>
void rotate_and_store(const float* qkv, const float* cos, const float* sin,
                      const std::vector<int64_t>& pos, const std::vector<int64_t>& slot,
                      int64_t T, int64_t nq, int64_t nkv, int64_t D, int64_t L, float* q_out,
                      KV* kc, KV* vc) {
  const int64_t width = (nq + 2 * nkv) * D;
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float row[MAX_D];
    for (int64_t t = t0; t < t1; ++t) {
      const float* x = qkv + t * width;
      const float* c = cos + pos[t] * D;
      const float* sn = sin + pos[t] * D;
      for (int64_t h = 0; h < nq; ++h) rotate(x + h * D, c, sn, D, q_out + (t * nq + h) * D);
      for (int64_t h = 0; h < nkv; ++h) {
        const int64_t at = ((slot[t] * L + pos[t]) * nkv + h) * D;
        rotate(x + (nq + h) * D, c, sn, D, row);
        const float* vx = x + (nq + nkv + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          kc[at + d] = static_cast<KV>(row[d]);
          vc[at + d] = static_cast<KV>(vx[d]);
        }
      }
    }
  });
}

at::Tensor attend_rotary(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& positions, at::Tensor k, at::Tensor v,
                         const at::Tensor& slot, const at::Tensor& n_keys, int64_t n_q,
                         int64_t n_kv, double scale) {
  TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && v.sizes() == k.sizes() && v.is_contiguous()
              && v.scalar_type() == k.scalar_type()
              && (k.scalar_type() == at::kHalf || k.scalar_type() == at::kFloat),
              "attend_rotary: k and v must be contiguous [slots, len, kv heads, dim] float16 "
              "or float32");
  const int64_t S = k.size(0), L = k.size(1), D = k.size(3);
  TORCH_CHECK(k.size(2) == n_kv && n_q > 0 && n_kv > 0 && D % 2 == 0,
              "attend_rotary: head counts do not match the cache");
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous()
              && qkv.size(1) == (n_q + 2 * n_kv) * D,
              "attend_rotary: qkv must be a contiguous [tokens, (q + 2 kv heads) * dim] float32");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(1) == D
              && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat
              && cos.is_contiguous() && sin.is_contiguous(),
              "attend_rotary: cos and sin must be contiguous [positions, dim] float32");
  const int64_t T = qkv.size(0);
  TORCH_CHECK(positions.dim() == 1 && positions.numel() == T
              && positions.scalar_type() == at::kLong && slot.numel() == T
              && slot.scalar_type() == at::kLong,
              "attend_rotary: positions and slot must be [tokens] int64");
  auto pc = positions.contiguous(), sc = slot.contiguous();
  std::vector<int64_t> pos(pc.data_ptr<int64_t>(), pc.data_ptr<int64_t>() + T);
  std::vector<int64_t> sl(sc.data_ptr<int64_t>(), sc.data_ptr<int64_t>() + T);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < L && pos[t] < cos.size(0), "attend_rotary: token ", t,
                " at position ", pos[t], " beyond the cache or the rotary table");
    TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "attend_rotary: token ", t, " has slot ", sl[t]);
  }
  at::Tensor q = at::empty({T, n_q, D}, qkv.options());
  if (k.scalar_type() == at::kHalf) {
    rotate_and_store(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), pos,
                     sl, T, n_q, n_kv, D, L, q.data_ptr<float>(), k.data_ptr<c10::Half>(),
                     v.data_ptr<c10::Half>());
  } else {
    rotate_and_store(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), pos,
                     sl, T, n_q, n_kv, D, L, q.data_ptr<float>(), k.data_ptr<float>(),
                     v.data_ptr<float>());
  }
  return attend_impl(q, k, v, slot, n_keys, scale, false).view({T, n_q * D});
}

bool simd() { return SPECDEC_ATTN_SIMD; }

}  // namespace

TORCH_LIBRARY(specdec_attention, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor slot, Tensor n_keys, float scale) -> Tensor");
  m.def("attend_reference(Tensor q, Tensor k, Tensor v, Tensor slot, Tensor n_keys, float scale) -> Tensor");
  m.def("attend_rotary(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor(a!) k, "
        "Tensor(b!) v, Tensor slot, Tensor n_keys, int n_q, int n_kv, float scale) -> Tensor");
  m.def("simd() -> bool", &simd);
}

TORCH_LIBRARY_IMPL(specdec_attention, CPU, m) {
  m.impl("attend", &attend);
  m.impl("attend_reference", &attend_reference);
  m.impl("attend_rotary", &attend_rotary);
}
