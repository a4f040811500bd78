// The seeded race (specdec/model/step/seeded.py): each token v of a position draws
// u_v = hash(key, v), a function of the request's seed, the position and v alone, and the
// token with the largest log(u_v) / p_v wins, an exact draw from p (Efraimidis-Spirakis:
// -log u_v is Exp(1), and the smallest Exp(1) / p_v falls on v with probability p_v).
//
// ::race_pick runs the race over a whole row of probabilities (the target's choice);
// ::race_pick_among over a row's candidate ids (the draft's guess among its top m, which
// draws the very same u_v as the target for the same id). Tokens of zero probability never
// run; a row with none positive (NaN) answers -1. Rows split among threads, never a row, and
// ties go to the lowest id, so a row's answer is the same whatever shares its batch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

constexpr uint64_t GOLDEN = 0x9E3779B97F4A7C15ull;

// splitmix64's finaliser: every bit of the input moves every bit of the output.
inline uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

// u in (0, 1): the hash's top 24 bits, centred in their step (never 0, never 1).
inline float uniform(uint64_t key, int64_t id) {
  const uint64_t x = mix(key + static_cast<uint64_t>(id + 1) * GOLDEN);
  return (static_cast<float>(x >> 40) + 0.5f) * 5.9604644775390625e-08f;  // 2^-24
}

void check_rows(const at::Tensor& probs, const at::Tensor& keys) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.is_contiguous(),
              "probs must be a contiguous float32 [rows, width] tensor");
  TORCH_CHECK(keys.dim() == 1 && keys.scalar_type() == at::kLong && keys.is_contiguous() &&
                  keys.size(0) == probs.size(0),
              "keys must be int64 [rows]");
}

// The race over ids[n, :] (nullptr: 0..width-1) with probabilities p[n, :].
at::Tensor race(const at::Tensor& probs, const at::Tensor& keys, const int64_t* ids) {
  const int64_t rows = probs.size(0), width = probs.size(1);
  const float* p = probs.data_ptr<float>();
  const int64_t* k = keys.data_ptr<int64_t>();
  at::Tensor out = at::empty({rows}, probs.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* row = p + n * width;
      const uint64_t key = static_cast<uint64_t>(k[n]);
      float best = -INFINITY;
      int64_t arg = -1;
      for (int64_t v = 0; v < width; ++v) {
        const float pv = row[v];
        if (!(pv > 0.f)) continue;  // no chance (or NaN): it does not run
        const int64_t id = ids == nullptr ? v : ids[n * width + v];
        const float u = uniform(key, id);
        // log(u) <= u - 1, so the score is at most -(1 - u) / p: a token whose bound is
        // clearly below the best so far cannot win, and skips the log (most of a
        // vocabulary, once a likely token has run). The margin covers rounding: a skipped
        // token's exact score is below the best by more than log's error.
        if (arg >= 0 && (1.f - u) >= -best * pv * 1.001f) continue;
        const float score = std::log(u) / pv;
        if (arg < 0 || score > best) {
          best = score;
          arg = v;
        }
      }
      o[n] = arg;
    }
  });
  return out;
}

at::Tensor race_pick(const at::Tensor& probs, const at::Tensor& keys) {
  check_rows(probs, keys);
  return race(probs, keys, nullptr);
}

at::Tensor race_pick_among(const at::Tensor& ids, const at::Tensor& probs,
                           const at::Tensor& keys) {
  check_rows(probs, keys);
  TORCH_CHECK(ids.sizes() == probs.sizes() && ids.scalar_type() == at::kLong &&
                  ids.is_contiguous(),
              "ids must be a contiguous int64 tensor shaped like probs");
  return race(probs, keys, ids.data_ptr<int64_t>());
}

// The u of each (key, id): what the Python fallbacks are checked against.
at::Tensor race_uniforms(const at::Tensor& keys, const at::Tensor& ids) {
  TORCH_CHECK(keys.dim() == 1 && keys.scalar_type() == at::kLong, "keys must be int64 [rows]");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "ids must be int64 [width]");
  const int64_t rows = keys.size(0), width = ids.size(0);
  at::Tensor out = at::empty({rows, width}, keys.options().dtype(at::kFloat));
  const int64_t* k = keys.data_ptr<int64_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t v = 0; v < width; ++v)
      o[n * width + v] = uniform(static_cast<uint64_t>(k[n]), id[v]);
  return out;
}

}  // namespace

TORCH_LIBRARY(specdec_race, m) {
  m.def("race_pick(Tensor probs, Tensor keys) -> Tensor");
  m.def("race_pick_among(Tensor ids, Tensor probs, Tensor keys) -> Tensor");
  m.def("race_uniforms(Tensor keys, Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec_race, CPU, m) {
  m.impl("race_pick", &race_pick);
  m.impl("race_pick_among", &race_pick_among);
  m.impl("race_uniforms", &race_uniforms);
}
