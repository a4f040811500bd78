// y = x W^T (+ b) for W in GGUF's K-quant blocks (Q4_K, Q6_K), x quantized to int8 per 256
// columns of a row (llama.cpp's Q4_K x Q8_K and Q6_K x Q8_K arithmetic), as torch ops:
// specdec_kquant::q4k and ::q6k (and their scalar references).
//
// Why a kernel of our own: a CPU decode step reads every weight once, so its time is the
// weights' bytes over the memory bandwidth. Q4_K is 4.5 bits a weight and Q6_K 6.6 against
// int8's 8, and torch has no CPU kernel that reads them at int8's speed. Integer dot
// products (AVX512-VNNI's vpdpbusd: u8 weights x s8 activations into int32) keep a verify
// of k+1 tokens close to a one-token step, where 4-bit weights in float arithmetic make it
// compute bound.
//
// Layouts (see q4k.py, which packs them): output channels in tiles of 16, one SIMD lane each.
// Both keep 4 low bits of every weight the same way, per 32 columns j:
//   [j (8)][quad p (4)][lane c (16)][i (4)] bytes, low nibble the weight at column
//   32j + 4p + i, high nibble the one at 32j + 16 + 4p + i          (2048 bytes a block)
// Q4_K, per tile and per 256-column block, 2368 bytes:
//   [2048, 2176) sub-block scales: [j (8)][c (16)] u8 (6 bits)
//   [2176, 2304) sub-block minimums: [pair (4)][c (16)][2] u8 (6 bits)
//   [2304, 2336) d: [c (16)] fp16;  [2336, 2368) dmin: [c (16)] fp16
//   weight[c, 32j + t] = d[c] * scale[j][c] * q - dmin[c] * min[j][c], q in 0..15
// Q6_K, 3360 bytes (6.56 bits a weight, as the file):
//   [2048, 3072) the 2 high bits: [j (8)][half h (2)][c (16)][i (4)] bytes, bits 2p..2p+1
//                of the weight at column 32j + 16h + 4p + i
//   [3072, 3328) 16-column sub-block scales: [s (16)][c (16)] s8
//   [3328, 3360) d: [c (16)] fp16
//   weight[c, 16s + t] = d[c] * scale[s][c] * (q - 32), q in 0..63
//
// Each row's result is computed by the same instructions whatever the other rows of the batch
// (rows are processed in groups, but nothing crosses between rows), so a row's logits are
// bit-identical alone and in any batch: a target may use it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define SPECDEC_KQUANT_SIMD 1
#else
#define SPECDEC_KQUANT_SIMD 0
#endif

namespace {

constexpr int64_t QK = 256;      // columns per block
constexpr int64_t TILE = 16;     // output channels per tile
constexpr int64_t BLOB = 2368;   // Q4_K bytes per (tile, block)
constexpr int64_t OFF_SC = 2048, OFF_M = 2176, OFF_D = 2304, OFF_DMIN = 2336;
constexpr int64_t BLOB6 = 3360;  // Q6_K bytes per (tile, block)
constexpr int64_t OFF6_H = 2048, OFF6_SC = 3072, OFF6_D = 3328;
constexpr int64_t MAX_ROWS = 4;  // rows sharing one pass over a tile's weights (more spill)
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 4
#endif

// A row's activations: int8 per 256-column block with one scale each, each 32-column
// sub-block's sum of those int8 (Q4_K's minimums), and 32 times each 16-column one's (Q6_K's
// offset of 32).
struct Quantized {
  const int8_t* q;       // [M][K]
  const float* scale;    // [M][nb]
  const int16_t* sums;   // [M][nb][8]
  const int32_t* sums16; // [M][nb][16], times 32
  const char* weights_end;  // (the packed weights' end: no prefetch asks past it)
};

// x: [M][Kx]; q: [M][K], K = Kx rounded up to whole blocks (the weights' zero padding).
// A row holding a NaN or an infinity is marked in `bad` (its output is NaN: garbage in must
// not come out as plausible logits); a block whose largest magnitude is below 1e-30 (whose
// scale would overflow) quantizes to zeros.
void quantize_rows(const float* x, int64_t M, int64_t Kx, int64_t K, int8_t* q, float* scale,
                   int16_t* sums, int32_t* sums16, uint8_t* bad) {
  const int64_t nb = K / QK;
  at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    alignas(64) float pad[QK];
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + r * Kx + b * QK;
        if ((b + 1) * QK > Kx) {  // the last, partial block: zeros past the row's end
          const int64_t have = Kx - b * QK;
          std::memcpy(pad, xb, have * sizeof(float));
          std::fill(pad + have, pad + QK, 0.f);
          xb = pad;
        }
        int8_t* qb = q + r * K + b * QK;
        float amax = 0.f;
        bool finite = true;
        for (int64_t t = 0; t < QK; ++t) {
          finite &= std::isfinite(xb[t]);
          amax = std::max(amax, std::fabs(xb[t]));
        }
        if (!finite) {
          bad[r] = 1;
          amax = 0.f;
        }
        const float iscale = amax > 1e-30f ? 127.f / amax : 0.f;
        scale[r * nb + b] = iscale > 0.f ? amax / 127.f : 0.f;
        for (int64_t j = 0; j < 8; ++j) {
          int half[2] = {0, 0};
          for (int64_t t = 0; t < 32; ++t) {
            const int v = iscale > 0.f ? static_cast<int>(std::nearbyint(xb[j * 32 + t] * iscale)) : 0;
            qb[j * 32 + t] = static_cast<int8_t>(v);
            half[t / 16] += v;
          }
          sums[(r * nb + b) * 8 + j] = static_cast<int16_t>(half[0] + half[1]);
          sums16[(r * nb + b) * 16 + 2 * j] = 32 * half[0];
          sums16[(r * nb + b) * 16 + 2 * j + 1] = 32 * half[1];
        }
      }
    }
  });
}

