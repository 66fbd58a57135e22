// group_linear with activations rounded to int8 (included by cpu_ops.cpp; the engine's
// quantization "int8-activations"): llama.cpp's arithmetic on the checkpoint's own Q4_1 and Q8_0
// groups. Each row of x is rounded per group of 32 to int8 with one fp32 scale (x ~ dx * xq,
// dx = max|x| / 127, as llama.cpp's Q8_0 rounds it); each group's sum(q * xq) is taken on the
// integer units (VNNI where the host has it) and scaled by d * dx in fp32; Q4_1's minimums
// multiply the rounded group's sum, dx * sum(xq), so a product is the checkpoint's exact weights
// times the rounded x (with x's exact sum there, the error of the uncentred q * xq would not
// cancel: 2-3x larger). Lossy against the fp32 product (the perplexity cost is in
// docs/benchmarks.md); a group of 32 weights takes a few instructions instead of the fp32 kernel's
// ~16. One or two rows of x go a row of W at a time; more take W's tiles of 16 rows where the host
// has 512-bit VNNI, else the fp32 kernels multiply `rounded(x)`: the same products in another
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
  at::parallel_for(0, M * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      int8_t* q = rows.q.data() + g * kGroup;
      rows.scale[g] = round_group(x + g * kGroup, q);
      int32_t sum = 0;
      for (int64_t i = 0; i < kGroup; ++i) sum += q[i];
      rows.sums[g] = rows.scale[g] * static_cast<float>(sum);
    }
  });
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

// Rows [n_begin, n_end) of out [M, N] = x-rounded . W^T, one row of W at a time (each row of W is
// read once and multiplied by every row of x while it sits in L1).
inline void rows_of_w(const GroupedWeight& w, const RoundedRows& rows, int64_t M, int64_t N, int64_t n_begin,
                      int64_t n_end, float* out) {
  const int64_t K = w.K, groups = K / kGroup;
  at::parallel_for(n_begin, n_end, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t t = 0; t < M; ++t)
        out[t * N + n] = dot_row(w, n, rows.q.data() + t * K, rows.scale.data() + t * groups, rows.sums.data() + t * groups);
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Three rows of x or more, with 512-bit VNNI: W is taken sixteen rows at a time (a tile), and each
// group of a tile is unpacked once per call into the order VPDPBUSD wants -- register k of the group
// holds weights 4k..4k+3 of the tile's 16 rows, row i in lane i -- then multiplied by every row of x
// while it sits in L1. A group of 32 weights times one row of x is half a VPDPBUSD and its share of
// one conversion and two FMAs, against 32 fp32 FMAs. VPDPBUSD multiplies unsigned by signed bytes:
// Q4_1's q is the unsigned side; Q8_0's signed q takes x as xq + 128 and starts each group's sum at
// -128 * sum(q), so the integer sum is exact before it is scaled.
constexpr bool kTiledIntegers = true;
constexpr int64_t kTile = 16;
constexpr int kRowsPerPass = 8;  // rows of x whose fp32 sums stay in registers across the groups

struct UnpackedTile {
  explicit UnpackedTile(int64_t groups) : weights(groups * 8), scales(groups), mins(groups), offsets(groups) {}
  std::vector<__m512i> weights;  // [group][k]
  std::vector<__m512> scales;    // d of the tile's rows
  std::vector<__m512> mins;      // Q4_1's m
  std::vector<__m512i> offsets;  // Q8_0's -128 * sum(q)
};

// The 16-byte pieces at p + row * stride of the 16 rows, transposed: out[d] holds dword d of each
// row, row i in lane i. Register r is loaded with rows r, r + 4, r + 8, r + 12 in its four 128-bit
// lanes; a 4 x 4 transpose of dwords within each lane then puts row 4L + j at lane L's element j.
inline void load_transposed(const uint8_t* p, int64_t stride, __m512i out[4]) {
  __m512i a[4];
  for (int r = 0; r < 4; ++r) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + r * stride)));
    for (int lane = 1; lane < 4; ++lane) {
      const __m128i piece = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (r + 4 * lane) * stride));
      switch (lane) {
        case 1: v = _mm512_inserti32x4(v, piece, 1); break;
        case 2: v = _mm512_inserti32x4(v, piece, 2); break;
        default: v = _mm512_inserti32x4(v, piece, 3); break;
      }
    }
    a[r] = v;
  }
  const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}

// The 16 rows' fp16 values at v + row * stride, as floats in lane order.
inline __m512 load_strided_halves(const at::Half* v, int64_t stride) {
  alignas(64) float values[kTile];
  for (int64_t i = 0; i < kTile; ++i) values[i] = half_to_float(v[i * stride]);
  return _mm512_load_ps(values);
}

