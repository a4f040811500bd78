// Row-parallel ops a batch-invariant model needs: the MLP's activation, silu(gate) * up
// (specdec_rows::silu_mul, and its scalar form ::silu_mul_reference, bit-identical to it), and
// RMSNorm, alone (::rms_norm) or after the residual add (::add_rms_norm).
//
// Why not ATen's F.silu(gate) * up: ATen splits the [rows, width] elements among threads
// and finishes each chunk's tail with scalar exp, 1 ulp from the vector path on some
// inputs; with 3 or more threads a chunk boundary lands inside a row, so a row's values
// change with the rows beside it. A batch-invariant target cannot have that: a near tie
// could flip a greedy token between a plain step and a verify. Here every element is the
// same arithmetic wherever it sits (one exp, shared by the vector and scalar paths), and
// threads split the rows, never a row.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#if defined(__AVX512F__)
#include <immintrin.h>
#define SPECDEC_ROWS_SIMD 1
#else
#define SPECDEC_ROWS_SIMD 0
#endif

namespace {

constexpr float LOG2E = 1.4426950408889634f;
// 2^f on [-0.5, 0.5], Taylor to degree 7 (relative error < 6e-9), Horner with fused steps
// (the same as kernels/token_attention.cpp).
constexpr float EXP_C[8] = {1.f, 0.6931471805599453f, 0.2402265069591007f,
                            0.05550410866482158f, 0.009618129107628477f,
                            0.0013333558146428443f, 0.00015403530393381606f,
                            1.525273380405984e-05f};

// exp(x): 0 below -87, +inf above 88.5, NaN for NaN.
inline float exp_scalar(float x) {
  if (x != x) return x;
  if (x < -87.f) return 0.f;
  if (x > 88.5f) return INFINITY;
  const float t = x * LOG2E;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = EXP_C[7];
  for (int i = 6; i >= 0; --i) p = std::fma(p, f, EXP_C[i]);
  return std::ldexp(p, static_cast<int>(n));
}

inline float silu_mul_scalar(float g, float u) { return g / (1.f + exp_scalar(-g)) * u; }

#if SPECDEC_ROWS_SIMD
inline __m512 exp16(__m512 x) {
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __mmask16 low = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
  const __mmask16 high = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.5f), _CMP_GT_OQ);
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(LOG2E));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(EXP_C[7]);
  for (int i = 6; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C[i]));
  __m512 e = _mm512_scalef_ps(p, n);
  e = _mm512_mask_mov_ps(e, low, _mm512_setzero_ps());
  e = _mm512_mask_mov_ps(e, high, _mm512_set1_ps(INFINITY));
  return _mm512_mask_mov_ps(e, nan, x);
}
#endif

template <bool SIMD>
void run(const float* x, int64_t rows, int64_t width, float* out) {
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = x + r * 2 * width;
      const float* u = g + width;
      float* o = out + r * width;
      int64_t i = 0;
#if SPECDEC_ROWS_SIMD
      if (SIMD) {
        const __m512 one = _mm512_set1_ps(1.f);
        for (; i + 16 <= width; i += 16) {
          const __m512 gv = _mm512_loadu_ps(g + i);
          const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
          const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
          _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
        }
      }
#endif
      for (; i < width; ++i) o[i] = silu_mul_scalar(g[i], u[i]);
    }
  });
}

at::Tensor silu_mul_impl(const at::Tensor& x, bool reference) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous()
              && x.size(1) % 2 == 0,
              "silu_mul: x must be a contiguous [rows, 2 * width] float32 tensor (gate|up)");
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, x.options());
  if (rows == 0 || width == 0) return out;
  if (SPECDEC_ROWS_SIMD && !reference) {
    run<true>(x.data_ptr<float>(), rows, width, out.data_ptr<float>());
  } else {
    run<false>(x.data_ptr<float>(), rows, width, out.data_ptr<float>());
  }
  return out;
}

// RMSNorm of one row: w * x / sqrt(mean(x^2) + eps). The sum of squares runs in 16 lanes
// (lane i: the elements i mod 16, in order) added in lane order, so a row's norm is one fixed
// computation whatever rows are beside it and however the rows are shared among threads.
inline void norm_row(const float* x, const float* w, int64_t H, float eps, float* out) {
  float lanes[16] = {0.f};
  int64_t i = 0;
#if SPECDEC_ROWS_SIMD
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= H; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  _mm512_storeu_ps(lanes, acc);
#endif
  for (; i < H; ++i) lanes[i % 16] = std::fma(x[i], x[i], lanes[i % 16]);
  float sum = 0.f;
  for (int l = 0; l < 16; ++l) sum += lanes[l];
  const float r = 1.f / std::sqrt(sum / static_cast<float>(H) + eps);
  i = 0;
#if SPECDEC_ROWS_SIMD
  const __m512 rv = _mm512_set1_ps(r);
  for (; i + 16 <= H; i += 16) {
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(w + i),
                                            _mm512_mul_ps(_mm512_loadu_ps(x + i), rv)));
  }
#endif
  for (; i < H; ++i) out[i] = w[i] * (x[i] * r);
}

void check_norm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "rms_norm: x must be a contiguous [rows, hidden] float32 tensor");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.is_contiguous()
              && w.size(0) == x.size(1), "rms_norm: the weight must be [hidden] float32");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm(x, w);
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor out = at::empty({T, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * H, wp, H, static_cast<float>(eps), op + r * H);
  });
  return out;
}

// (x + a, rms_norm(x + a)): the residual add and the next norm in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& a,
                                                const at::Tensor& w, double eps) {
  check_norm(x, w);
  TORCH_CHECK(a.sizes() == x.sizes() && a.scalar_type() == at::kFloat && a.is_contiguous(),
              "add_rms_norm: the residual must be like x");
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor sum = at::empty({T, H}, x.options());
  at::Tensor out = at::empty({T, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = 0; i < H; ++i) sp[r * H + i] = xp[r * H + i] + ap[r * H + i];
      norm_row(sp + r * H, wp, H, static_cast<float>(eps), op + r * H);
    }
  });
  return {sum, out};
}

at::Tensor silu_mul(const at::Tensor& x) { return silu_mul_impl(x, false); }
at::Tensor silu_mul_reference(const at::Tensor& x) { return silu_mul_impl(x, true); }

}  // namespace

TORCH_LIBRARY(specdec_rows, m) {
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("silu_mul_reference(Tensor x) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor a, Tensor w, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specdec_rows, CPU, m) {
  m.impl("silu_mul", &silu_mul);
  m.impl("silu_mul_reference", &silu_mul_reference);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