// The reference: the same integer sums and the same float steps, one lane at a time.
void tile_scalar(const uint8_t* tile, int64_t nb, const Quantized& xq, int64_t K,
                 int64_t r0, int64_t rows, float* out /* [rows][16] */) {
  for (int64_t r = r0; r < r0 + rows; ++r) {
    for (int64_t c = 0; c < TILE; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* w = tile + b * BLOB;
        const int8_t* xr = xq.q + r * K + b * QK;
        int32_t itot = 0;
        for (int64_t j = 0; j < 8; ++j) {
          int32_t isum = 0;
          for (int64_t p = 0; p < 4; ++p) {
            for (int64_t i = 0; i < 4; ++i) {
              const uint8_t byte = w[j * 256 + p * 64 + c * 4 + i];
              isum += (byte & 0x0F) * xr[j * 32 + 4 * p + i];
              isum += (byte >> 4) * xr[j * 32 + 16 + 4 * p + i];
            }
          }
          itot += isum * w[OFF_SC + j * 16 + c];
        }
        int32_t mt = 0;
        const int16_t* s = xq.sums + (r * nb + b) * 8;
        for (int64_t i = 0; i < 4; ++i) {
          mt += w[OFF_M + i * 32 + c * 2] * s[2 * i] + w[OFF_M + i * 32 + c * 2 + 1] * s[2 * i + 1];
        }
        c10::Half d, dmin;
        std::memcpy(&d, w + OFF_D + 2 * c, 2);
        std::memcpy(&dmin, w + OFF_DMIN + 2 * c, 2);
        const float sr = xq.scale[r * nb + b];
        acc = std::fma(static_cast<float>(itot), static_cast<float>(d) * sr, acc);
        acc = std::fma(-static_cast<float>(mt), static_cast<float>(dmin) * sr, acc);
      }
      out[(r - r0) * TILE + c] = acc;
    }
  }
}

// Q6_K's reference: the same integers and float steps as tile6_simd, one lane at a time.
void tile6_scalar(const uint8_t* tile, int64_t nb, const Quantized& xq, int64_t K,
                  int64_t r0, int64_t rows, float* out /* [rows][16] */) {
  for (int64_t r = r0; r < r0 + rows; ++r) {
    for (int64_t c = 0; c < TILE; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* w = tile + b * BLOB6;
        const int8_t* xr = xq.q + r * K + b * QK;
        const int32_t* s16 = xq.sums16 + (r * nb + b) * 16;
        int32_t itot = 0;
        for (int64_t j = 0; j < 8; ++j) {
          int32_t isum[2] = {0, 0};
          for (int64_t h = 0; h < 2; ++h) {
            for (int64_t p = 0; p < 4; ++p) {
              for (int64_t i = 0; i < 4; ++i) {
                const uint8_t byte = w[j * 256 + p * 64 + c * 4 + i];
                const int low = h ? byte >> 4 : byte & 0x0F;
                const int high = (w[OFF6_H + j * 128 + h * 64 + c * 4 + i] >> (2 * p)) & 3;
                isum[h] += (low | (high << 4)) * xr[j * 32 + 16 * h + 4 * p + i];
              }
            }
            const int8_t sc = static_cast<int8_t>(w[OFF6_SC + (2 * j + h) * 16 + c]);
            itot += (isum[h] - s16[2 * j + h]) * sc;
          }
        }
        c10::Half d;
        std::memcpy(&d, w + OFF6_D + 2 * c, 2);
        acc = std::fma(static_cast<float>(itot), static_cast<float>(d) * xq.scale[r * nb + b],
                       acc);
      }
      out[(r - r0) * TILE + c] = acc;
    }
  }
}