inline void unpack_tile(const GroupedWeight& w, int64_t n0, UnpackedTile& tile) {
  const int64_t groups = w.K / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i* weights = tile.weights.data() + g * 8;
    tile.scales[g] = load_strided_halves(w.d + n0 * groups + g, groups);
    if (w.q4) {  // byte j of a group holds weights j (low nibble) and j + 16 (high)
      __m512i packed[4];
      load_transposed(w.q + (n0 * groups + g) * (kGroup / 2), groups * (kGroup / 2), packed);
      const __m512i nibble = _mm512_set1_epi8(0x0F);
      for (int k = 0; k < 4; ++k) {
        weights[k] = _mm512_and_si512(packed[k], nibble);
        weights[k + 4] = _mm512_and_si512(_mm512_srli_epi16(packed[k], 4), nibble);
      }
      tile.mins[g] = load_strided_halves(w.m + n0 * groups + g, groups);
    } else {
      const uint8_t* q = w.q + (n0 * groups + g) * kGroup;
      load_transposed(q, groups * kGroup, weights);
      load_transposed(q + kGroup / 2, groups * kGroup, weights + 4);
      __m512i sum = _mm512_setzero_si512();
      for (int k = 0; k < 8; ++k) sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), weights[k]);
      tile.offsets[g] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7));
    }
  }
}

// R rows of x (xq: Q4_1's int8 rows, Q8_0's rows + 128) times the tile: out[t * ldo + i], i < 16.
template <int R, bool Q4>
inline void tile_times_rows(const UnpackedTile& tile, int64_t groups, const uint8_t* xq, int64_t K,
                            const float* scale, const float* sums, float* out, int64_t ldo) {
  __m512 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m512i* weights = tile.weights.data() + g * 8;
    __m512i wk[8];
    for (int k = 0; k < 8; ++k) wk[k] = weights[k];
    for (int t = 0; t < R; ++t) {
      const uint8_t* x = xq + t * K + g * kGroup;
      __m512i dot = Q4 ? _mm512_setzero_si512() : tile.offsets[g];
      for (int k = 0; k < 8; ++k) {
        int32_t four;
        std::memcpy(&four, x + 4 * k, sizeof(four));
        dot = Q4 ? _mm512_dpbusd_epi32(dot, wk[k], _mm512_set1_epi32(four))
                 : _mm512_dpbusd_epi32(dot, _mm512_set1_epi32(four), wk[k]);
      }
      const __m512 scaled = _mm512_mul_ps(tile.scales[g], _mm512_set1_ps(scale[t * groups + g]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scaled, acc[t]);
      if (Q4) acc[t] = _mm512_fmadd_ps(tile.mins[g], _mm512_set1_ps(sums[t * groups + g]), acc[t]);
    }
  }
  for (int t = 0; t < R; ++t) _mm512_storeu_ps(out + t * ldo, acc[t]);
}

template <bool Q4>
inline void tile_times_all_rows(const UnpackedTile& tile, int64_t groups, const uint8_t* xq, int64_t M, int64_t K,
                                const RoundedRows& rows, float* out, int64_t ldo) {
  int64_t t = 0;
  auto pass = [&](auto rows_in_pass) {
    constexpr int R = decltype(rows_in_pass)::value;
    for (; t + R <= M; t += R)
      tile_times_rows<R, Q4>(tile, groups, xq + t * K, K, rows.scale.data() + t * groups, rows.sums.data() + t * groups,
                             out + t * ldo, ldo);
  };
  pass(std::integral_constant<int, kRowsPerPass>{});
  pass(std::integral_constant<int, 4>{});
  pass(std::integral_constant<int, 2>{});
  pass(std::integral_constant<int, 1>{});
}

inline void tiled_rows(const GroupedWeight& w, const RoundedRows& rows, int64_t M, int64_t N, float* out) {
  const int64_t K = w.K, groups = K / kGroup, tiles = N / kTile;
  std::vector<uint8_t> shifted;  // Q8_0's x as unsigned bytes: xq + 128
  if (!w.q4) {
    shifted.resize(rows.q.size());
    for (size_t i = 0; i < shifted.size(); ++i) shifted[i] = static_cast<uint8_t>(rows.q[i]) ^ 0x80;
  }
  const uint8_t* xq = w.q4 ? reinterpret_cast<const uint8_t*>(rows.q.data()) : shifted.data();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    UnpackedTile tile(groups);
    for (int64_t b = begin; b < end; ++b) {
      unpack_tile(w, b * kTile, tile);
      if (w.q4) {
        tile_times_all_rows<true>(tile, groups, xq, M, K, rows, out + b * kTile, N);
      } else {
        tile_times_all_rows<false>(tile, groups, xq, M, K, rows, out + b * kTile, N);
      }
    }
  });
  rows_of_w(w, rows, M, N, tiles * kTile, N, out);  // the rows past the last whole tile
}
#else
constexpr bool kTiledIntegers = false;
#endif

// out [M, N] = x [M, K] . W^T, x rounded to int8 first. One or two rows of x go a row of W at a
// time; more take the tiles where the host has 512-bit VNNI. Elsewhere, from three rows on the fp32
// kernels multiplying `rounded(x)` were as fast or faster on the default model's shapes (AMX host,
// docs/benchmarks.md): they compute the same products, W . x-rounded, in another order.
constexpr int64_t kIntegerRows = 2;

inline bool on_integers(int64_t M) { return M <= kIntegerRows || kTiledIntegers; }

inline void group_linear(const GroupedWeight& w, const float* x, int64_t M, int64_t N, float* out) {
  const RoundedRows rows = round_rows(x, M, w.K);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (M > kIntegerRows) return tiled_rows(w, rows, M, N, out);
#endif
  rows_of_w(w, rows, M, N, 0, N, out);
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
