// group_linear with activations rounded to int8 (included by cpu_ops.cpp; the engine's
// quantization "int8-activations"): llama.cpp's arithmetic on the checkpoint's own Q4_1 and Q8_0
// groups. Each row of x is rounded per group of 32 to int8 with one fp32 scale (x ~ dx * xq,
// dx = max|x| / 127, as llama.cpp's Q8_0 rounds it); each group's sum(q * xq) is taken on the
// integer units (VNNI where the host has it) and scaled by d * dx in fp32; Q4_1's minimums
// multiply the rounded group's sum, dx * sum(xq), so a product is the checkpoint's exact weights
// times the rounded x (with x's exact sum there, the error of the uncentred q * xq would not
// cancel: 2-3x larger). Lossy against the fp32 product (the perplexity cost is in
// docs/benchmarks.md); a group of 32 weights takes a few instructions instead of the fp32 kernel's
// ~16. More rows of x go through the fp32 kernels as `rounded(x)`: the same products in another
// order. A row's product is thus the same alone as in a batch up to fp32 rounding, but rounding x
// to int8 can turn such a difference into one int8 step of a later layer's input, so greedy tokens
// may part between a request decoded alone and in a batch (llama.cpp's do too).
#pragma once

namespace int8x {

// x [M, K] rounded: q [M, K] int8, scale [M, K/32] (dx), sums [M, K/32] (dx * sum(xq)).
struct RoundedRows {
  std::vector<int8_t> q;
  std::vector<float> scale, sums;
};

// One group of 32 values rounded to q (as llama.cpp's Q8_0 rounds: to nearest); returns dx. A group
// with a NaN or an infinity gets dx = NaN (and q = 0), so that the products say so, as fp32's do.
inline float round_group(const float* x, int8_t* q) {
  float largest = 0.0f;
  bool finite = true;  // an and, not a sum: it vectorizes without reordering float additions
  for (int64_t i = 0; i < kGroup; ++i) {
    largest = std::max(largest, std::fabs(x[i]));
    finite &= std::fabs(x[i]) <= std::numeric_limits<float>::max();
  }
  if (!finite) {
    std::fill(q, q + kGroup, 0);
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float scale = largest / 127.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
  for (int64_t i = 0; i < kGroup; ++i) q[i] = static_cast<int8_t>(std::rint(x[i] * inverse));
  return scale;
}

inline RoundedRows round_rows(const float* x, int64_t M, int64_t K) {
  const int64_t groups = K / kGroup;
  RoundedRows rows{std::vector<int8_t>(M * K), std::vector<float>(M * groups), std::vector<float>(M * groups)};
  for (int64_t g = 0; g < M * groups; ++g) {
    int8_t* q = rows.q.data() + g * kGroup;
    rows.scale[g] = round_group(x + g * kGroup, q);
    int32_t sum = 0;
    for (int64_t i = 0; i < kGroup; ++i) sum += q[i];
    rows.sums[g] = rows.scale[g] * static_cast<float>(sum);
  }
  return rows;
}

#if defined(__AVX2__)
// Eight int32 lanes that add up to sum(u * s) over 32 byte pairs: u unsigned (< 128), s signed.
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));  // |pair sums| <= 32,258
#endif
}

// One group's sum(q * xq) in eight lanes. Q4_1: byte j holds weights j and j + 16.
inline __m256i group_dot_q4(const uint8_t* q, const int8_t* xq) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m256i weights = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
  return dot_u8_s8(weights, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
}

// Q8_0: both signed, so |w| times xq with w's sign (w is never -128).
inline __m256i group_dot_q8(const int8_t* q, const int8_t* xq) {
  const __m256i weights = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  return dot_u8_s8(_mm256_sign_epi8(weights, weights), _mm256_sign_epi8(x, weights));
}

inline v8f group_dot(const GroupedWeight& w, int64_t group, const int8_t* xq) {
  const __m256i dots = w.q4 ? group_dot_q4(w.q + group * (kGroup / 2), xq)
                            : group_dot_q8(reinterpret_cast<const int8_t*>(w.q) + group * kGroup, xq);
  return (v8f)_mm256_cvtepi32_ps(dots);
}
#else
inline v8f group_dot(const GroupedWeight& w, int64_t group, const int8_t* xq) {
  int32_t sum = 0;
  if (w.q4) {
    const uint8_t* q = w.q + group * (kGroup / 2);
    for (int64_t i = 0; i < kGroup / 2; ++i) sum += (q[i] & 0xF) * xq[i] + (q[i] >> 4) * xq[i + kGroup / 2];
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(w.q) + group * kGroup;
    for (int64_t i = 0; i < kGroup; ++i) sum += q[i] * xq[i];
  }
  return v8f{static_cast<float>(sum), 0, 0, 0, 0, 0, 0, 0};
}
#endif

// 8 fp16 values as floats (F16C converts them in one instruction).
inline v8f load8_halves(const at::Half* p) {
#if defined(__F16C__)
  return (v8f)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  v8f out;
  for (int i = 0; i < 8; ++i) out[i] = static_cast<float>(p[i]);
  return out;
#endif
}

// Row n of W times one rounded row of x. Per 8 groups the scales d * dx and the minimums' terms
// are taken 8 at a time, so that a group costs its integer dot product, one conversion and one FMA.
inline float dot_row(const GroupedWeight& w, int64_t n, const int8_t* xq, const float* scale, const float* sums) {
  const int64_t groups = w.K / kGroup, first = n * groups;
  v8f acc = {}, mins = {};
  float tail_mins = 0.0f;
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    float scales[8];
    store8(scales, load8_halves(w.d + first + g) * load8(scale + g));
    if (w.q4) mins += load8_halves(w.m + first + g) * load8(sums + g);
    for (int j = 0; j < 8; ++j) acc += group_dot(w, first + g + j, xq + (g + j) * kGroup) * splat(scales[j]);
  }
  for (; g < groups; ++g) {
    acc += group_dot(w, first + g, xq + g * kGroup) * splat(half_to_float(w.d[first + g]) * scale[g]);
    if (w.q4) tail_mins += half_to_float(w.m[first + g]) * sums[g];
  }
  return hsum(acc) + hsum(mins) + tail_mins;
}

// out [M, N] = x [M, K] . W^T, x rounded to int8 first, for a few rows of x (each row of W is
// read once and multiplied by every row while it sits in L1). From three rows on, the fp32 kernels
// multiplying `rounded(x)` were as fast or faster on the default model's shapes (AMX host,
// docs/benchmarks.md): they compute the same products, W . x-rounded, in another order.
constexpr int64_t kIntegerRows = 2;

inline void group_linear(const GroupedWeight& w, const float* x, int64_t M, int64_t N, float* out) {
  const int64_t K = w.K, groups = K / kGroup;
  const RoundedRows rows = round_rows(x, M, K);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t t = 0; t < M; ++t)
        out[t * N + n] = dot_row(w, n, rows.q.data() + t * K, rows.scale.data() + t * groups, rows.sums.data() + t * groups);
  });
}

// x rounded as round_rows rounds it, back in fp32: dx * xq.
inline torch::Tensor rounded(const torch::Tensor& x) {
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.numel() / kGroup, 256, [&](int64_t begin, int64_t end) {
    int8_t q[kGroup];
    for (int64_t g = begin; g < end; ++g) {
      const float scale = round_group(xp + g * kGroup, q);
      for (int64_t i = 0; i < kGroup; ++i) op[g * kGroup + i] = scale * static_cast<float>(q[i]);
    }
  });
  return out;
}

}  // namespace int8x