#if SPECDEC_KQUANT_SIMD
inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int R>
void tile_simd(const uint8_t* tile, int64_t nb, const Quantized& xq, int64_t K, int64_t r0,
               float* out /* [R][16] */) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i zero = _mm512_setzero_si512();
  __m512 facc[R];
  for (int r = 0; r < R; ++r) facc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = tile + b * BLOB;
    __m512i itot[R];
    for (int r = 0; r < R; ++r) itot[r] = zero;
    for (int64_t j = 0; j < 8; ++j) {
      const uint8_t* qj = w + j * 256;
      // The weights stream from memory once per step: ask for a block PREFETCH_BLOCKS ahead
      // (the next tile's, past this tile's end: a thread's tiles are contiguous), 5 of its
      // 37 lines per sub-block. The hardware prefetcher alone left a step at ~26 GB/s.
      const char* ahead = reinterpret_cast<const char*>(w + PREFETCH_BLOCKS * BLOB + j * 320);
      if (ahead + 64 * 5 <= xq.weights_end) {
        for (int l = 0; l < 5; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
      }
      __m512i lo[4], hi[4];
      for (int p = 0; p < 4; ++p) {
        const __m512i v = _mm512_loadu_si512(qj + 64 * p);
        lo[p] = _mm512_and_si512(v, low);
        hi[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      const __m512i sc = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + OFF_SC + j * 16)));
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq.q + (r0 + r) * K + b * QK + j * 32;
        __m512i a = _mm512_dpbusd_epi32(zero, lo[0], bcast4(xr));
        __m512i c = _mm512_dpbusd_epi32(zero, hi[0], bcast4(xr + 16));
        a = _mm512_dpbusd_epi32(a, lo[1], bcast4(xr + 4));
        c = _mm512_dpbusd_epi32(c, hi[1], bcast4(xr + 20));
        a = _mm512_dpbusd_epi32(a, lo[2], bcast4(xr + 8));
        c = _mm512_dpbusd_epi32(c, hi[2], bcast4(xr + 24));
        a = _mm512_dpbusd_epi32(a, lo[3], bcast4(xr + 12));
        c = _mm512_dpbusd_epi32(c, hi[3], bcast4(xr + 28));
        itot[r] = _mm512_add_epi32(itot[r], _mm512_mullo_epi32(_mm512_add_epi32(a, c), sc));
      }
    }
    __m512i mp[4];
    for (int i = 0; i < 4; ++i) {
      mp[i] = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + OFF_M + 32 * i)));
    }
    const __m512 d = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + OFF_D)));
    const __m512 dmin = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + OFF_DMIN)));
    for (int r = 0; r < R; ++r) {
      const int16_t* s = xq.sums + ((r0 + r) * nb + b) * 8;
      __m512i mt = zero;
      for (int i = 0; i < 4; ++i) {
        int32_t pair;
        std::memcpy(&pair, s + 2 * i, 4);
        mt = _mm512_dpwssd_epi32(mt, mp[i], _mm512_set1_epi32(pair));
      }
      const __m512 sr = _mm512_set1_ps(xq.scale[(r0 + r) * nb + b]);
      facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(itot[r]), _mm512_mul_ps(d, sr), facc[r]);
      facc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mt), _mm512_mul_ps(dmin, sr), facc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * TILE, facc[r]);
}

template <int R>
void tile6_simd(const uint8_t* tile, int64_t nb, const Quantized& xq, int64_t K, int64_t r0,
                float* out /* [R][16] */) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i two = _mm512_set1_epi8(0x30);   // the high bits' place in a 6-bit value
  const __m512i zero = _mm512_setzero_si512();
  __m512 facc[R];
  for (int r = 0; r < R; ++r) facc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = tile + b * BLOB6;
    __m512i itot[R];
    for (int r = 0; r < R; ++r) itot[r] = zero;
    for (int64_t j = 0; j < 8; ++j) {
      const uint8_t* qj = w + j * 256;
      const char* ahead = reinterpret_cast<const char*>(w + PREFETCH_BLOCKS * BLOB6 + j * 448);
      if (ahead + 64 * 7 <= xq.weights_end) {
        for (int l = 0; l < 7; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
      }
      const __m512i h0 = _mm512_loadu_si512(w + OFF6_H + j * 128);
      const __m512i h1 = _mm512_loadu_si512(w + OFF6_H + j * 128 + 64);
      __m512i lo[4], hi[4];
      for (int p = 0; p < 4; ++p) {
        const __m512i v = _mm512_loadu_si512(qj + 64 * p);
        // bits 2p..2p+1 of the high-bit bytes to bits 4..5 (16-bit shifts: the mask drops
        // what crosses a byte).
        const int sh = 4 - 2 * p;
        const __m512i g0 = sh >= 0 ? _mm512_slli_epi16(h0, sh) : _mm512_srli_epi16(h0, -sh);
        const __m512i g1 = sh >= 0 ? _mm512_slli_epi16(h1, sh) : _mm512_srli_epi16(h1, -sh);
        lo[p] = _mm512_ternarylogic_epi32(_mm512_and_si512(v, low), g0, two, 0xF8);
        hi[p] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), g1,
                                          two, 0xF8);
      }
      const __m512i sc0 = _mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + OFF6_SC + (2 * j) * 16)));
      const __m512i sc1 = _mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + OFF6_SC + (2 * j + 1) * 16)));
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq.q + (r0 + r) * K + b * QK + j * 32;
        const int32_t* s16 = xq.sums16 + ((r0 + r) * nb + b) * 16 + 2 * j;
        __m512i a = _mm512_dpbusd_epi32(zero, lo[0], bcast4(xr));
        __m512i c = _mm512_dpbusd_epi32(zero, hi[0], bcast4(xr + 16));
        a = _mm512_dpbusd_epi32(a, lo[1], bcast4(xr + 4));
        c = _mm512_dpbusd_epi32(c, hi[1], bcast4(xr + 20));
        a = _mm512_dpbusd_epi32(a, lo[2], bcast4(xr + 8));
        c = _mm512_dpbusd_epi32(c, hi[2], bcast4(xr + 24));
        a = _mm512_dpbusd_epi32(a, lo[3], bcast4(xr + 12));
        c = _mm512_dpbusd_epi32(c, hi[3], bcast4(xr + 28));
        a = _mm512_mullo_epi32(_mm512_sub_epi32(a, _mm512_set1_epi32(s16[0])), sc0);
        c = _mm512_mullo_epi32(_mm512_sub_epi32(c, _mm512_set1_epi32(s16[1])), sc1);
        itot[r] = _mm512_add_epi32(itot[r], _mm512_add_epi32(a, c));
      }
    }
    const __m512 d = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + OFF6_D)));
    for (int r = 0; r < R; ++r) {
      const __m512 sr = _mm512_set1_ps(xq.scale[(r0 + r) * nb + b]);
      facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(itot[r]), _mm512_mul_ps(d, sr), facc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * TILE, facc[r]);
}

template <bool SIX>
void tile_rows(const uint8_t* tile, int64_t nb, const Quantized& xq, int64_t K, int64_t r0,
               int64_t rows, float* out) {
  switch (rows) {
    case 1: return SIX ? tile6_simd<1>(tile, nb, xq, K, r0, out)
                       : tile_simd<1>(tile, nb, xq, K, r0, out);
    case 2: return SIX ? tile6_simd<2>(tile, nb, xq, K, r0, out)
                       : tile_simd<2>(tile, nb, xq, K, r0, out);
    case 3: return SIX ? tile6_simd<3>(tile, nb, xq, K, r0, out)
                       : tile_simd<3>(tile, nb, xq, K, r0, out);
    default: return SIX ? tile6_simd<4>(tile, nb, xq, K, r0, out)
                        : tile_simd<4>(tile, nb, xq, K, r0, out);
  }
}
#else
template <bool SIX>
void tile_rows(const uint8_t* tile, int64_t nb, const Quantized& xq, int64_t K, int64_t r0,
               int64_t rows, float* out) {
  if (SIX) {
    tile6_scalar(tile, nb, xq, K, r0, rows, out);
  } else {
    tile_scalar(tile, nb, xq, K, r0, rows, out);
  }
}
#endif

template <bool SIX>
at::Tensor run(const at::Tensor& x, const at::Tensor& packed, int64_t N,
               const c10::optional<at::Tensor>& bias, bool reference) {
  const int64_t blob = SIX ? BLOB6 : BLOB;
  const char* op = SIX ? "q6k" : "q4k";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              op, ": x must be a contiguous 2-d float32 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous()
              && packed.size(2) == blob, op, ": packed must be [tiles, blocks, ", blob, "] uint8");
  const int64_t M = x.size(0), Kx = x.size(1), nb = packed.size(1), tiles = packed.size(0);
  const int64_t K = nb * QK;  // the weights' columns, zero-padded to whole blocks
  TORCH_CHECK(Kx <= K && K - Kx < QK, op, ": x has ", Kx, " columns, the weights ", K);
  TORCH_CHECK(packed.numel() > 0, op, ": no weights");
  TORCH_CHECK(N > (tiles - 1) * TILE && N <= tiles * TILE, op, ": N does not fit the tiles");
  const float* bptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                op, ": bias must be N contiguous float32");
    bptr = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({M, nb}, x.options());
  at::Tensor sums = at::empty({M, nb, 8}, x.options().dtype(at::kShort));
  at::Tensor sums16 = at::empty({M, nb, 16}, x.options().dtype(at::kInt));
  std::vector<uint8_t> bad(M, 0);
  quantize_rows(x.data_ptr<float>(), M, Kx, K, q.data_ptr<int8_t>(), scale.data_ptr<float>(),
                sums.data_ptr<int16_t>(), sums16.data_ptr<int32_t>(), bad.data());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const Quantized xq{q.data_ptr<int8_t>(), scale.data_ptr<float>(), sums.data_ptr<int16_t>(),
                     sums16.data_ptr<int32_t>(),
                     reinterpret_cast<const char*>(wp + packed.numel())};
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float out[MAX_ROWS * TILE];
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* tile = wp + t * nb * blob;
      const int64_t n0 = t * TILE, width = std::min(TILE, N - n0);
      for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS) {
        const int64_t rows = std::min(MAX_ROWS, M - r0);
        if (reference) {
          if (SIX) {
            tile6_scalar(tile, nb, xq, K, r0, rows, out);
          } else {
            tile_scalar(tile, nb, xq, K, r0, rows, out);
          }
        } else {
          tile_rows<SIX>(tile, nb, xq, K, r0, rows, out);
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* yr = yp + (r0 + r) * N + n0;
          for (int64_t c = 0; c < width; ++c) {
            yr[c] = bptr ? out[r * TILE + c] + bptr[n0 + c] : out[r * TILE + c];
          }
        }
      }
    }
  });
  for (int64_t r = 0; r < M; ++r) {
    if (bad[r]) std::fill(yp + r * N, yp + (r + 1) * N, std::numeric_limits<float>::quiet_NaN());
  }
  return y;
}

at::Tensor q4k(const at::Tensor& x, const at::Tensor& packed, int64_t N,
               const c10::optional<at::Tensor>& bias) {
  return run<false>(x, packed, N, bias, false);
}

at::Tensor q4k_reference(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const c10::optional<at::Tensor>& bias) {
  return run<false>(x, packed, N, bias, true);
}

at::Tensor q6k(const at::Tensor& x, const at::Tensor& packed, int64_t N,
               const c10::optional<at::Tensor>& bias) {
  return run<true>(x, packed, N, bias, false);
}

at::Tensor q6k_reference(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const c10::optional<at::Tensor>& bias) {
  return run<true>(x, packed, N, bias, true);
}

bool simd() { return SPECDEC_KQUANT_SIMD; }

}  // namespace

TORCH_LIBRARY(specdec_kquant, m) {
  m.def("q4k(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
  m.def("q4k_reference(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
  m.def("q6k(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
  m.def("q6k_reference(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
  m.def("simd() -> bool", &simd);
}

TORCH_LIBRARY_IMPL(specdec_kquant, CPU, m) {
  m.impl("q4k", &q4k);
  m.impl("q4k_reference", &q4k_reference);
  m.impl("q6k", &q6k);
  m.impl("q6k_reference", &q6k_reference);
}
