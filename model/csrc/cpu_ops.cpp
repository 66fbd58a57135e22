// CPU kernels that torch does not have in the form Pagoda needs:
//
//  - group_linear: y = x W^T + b where W is stored in groups of 32 weights along the input
//    dimension, the way GGUF stores it: Q4_1 (4-bit q, w = d*q + m) or Q8_0 (8-bit q, w = d*q),
//    d and m in fp16. Each group is dequantized exactly as gguf-py does it (fp32 d*q, then + m)
//    and multiplied in fp32, so the result is the fp32 GEMM of the checkpoint's own dequantized
//    weights, up to summation order, while decode reads 5-6x fewer bytes. On AVX-512, from 16 rows
//    of x, the panel kernel sums in the blocked order of torch's fp32 GEMM. From dense_from rows of
//    x on (where the host's GEMM measured faster), the weight is dequantized chunk by chunk into a
//    reused buffer for torch's GEMM. On hosts with AMX, batches of 16 to 511 rows multiply on its
//    tiles instead (amx_group_linear.h).
//  - paged_attention: queries that each attend to the first `len` keys of one sequence's paged
//    KV cache, read block by block in place (no gather copy), GQA-aware (each key and value read
//    once for up to three query heads of its group), online softmax, fp32 or bf16 cache. Decode
//    rows and short prefill chunks over a long context go through it.
//
// Vectors are GCC vector extensions of 8 floats: AVX2 registers on x86, two NEON registers on Arm,
// so one source builds on every host; the build uses the host's own -march. The grouped weights'
// products take the widest the host has (vf: 16 floats with AVX-512, else 8).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i32 __attribute__((vector_size(32)));

// The grouped weights' products run kLinearLanes floats at a time: twice the arithmetic per instruction
// where AVX-512 gives 512-bit registers (on a 2-core AVX-512 host, with the tiles' changes below, Q4_1
// 576 -> 3,072 with the weight hot: one row 49 -> 37 us, 32 rows 726 -> 334 us; docs/benchmarks.md).
#if defined(__AVX512F__)
constexpr int kLinearLanes = 16;
#else
constexpr int kLinearLanes = 8;
#endif
typedef float vf __attribute__((vector_size(4 * kLinearLanes)));
typedef int32_t vi32 __attribute__((vector_size(4 * kLinearLanes)));

// kLinearLanes bytes -> kLinearLanes ints (each byte; a mask or shift then takes a nibble). GCC
// scalarizes the generic conversion of byte vectors, so x86 gets the instructions by name.
#if defined(__AVX512F__)
inline vi32 widen_lanes_u8(const uint8_t* p) {
  return (vi32)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vi32 widen_lanes_i8(const int8_t* p) {
  return (vi32)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#elif defined(__AVX2__)
inline vi32 widen_lanes_u8(const uint8_t* p) {
  return (vi32)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline vi32 widen_lanes_i8(const int8_t* p) {
  return (vi32)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
#else
template <typename Byte>
inline vi32 widen_lanes(const Byte* p) {
  typedef Byte bytes_t __attribute__((vector_size(kLinearLanes)));
  bytes_t bytes;
  std::memcpy(&bytes, p, sizeof(bytes));
  return __builtin_convertvector(bytes, vi32);
}
inline vi32 widen_lanes_u8(const uint8_t* p) { return widen_lanes(p); }
inline vi32 widen_lanes_i8(const int8_t* p) { return widen_lanes(p); }
#endif

inline vf lanes_to_floats(vi32 ints) { return __builtin_convertvector(ints, vf); }

inline vf load_lanes(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store_lanes(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// x in every lane: by name on x86, where GCC built a generic splat lane by lane (the one-row kernel
// 3x slower); the last form is for other targets.
#if defined(__AVX512F__)
inline vf splat_lanes(float x) { return (vf)_mm512_set1_ps(x); }
#elif defined(__AVX__)
inline vf splat_lanes(float x) { return (vf)_mm256_set1_ps(x); }
#else
inline vf splat_lanes(float x) { return vf{} + x; }
#endif

// The lanes of v added pairwise into 8 (v itself where it has 8).
inline v8f fold8(vf v) {
#if defined(__AVX512F__)
  const __m512 wide = (__m512)v;
  return (v8f)_mm256_add_ps(_mm512_castps512_ps256(wide),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wide), 1)));
#else
  return v;
#endif
}

// c10::Half's conversion is a function call of some twenty instructions: once per 32 weights it
// cost more than the weights' own arithmetic. F16C converts in one.
inline float half_to_float(at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

constexpr int64_t kGroup = 32;

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }

inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }

inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

inline float hsum_lanes(vf v) { return hsum(fold8(v)); }

inline float hmax(v8f v) {
  return std::max(std::max(std::max(v[0], v[4]), std::max(v[1], v[5])), std::max(std::max(v[2], v[6]), std::max(v[3], v[7])));
}

// The sums of a[0..4)'s 8 lanes each, into out[0..4).
inline void sum4(const v8f* a, float* out) {
#if defined(__AVX__)
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a[0], (__m256)a[1]), _mm256_hadd_ps((__m256)a[2], (__m256)a[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#else
  for (int j = 0; j < 4; ++j) out[j] = hsum(a[j]);
#endif
}

// On x86 with AVX the compiler sees v change here: it keeps v in a register (no memory operand in
// its place) and fuses no arithmetic across this point into one instruction (an FMA). x86 without
// AVX has no FMA to fuse.
inline void opaque(vf& v) {
#if defined(__x86_64__) && defined(__AVX__)
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

// Elsewhere (ARM's FMA), no contraction in the whole function instead: the attribute keeps it from
// being inlined, which on x86 cost a call and a vzeroupper every 32 weights.
#if defined(__x86_64__)
#define UNFUSED
#else
#define UNFUSED __attribute__((optimize("fp-contract=off")))
#endif

// One group of 32 weights into out[0..32). gguf-py rounds d*q, then adds m, and the fp32 checkpoint
// holds exactly those values: not one FMA.
UNFUSED inline void dequant_q4_1(const uint8_t* q, float d, float m, float* out) {
#if defined(__AVX512F__)
  // The group's 16 values d * q + m computed once, each weight looked up by its nibble (a permute
  // instead of a conversion, a product and a sum per 16 weights)
  vf table = vf{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} * splat_lanes(d);
  opaque(table);
  table += splat_lanes(m);
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  store_lanes(out, (vf)_mm512_permutexvar_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF)), (__m512)table));
  store_lanes(out + kGroup / 2, (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), (__m512)table));
#else
  const vf dv = splat_lanes(d), mv = splat_lanes(m);
  for (int h = 0; h < kGroup / 2; h += kLinearLanes) {  // byte h holds weights h (low nibble) and h + 16
    const vi32 bytes = widen_lanes_u8(q + h);
    vf low = lanes_to_floats(bytes & 0xF) * dv, high = lanes_to_floats(bytes >> 4) * dv;
    opaque(low);
    opaque(high);
    store_lanes(out + h, low + mv);
    store_lanes(out + kGroup / 2 + h, high + mv);
  }
#endif
}

inline void dequant_q8_0(const int8_t* q, float d, float* out) {
  const vf dv = splat_lanes(d);
  for (int i = 0; i < kGroup; i += kLinearLanes) store_lanes(out + i, lanes_to_floats(widen_lanes_i8(q + i)) * dv);
}

// A grouped weight as raw pointers: Q4_1 when q4 (m set), else Q8_0.
struct GroupedWeight {
  const uint8_t* q;
  const at::Half* d;
  const at::Half* m;
  int64_t K;
  bool q4;

  int64_t group_bytes() const { return q4 ? kGroup / 2 : kGroup; }
  // The same weight from row n on: its values, scales and minimums advanced to that row.
  GroupedWeight from_row(int64_t n) const {
    const int64_t first = n * (K / kGroup);
    return {q + first * group_bytes(), d + first, q4 ? m + first : m, K, q4};
  }
};

// n fp16 values into floats (n <= 16), 8 at a time where F16C converts them.
inline void halves_to_floats(const at::Half* h, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
  for (; i < n; ++i) out[i] = half_to_float(h[i]);
}

// Rows of W dequantized into a buffer (rows x K, row-major) a few groups at a time: all at once
// (dequant_rows), or spread through the products of the block before (the panel kernel).
class RowsDequantizer {
 public:
  RowsDequantizer() = default;  // nothing to dequantize
  RowsDequantizer(const GroupedWeight& w, int64_t n0, int64_t rows, float* out)
      // A local copy of w: through a reference, every store to out could have changed its fields
      : r_(w.from_row(n0)), out_(out), groups_(rows * (w.K / kGroup)) {}

  // The next n groups (fewer at the end).
  inline void step(int64_t n) {
    for (const int64_t end = std::min(groups_, done_ + n); done_ < end; ++done_) {
      const int64_t i = done_ % 16;
      if (i == 0) {  // 16 groups' scales (and minimums) converted at once, each then broadcast from here
        const int64_t count = std::min<int64_t>(16, groups_ - done_);
        halves_to_floats(r_.d + done_, count, d_);
        if (r_.q4) halves_to_floats(r_.m + done_, count, m_);
      }
      if (r_.q4) {
        dequant_q4_1(r_.q + done_ * (kGroup / 2), d_[i], m_[i], out_ + done_ * kGroup);
      } else {
        dequant_q8_0(reinterpret_cast<const int8_t*>(r_.q) + done_ * kGroup, d_[i], out_ + done_ * kGroup);
      }
    }
  }
  void finish() { step(groups_); }

 private:
  GroupedWeight r_{};
  float* out_ = nullptr;
  int64_t groups_ = 0, done_ = 0;
  float d_[16], m_[16];
};

// Rows [n0, n0 + rows) of W dequantized into buf (rows x K, row-major).
void dequant_rows(const GroupedWeight& w, int64_t n0, int64_t rows, float* buf) {
  RowsDequantizer(w, n0, rows, buf).finish();
}

inline void prefetch_lines(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b);
}

// Asks for rows [n0, n0 + rows) of W (their packed values and scales) ahead of their dequantizing:
// the products of a block take long enough to hide the next block's fetch from memory, which the
// hardware's prefetcher, seeing a few hundred bytes a microsecond, did not start in time.
inline void prefetch_rows(const GroupedWeight& w, int64_t n0, int64_t rows) {
  const GroupedWeight r = w.from_row(n0);
  const int64_t groups = rows * (r.K / kGroup);
  prefetch_lines(r.q, groups * r.group_bytes());
  prefetch_lines(r.d, groups * sizeof(at::Half));
  if (r.q4) prefetch_lines(r.m, groups * sizeof(at::Half));
}

// out[i][j] = x[i] . w[j] for MB rows of x and NB rows of w, accumulating kLinearLanes lanes across K.
template <int MB, int NB>
inline void micro_gemm(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo) {
  vf acc[MB][NB] = {};
  for (int64_t k = 0; k < K; k += kLinearLanes) {
    vf wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load_lanes(w + j * K + k);
    for (int i = 0; i < MB; ++i) {
      vf xv = load_lanes(x + i * ldx + k);
      opaque(xv);  // else GCC loads x again as the memory operand of each of its NB products, and the loads bound the loop
      for (int j = 0; j < NB; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MB; ++i) {
    if constexpr (NB == 4) {  // four sums at once: with K a few hundred, one at a time cost a quarter of the loop
      const v8f folded[4] = {fold8(acc[i][0]), fold8(acc[i][1]), fold8(acc[i][2]), fold8(acc[i][3])};
      sum4(folded, out + i * ldo);
    } else {
      for (int j = 0; j < NB; ++j) out[i * ldo + j] = hsum_lanes(acc[i][j]);
    }
  }
}

// Rows of x per register tile: with 4 rows of W, 2 x 4 accumulators + 4 weights + 1 input fit
// AVX2's 16 registers (a 4 x 4 tile spills; with AVX-512's 32 it measured no faster).
constexpr int kTokenTile = 2;

template <int NB>
void rows_times_block(const float* x, int64_t M, int64_t K, const float* w, float* out, int64_t ldo) {
  int64_t i = 0;
  for (; i + kTokenTile <= M; i += kTokenTile) micro_gemm<kTokenTile, NB>(x + i * K, K, w, K, out + i * ldo, ldo);
  for (; i < M; ++i) micro_gemm<1, NB>(x + i * K, K, w, K, out + i * ldo, ldo);
}

constexpr int64_t kRowBlock = 4;   // rows of W dequantized together
constexpr int64_t kTokenBlock = 64;  // rows of x that share one dequantization (kept in L2)

// For a few rows of x, dequantizing into a buffer costs more than the products: each group's
// sum(q * x) is taken on the integers as floats and scaled once, x . w = sum_g d_g * sum(q x) +
// m_g * sum(x) -- the same value as the dequantized product, summed in another order.
constexpr int64_t kFewTokens = 4;

// Row n of W times T rows of x (x[t] at x + t * K), reading the row's groups once for all T.
template <int T>
inline void dot_q4_1_rows(const GroupedWeight& w, int64_t n, const float* x, const float* group_sums, float* out,
                          int64_t ldo) {
  const int64_t groups = w.K / kGroup;
  vf acc[T] = {};
  float min_terms[T] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* q = w.q + (n * groups + g) * (kGroup / 2);
    vf partial[T] = {};
    for (int h = 0; h < kGroup / 2; h += kLinearLanes) {  // byte h holds weights h (low nibble) and h + 16
      const vi32 bytes = widen_lanes_u8(q + h);
      const vf low = lanes_to_floats(bytes & 0xF), high = lanes_to_floats(bytes >> 4);
      for (int t = 0; t < T; ++t) {
        const float* xs = x + t * w.K + g * kGroup;
        partial[t] += low * load_lanes(xs + h);
        partial[t] += high * load_lanes(xs + kGroup / 2 + h);
      }
    }
    const vf d = splat_lanes(half_to_float(w.d[n * groups + g]));
    const float m = half_to_float(w.m[n * groups + g]);
    for (int t = 0; t < T; ++t) {
      acc[t] += d * partial[t];
      min_terms[t] += m * group_sums[t * groups + g];
    }
  }
  for (int t = 0; t < T; ++t) out[t * ldo] = hsum_lanes(acc[t]) + min_terms[t];
}

template <int T>
inline void dot_q8_0_rows(const GroupedWeight& w, int64_t n, const float* x, float* out, int64_t ldo) {
  const int64_t groups = w.K / kGroup;
  vf acc[T] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* q = reinterpret_cast<const int8_t*>(w.q) + (n * groups + g) * kGroup;
    vf partial[T] = {};
    for (int i = 0; i < kGroup; i += kLinearLanes) {
      const vf weights = lanes_to_floats(widen_lanes_i8(q + i));
      for (int t = 0; t < T; ++t) partial[t] += weights * load_lanes(x + t * w.K + g * kGroup + i);
    }
    const vf d = splat_lanes(half_to_float(w.d[n * groups + g]));
    for (int t = 0; t < T; ++t) acc[t] += d * partial[t];
  }
  for (int t = 0; t < T; ++t) out[t * ldo] = hsum_lanes(acc[t]);
}

template <int T>
void few_tokens_linear(const GroupedWeight& w, const float* x, int64_t N, float* out) {
  const int64_t groups = w.K / kGroup;
  std::vector<float> group_sums(T * groups);  // sum(x) per group, for Q4_1's minimums
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int64_t i = 0; i < kGroup; ++i) sum += x[t * w.K + g * kGroup + i];
      group_sums[t * groups + g] = sum;
    }
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      if (w.q4) {
        dot_q4_1_rows<T>(w, n, x, group_sums.data(), out + n, N);
      } else {
        dot_q8_0_rows<T>(w, n, x, out + n, N);
      }
    }
  });
}

// The group kernel: 4 rows of W dequantized at a time, times blocks of up to 64 rows of x. One
// parallel region a call, each thread keeping its share of W's rows for every block of x: with a
// region per block of x (8 for a 512-row prefill chunk) each region's end waited for the slower
// thread, and a core lent to another process for a few ms held the whole call at every one.
void tiled_linear(const GroupedWeight& w, const float* xp, int64_t M, int64_t N, float* op) {
  const int64_t K = w.K;
  const int64_t num_row_blocks = (N + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, num_row_blocks, 1, [&](int64_t begin, int64_t end) {
    // Vectors, so the rows start on 64-byte lines: a 512-bit load across two lines costs two.
    std::vector<vf> vectors(kRowBlock * K / kLinearLanes);
    float* buf = reinterpret_cast<float*>(vectors.data());
    for (int64_t t0 = 0; t0 < M; t0 += kTokenBlock) {
      const int64_t tokens = std::min(kTokenBlock, M - t0);
      const float* xs = xp + t0 * K;
      for (int64_t b = begin; b < end; ++b) {
        const int64_t n0 = b * kRowBlock, rows = std::min(kRowBlock, N - n0);
        dequant_rows(w, n0, rows, buf);
        if (b + 1 < end) prefetch_rows(w, n0 + kRowBlock, std::min(kRowBlock, N - n0 - kRowBlock));
        float* o = op + t0 * N + n0;
        switch (rows) {
          case 4: rows_times_block<4>(xs, tokens, K, buf, o, N); break;
          case 3: rows_times_block<3>(xs, tokens, K, buf, o, N); break;
          case 2: rows_times_block<2>(xs, tokens, K, buf, o, N); break;
          default: rows_times_block<1>(xs, tokens, K, buf, o, N); break;
        }
      }
    }
  });
}

#if defined(__AVX512F__)
// The panel kernel, for 16 rows of x and more on AVX-512: x's rows transposed into panels of 16
// rows, each k-major (panel p holds x[16p + l][k] at [k][l]; rows past M are zeros), so that one
// load gives a lane to each of 16 rows of x and each weight of a dequantized block of W is
// broadcast to all of them. Against the tiles above (a weight vector times a row of x, summed across
// lanes at the end): no sums across lanes, and a load of x serves 12 rows of W.
constexpr int64_t kPanel = 16;        // rows of x a panel: a 512-bit vector's lanes
constexpr int64_t kPanelRows = 12;    // rows of W a block: 12 x 2 accumulators of 16 lanes in 32 registers
constexpr int64_t kPanelBlock = 16;   // panels of x (256 rows) multiplied by one dequantization of a block
// Each product is summed over k in chunks of 192, in order, one FMA a term, and the chunks' sums added
// in order: the blocked order of torch's fp32 GEMM on the AVX-512 host measured, whose products
// of the dequantized weight these equal bit for bit there (docs/benchmarks.md).
constexpr int64_t kPanelChunk = 192;

// The sums over k in [k0, k1) of x[m][k] * w[j][k] for the MV panels at `panels` and the kPanelRows
// rows of w, stored into sums[j][m] (rows of 2 panels' lanes) where k0 is 0, else added to them.
// Every 8 k, three groups of the next block are dequantized: 12 rows have 12 x K / 32 groups, so a
// block's pass over k dequantizes the next, on the ports the FMAs leave free and with its loads'
// misses hidden behind them (a separate pass cost ~16 % of a batch-32 step).
template <int MV>
inline void panel_gemm(const float* panels, int64_t K, const float* w, int64_t k0, int64_t k1, float* sums,
                       RowsDequantizer& next) {
  static_assert(kPanelRows * 8 == 3 * kGroup, "three groups every 8 k dequantize a block in one pass over k");
  vf acc[kPanelRows][MV] = {};
  for (int64_t k = k0; k < k1; ++k) {
    vf xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = load_lanes(panels + (v * K + k) * kPanel);
    for (int j = 0; j < kPanelRows; ++j) {
      const vf wj = splat_lanes(w[j * K + k]);
      for (int v = 0; v < MV; ++v) acc[j][v] += wj * xv[v];
    }
    if (k % 8 == 7) next.step(3);
  }
  for (int j = 0; j < kPanelRows; ++j)
    for (int v = 0; v < MV; ++v) {
      float* s = sums + (j * 2 + v) * kPanel;
      store_lanes(s, k0 == 0 ? acc[j][v] : load_lanes(s) + acc[j][v]);
    }
}

// The 16 x 16 floats at src (rows lds apart; rows from `rows` on read as zeros) transposed into
// dst (16 rows of 16): three rounds of shuffles in registers.
inline void transpose16(const float* src, int64_t lds, int64_t rows, float* dst) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = i < rows ? _mm512_loadu_ps(src + i * lds) : _mm512_setzero_ps();
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved by element
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // then by pairs of elements
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 16; i += 8)  // then by 128-bit quarters, twice
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * 16, r[i]);
}

// x [M, K] into ceil(M / 16) panels, split between threads.
void to_panels(const float* x, int64_t M, int64_t K, float* panels) {
  at::parallel_for(0, (M + kPanel - 1) / kPanel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t k = 0; k < K; k += kPanel)
        transpose16(x + p * kPanel * K + k, K, std::min(kPanel, M - p * kPanel), panels + (p * K + k) * kPanel);
  });
}

// Whether M rows of x take the panel kernel: from 16 rows, where at least 3/4 of its panels' lanes are
// rows of x (17 rows fill two panels: a third of the work on zeros, slower than the tiles).
bool on_panels(int64_t M) { return M >= kPanel && 4 * M >= 3 * kPanel * ((M + kPanel - 1) / kPanel); }

void panel_linear(const GroupedWeight& w, const float* xp, int64_t M, int64_t N, float* op) {
  const int64_t K = w.K, num_panels = (M + kPanel - 1) / kPanel;
  thread_local std::vector<vf> panel_vectors;  // kept for the next call: megabytes for a prefill chunk
  if ((int64_t)panel_vectors.size() < num_panels * K) panel_vectors.resize(num_panels * K);
  float* panels = reinterpret_cast<float*>(panel_vectors.data());
  to_panels(xp, M, K, panels);
  const auto block_rows = [&](int64_t b) { return std::min(kPanelRows, N - b * kPanelRows); };
  at::parallel_for(0, (N + kPanelRows - 1) / kPanelRows, 1, [&](int64_t begin, int64_t end) {
    // Two blocks: one multiplied while the next is dequantized. Zeros at first, then blocks' values:
    // a last block's rows past N are finite (their sums are not written).
    std::vector<vf> w_vectors(2 * kPanelRows * K / kPanel);
    float* const blocks[2] = {reinterpret_cast<float*>(w_vectors.data()),
                              reinterpret_cast<float*>(w_vectors.data()) + kPanelRows * K};
    std::vector<vf> sum_vectors(kPanelBlock / 2 * kPanelRows * 2);  // [pair of panels][kPanelRows][2 * kPanel]
    float* sums = reinterpret_cast<float*>(sum_vectors.data());
    for (int64_t p0 = 0; p0 < num_panels; p0 += kPanelBlock) {
      const int64_t p_end = std::min(num_panels, p0 + kPanelBlock);
      dequant_rows(w, begin * kPanelRows, block_rows(begin), blocks[0]);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t n0 = b * kPanelRows, rows = block_rows(b);
        const float* block = blocks[(b - begin) % 2];
        RowsDequantizer next;
        if (b + 1 < end) next = RowsDequantizer(w, n0 + kPanelRows, block_rows(b + 1), blocks[(b + 1 - begin) % 2]);
        for (int64_t k0 = 0; k0 < K; k0 += kPanelChunk)  // a chunk of each row of W stays in L1 for all panels
          for (int64_t p = p0; p < p_end; p += 2) {
            float* pair_sums = sums + (p - p0) / 2 * kPanelRows * 2 * kPanel;
            const int64_t k1 = std::min(K, k0 + kPanelChunk);
            if (p + 1 < p_end) {
              panel_gemm<2>(panels + p * K * kPanel, K, block, k0, k1, pair_sums, next);
            } else {
              panel_gemm<1>(panels + p * K * kPanel, K, block, k0, k1, pair_sums, next);
            }
          }
        next.finish();
        const __mmask16 columns = (1u << rows) - 1;
        for (int64_t p = p0; p < p_end; ++p) {  // sums[j][16 * (p % 2) + l] is out[16p + l][n0 + j]
          alignas(64) float rows_of_x[kPanel][kPanel];
          const float* panel_sums = sums + (p - p0) / 2 * kPanelRows * 2 * kPanel + (p - p0) % 2 * kPanel;
          transpose16(panel_sums, 2 * kPanel, kPanelRows, &rows_of_x[0][0]);
          for (int64_t m = 0; m < std::min(kPanel, M - p * kPanel); ++m)
            _mm512_mask_storeu_ps(op + (p * kPanel + m) * N + n0, columns, _mm512_load_ps(rows_of_x[m]));
        }
      }
    }
  });
}
#endif

// From this many rows of x on (a prefill chunk, a step with one), group_linear dequantizes the
// weight and calls torch's GEMM (MKL), where that is faster than the group kernel; which is, depends
// on the host: on a 2-core AVX2 host MKL won from 128 rows (275 vs 384 ms for the default model's
// 30 layers, weights cold), on a 2-core AMD host with AVX-512 the group kernel's 512-bit products
// were twice MKL's speed at 128 and 512 rows (docs/benchmarks.md). The engine measures it once at
// load (model/quantization.py: choose_dense_from) and sets it here; 128 until then. Below 128,
// decode batches keep the group kernel, which reads the packed weight once.
std::atomic<int64_t> dense_from{128};

void set_dense_from(int64_t rows) {
  TORCH_CHECK(rows >= 1, "dense_from must be at least 1 row");
  dense_from.store(rows);
}
// Floats of W dequantized per GEMM call: the chunk stays in the L3 cache from its writing to the
// GEMM's reading; a whole LM head (28M weights on the default model) would go out to memory.
constexpr int64_t kDenseChunk = 2 << 20;

// Rows [n0, n0 + rows) of W dequantized into out (rows x K, row-major), split between threads.
void dequant_rows_parallel(const GroupedWeight& w, int64_t n0, int64_t rows, float* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    dequant_rows(w, n0 + begin, end - begin, out + begin * w.K);
  });
}

// x W^T + b through torch's GEMM, W dequantized chunk by chunk into a buffer each thread keeps for
// its next call (a fresh allocation of megabytes is a fresh mmap whose pages fault in every time).
torch::Tensor dense_linear(const GroupedWeight& w, const torch::Tensor& x, int64_t N,
                           const c10::optional<torch::Tensor>& bias) {
  const int64_t chunk_rows = std::min(N, std::max<int64_t>(1, kDenseChunk / w.K));
  thread_local torch::Tensor buffer;
  if (!buffer.defined() || buffer.numel() < chunk_rows * w.K) buffer = torch::empty({chunk_rows * w.K}, torch::kFloat32);
  auto chunk = [&](int64_t n0, int64_t rows) {
    dequant_rows_parallel(w, n0, rows, buffer.data_ptr<float>());
    return buffer.narrow(0, 0, rows * w.K).view({rows, w.K});
  };
  if (chunk_rows == N) return at::linear(x, chunk(0, N), bias);
  auto out = torch::empty({x.size(0), N}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, N - n0);
    const auto part_bias = bias.has_value() ? c10::optional<torch::Tensor>(bias->narrow(0, n0, rows)) : c10::nullopt;
    out.narrow(1, n0, rows).copy_(at::linear(x, chunk(n0, rows), part_bias));
  }
  return out;
}

}  // namespace

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define PAGODA_AMX 1
#include "amx_group_linear.h"
#else
#define PAGODA_AMX 0
#endif
#include "int8_group_linear.h"

// Rows of x for which hosts with AMX take the tile kernel (amx_group_linear.h): below 16 a tile
// is mostly padding; from 512 (a long prefill chunk) MKL's fp32 GEMM of the dequantized weight
// was as fast on the default model's shapes (docs/benchmarks.md).
constexpr int64_t kAmxFrom = 16, kAmxBelow = 512;

// Whether group_linear multiplies M rows of x in panels here (unless AMX tiles or torch's GEMM take them).
bool panels_for(int64_t M) {
#if defined(__AVX512F__)
  return on_panels(M);
#else
  return false;
#endif
}

// Whether group_linear takes AMX tiles here (built with them, and the kernel lets this process use them).
bool amx_tiles() {
#if PAGODA_AMX
  return amx::available();
#else
  return false;
#endif
}

// Whether a product of M rows of x by N rows of W goes on the tiles.
bool on_tiles(int64_t M, int64_t N) {
#if PAGODA_AMX
  return M >= kAmxFrom && M < kAmxBelow && N % (2 * amx::kTile) == 0 && amx::available();
#else
  return false;
#endif
}

// x: [M, K] float32; qweight: [N, K/2] uint8 (Q4_1: byte j of a group holds weights j and j+16 in
// its low and high nibble) or [N, K] int8 (Q8_0); d, m: [N, K/32] float16 (m unused for Q8_0).
// int8_activations: x rounded to int8 per group of 32 first (int8_group_linear.h), at every M.
torch::Tensor group_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor d, torch::Tensor m,
                           c10::optional<torch::Tensor> bias, bool int8_activations) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  TORCH_CHECK(d.scalar_type() == torch::kFloat16 && d.is_contiguous(), "d must be contiguous float16");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = d.size(0);
  TORCH_CHECK(K % kGroup == 0 && d.size(1) == K / kGroup, "K must be a multiple of 32 matching d");
  TORCH_CHECK(qweight.is_contiguous(), "qweight must be contiguous");
  const bool q4 = qweight.scalar_type() == torch::kUInt8;
  TORCH_CHECK(q4 || qweight.scalar_type() == torch::kInt8, "qweight must be uint8 (Q4_1) or int8 (Q8_0)");
  if (q4) TORCH_CHECK(m.scalar_type() == torch::kFloat16 && m.sizes() == d.sizes(), "Q4_1 needs m like d");
  const GroupedWeight w{static_cast<const uint8_t*>(qweight.data_ptr()), d.data_ptr<at::Half>(),
                        q4 ? m.data_ptr<at::Half>() : nullptr, K, q4};
  const bool integers = int8_activations && int8x::on_integers(M);
  if (int8_activations && !integers) x = int8x::rounded(x);  // the fp32 kernels below multiply the rounded rows
  const bool tiles = !integers && on_tiles(M, N);
  if (!integers && !tiles && M >= dense_from.load()) return dense_linear(w, x, N, bias);
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (integers) {
    int8x::group_linear(w, xp, M, N, op);
  } else if (tiles) {
#if PAGODA_AMX
    auto group_sums = q4 ? torch::empty({M, K / kGroup}, x.options()) : torch::Tensor();
    amx::group_linear(w, xp, M, N, op, q4 ? group_sums.data_ptr<float>() : nullptr);
    if (q4) out.addmm_(group_sums, m.to(torch::kFloat32).t());  // Q4_1's minimums: sum(x) . m^T per group
#endif
  } else if (M <= kFewTokens) {
    switch (M) {
      case 0: break;
      case 1: few_tokens_linear<1>(w, xp, N, op); break;
      case 2: few_tokens_linear<2>(w, xp, N, op); break;
      case 3: few_tokens_linear<3>(w, xp, N, op); break;
      default: few_tokens_linear<4>(w, xp, N, op); break;
    }
#if defined(__AVX512F__)
  } else if (on_panels(M)) {
    panel_linear(w, xp, M, N, op);
#endif
  } else {
    tiled_linear(w, xp, M, N, op);
  }
  if (bias.has_value()) out += *bias;
  return out;
}

// The weight as float32 [N, K]: for checks and for callers that want the dense weight.
torch::Tensor group_dequantize(torch::Tensor qweight, torch::Tensor d, torch::Tensor m) {
  const int64_t N = d.size(0), K = d.size(1) * kGroup;
  const bool q4 = qweight.scalar_type() == torch::kUInt8;
  auto result = torch::empty({N, K}, torch::dtype(torch::kFloat32));
  const GroupedWeight w{static_cast<const uint8_t*>(qweight.data_ptr()), d.data_ptr<at::Half>(),
                        q4 ? m.data_ptr<at::Half>() : nullptr, K, q4};
  dequant_rows_parallel(w, 0, N, result.data_ptr<float>());
  return result;
}

namespace {

inline bool all_finite(const float* x) {
  for (int i = 0; i < kGroup; ++i) {
    if (!std::isfinite(x[i])) return false;
  }
  return true;
}

inline bool same_group(const float* a, const float* b) {
  for (int i = 0; i < kGroup; ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

// One group of 32 values as Q4_1 (q packed two to a byte: byte j holds weights j and j + 16) if
// they are exactly what those groups dequantize to. d = (max - min) / 15 and m = min in fp16, q by
// rounding to the nearest (ties to even, as torch.round); checked by the same dequantization the
// products use.
bool recover_q4_1(const float* x, uint8_t* q, at::Half* d_out, at::Half* m_out) {
  if (!all_finite(x)) return false;
  float low = x[0], high = x[0];
  for (int i = 0; i < kGroup; ++i) {
    low = std::min(low, x[i]);
    high = std::max(high, x[i]);
  }
  const at::Half d_half((high - low) / 15.0f), m_half(low);
  const float d = static_cast<float>(d_half), m = static_cast<float>(m_half);
  if (m != low || !std::isfinite(d)) return false;
  uint8_t nibbles[kGroup];
  for (int i = 0; i < kGroup; ++i) {
    const float level = d > 0 ? std::nearbyint((x[i] - low) / d) : 0.0f;
    nibbles[i] = static_cast<uint8_t>(std::min(15.0f, std::max(0.0f, level)));
  }
  for (int j = 0; j < kGroup / 2; ++j) q[j] = nibbles[j] | (nibbles[j + kGroup / 2] << 4);
  alignas(64) float back[kGroup];
  dequant_q4_1(q, d, m, back);
  if (!same_group(back, x)) return false;
  *d_out = d_half;
  *m_out = m_half;
  return true;
}

// The same as Q8_0: d = max |x| / 127 in fp16, q in -127..127.
bool recover_q8_0(const float* x, int8_t* q, at::Half* d_out) {
  if (!all_finite(x)) return false;
  float largest = 0;
  for (int i = 0; i < kGroup; ++i) largest = std::max(largest, std::fabs(x[i]));
  const at::Half d_half(largest / 127.0f);
  const float d = static_cast<float>(d_half);
  if (!std::isfinite(d)) return false;
  for (int i = 0; i < kGroup; ++i) {
    const float level = d > 0 ? std::nearbyint(x[i] / d) : 0.0f;
    q[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, level)));
  }
  alignas(64) float back[kGroup];
  dequant_q8_0(q, d, back);
  if (!same_group(back, x)) return false;
  *d_out = d_half;
  return true;
}

// Every group of the [N, K] weight through recover(group index, values); false once one fails.
template <typename Recover>
bool recover_all_groups(const float* x, int64_t groups, Recover recover) {
  std::atomic<bool> ok{true};
  at::parallel_for(0, groups, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end && ok.load(std::memory_order_relaxed); ++g) {
      if (!recover(g, x + g * kGroup)) ok.store(false, std::memory_order_relaxed);
    }
  });
  return ok.load();
}

}  // namespace

// A float32 weight [N, K] (K a multiple of 32) as GGUF groups when every value is exactly what they
// dequantize to (a checkpoint dequantized from such a GGUF): [qweight, d, m] for Q4_1, [qweight, d]
// for Q8_0 (tried where Q4_1 does not hold), none where neither does. One pass over the weight,
// where torch's ops took ten (~1.7 s of CPU for the default model's every load).
std::vector<torch::Tensor> group_recover(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.is_contiguous(),
              "group_recover takes a contiguous float32 matrix");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % kGroup == 0, "group_recover needs input features divisible by 32, got ", K);
  const int64_t groups = N * (K / kGroup);
  const float* x = weight.data_ptr<float>();
  auto d = torch::empty({N, K / kGroup}, torch::kFloat16);
  at::Half* d_ptr = d.data_ptr<at::Half>();

  auto q4 = torch::empty({N, K / 2}, torch::kUInt8);
  auto m = torch::empty({N, K / kGroup}, torch::kFloat16);
  uint8_t* q4_ptr = q4.data_ptr<uint8_t>();
  at::Half* m_ptr = m.data_ptr<at::Half>();
  if (recover_all_groups(x, groups, [&](int64_t g, const float* values) {
        return recover_q4_1(values, q4_ptr + g * (kGroup / 2), d_ptr + g, m_ptr + g);
      })) {
    return {q4, d, m};
  }
  auto q8 = torch::empty({N, K}, torch::kInt8);
  int8_t* q8_ptr = q8.data_ptr<int8_t>();
  if (recover_all_groups(x, groups, [&](int64_t g, const float* values) {
        return recover_q8_0(values, q8_ptr + g * kGroup, d_ptr + g);
      })) {
    return {q8, d};
  }
  return {};
}

namespace {

template <typename T>
inline v8f load_kv8(const T* p);

template <>
inline v8f load_kv8<float>(const float* p) { return load8(p); }

template <>
inline v8f load_kv8<at::BFloat16>(const at::BFloat16* p) {
#if defined(__AVX2__)
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (v8f)_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#else
  typedef uint16_t v8u16 __attribute__((vector_size(16)));
  typedef uint32_t v8u32 __attribute__((vector_size(32)));
  v8u16 bits;
  std::memcpy(&bits, p, sizeof(bits));
  v8u32 wide = __builtin_convertvector(bits, v8u32) << 16;
  v8f out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
#endif
}

// e^x of 8 values x <= 0 (Cephes' expf: range reduction by ln 2, a degree-5 polynomial; ~1 ulp).
inline v8f exp8(v8f x) {
  const v8f lowest = splat(-87.3f);
  x = x < lowest ? lowest : x;
  const v8f fx = x * splat(1.44269504088896341f) + splat(0.5f);
  v8i32 n = __builtin_convertvector(fx, v8i32);  // truncation; a floor for the negative ones below
  v8f nf = __builtin_convertvector(n, v8f);
  const v8i32 too_big = nf > fx;  // -1 where truncation rounded up
  n += too_big;
  nf += __builtin_convertvector(too_big, v8f);
  x = x - nf * splat(0.693359375f) - nf * splat(-2.12194440e-4f);
  v8f y = splat(1.9875691500e-4f);
  y = y * x + splat(1.3981999507e-3f);
  y = y * x + splat(8.3334519073e-3f);
  y = y * x + splat(4.1665795894e-2f);
  y = y * x + splat(1.6666665459e-1f);
  y = y * x + splat(5.0000001201e-1f);
  y = y * (x * x) + x + splat(1.0f);
  const v8i32 bits = (n + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

constexpr int64_t kPrefetchBlocks = 2;  // how far ahead attend() fetches a sequence's blocks

// Fetches one block's K and V, a few cache lines per step() between the arithmetic: all at once,
// the requests fill the core's miss buffers and the loads behind them wait (a quarter of the
// kernel's time with the data already in L2).
struct BlockPrefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t next = 0, end = 0;
  template <typename T>
  void start(const T* k_cache, const T* v_cache, int64_t offset, int64_t count) {
    k = reinterpret_cast<const char*>(k_cache + offset);
    v = reinterpret_cast<const char*>(v_cache + offset);
    next = 0;
    end = count * static_cast<int64_t>(sizeof(T));
  }
  void stop() { next = end = 0; }
  inline void step(int64_t lines) {
    for (int64_t i = 0; i < lines && next < end; ++i, next += 64) {
      __builtin_prefetch(k + next);
      __builtin_prefetch(v + next);
    }
  }
};

// Up to kMaxHeads query heads at once; kKeyStep keys per step of the score loop (kMaxHeads *
// kKeyStep accumulators and the keys) and kValueLanes lanes per pass of the value loop (kMaxHeads *
// kValueLanes accumulators, the weights and a value) in the vector registers: 16 with AVX2, 32
// with AVX-512, where a head dim of 64 takes one pass.
constexpr int kMaxHeads = 3;
#if defined(__AVX512F__)
constexpr int kKeyStep = 8, kValueLanes = 8;
#else
constexpr int kKeyStep = 4, kValueLanes = 4;
#endif

// G query heads of one KV head group against `len` keys, online softmax; D = 8 * lanes, at most
// 256. Each key and value is read once for all G heads. kLanes > 0 fixes lanes at compile time
// (the common head dims). scores: G * block_size floats.
template <typename T, int kLanes, int G>
void attend(const float* q, int64_t D, const T* k_cache, const T* v_cache, int64_t block_stride, int64_t head_offset,
            const int64_t* table, int64_t block_size, int64_t len, float scale, float* scores, float* out) {
  constexpr int64_t kMaxDim = 256;
  const int64_t lanes = kLanes > 0 ? kLanes : D / 8;
  if (kLanes > 0) D = 8 * kLanes;
  v8f qv[G][kMaxDim / 8], acc[G][kMaxDim / 8];
  v8f denom8[G];  // the softmax's denominator over the blocks' runs of 8 keys,
  float running_max[G], denom[G];  // and over the keys after them
  for (int g = 0; g < G; ++g) {
    running_max[g] = -std::numeric_limits<float>::infinity();
    denom[g] = 0.0f;
    denom8[g] = v8f{};
    for (int64_t l = 0; l < lanes; ++l) {
      qv[g][l] = load8(q + g * D + 8 * l) * splat(scale);
      acc[g][l] = v8f{};
    }
  }
  // The block kPrefetchBlocks ahead is fetched while this one is taken: lines of K and of V per
  // step of the score and value loops, so that all of it is asked for within the block's steps.
  BlockPrefetch spread;
  const int64_t block_lines = (block_size * D * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  const int64_t steps = block_size / kKeyStep * lanes + block_size * ((lanes + kValueLanes - 1) / kValueLanes);
  const int64_t lines_per_step = (block_lines + steps - 1) / steps;
  for (int64_t start = 0; start < len; start += block_size) {
    const int64_t index = start / block_size, block = table[index], valid = std::min(block_size, len - start);
    const T* kb = k_cache + block * block_stride + head_offset;
    const T* vb = v_cache + block * block_stride + head_offset;
    // Blocks lie anywhere in the cache, so the hardware cannot guess the next ones: fetch ahead.
    if (start == 0)  // the first blocks at once: there is no work yet to spread them over
      for (int64_t ahead = 0; ahead < kPrefetchBlocks && ahead * block_size < len; ++ahead) {
        spread.start(k_cache, v_cache, table[ahead] * block_stride + head_offset, block_size * D);
        spread.step(block_lines);
      }
    if (start + kPrefetchBlocks * block_size < len)
      spread.start(k_cache, v_cache, table[index + kPrefetchBlocks] * block_stride + head_offset, block_size * D);
    else
      spread.stop();
    int64_t t = 0;
    for (; t + kKeyStep <= valid; t += kKeyStep) {
      v8f part[G][kKeyStep] = {};
      for (int64_t l = 0; l < lanes; ++l) {
        spread.step(lines_per_step);
        v8f k[kKeyStep];
        for (int j = 0; j < kKeyStep; ++j) k[j] = load_kv8(kb + (t + j) * D + 8 * l);
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < kKeyStep; ++j) part[g][j] += qv[g][l] * k[j];
      }
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < kKeyStep; j += 4) sum4(part[g] + j, scores + g * block_size + t + j);
    }
    for (; t < valid; ++t) {
      v8f part[G] = {};
      for (int64_t l = 0; l < lanes; ++l) {
        const v8f k = load_kv8(kb + t * D + 8 * l);
        for (int g = 0; g < G; ++g) part[g] += qv[g][l] * k;
      }
      for (int g = 0; g < G; ++g) scores[g * block_size + t] = hsum(part[g]);
    }
    for (int g = 0; g < G; ++g) {
      float* row = scores + g * block_size;
      v8f block_max8 = splat(-std::numeric_limits<float>::infinity());
      for (t = 0; t + 8 <= valid; t += 8) {
        const v8f s = load8(row + t);
        block_max8 = s > block_max8 ? s : block_max8;
      }
      float block_max = hmax(block_max8);
      for (; t < valid; ++t) block_max = std::max(block_max, row[t]);
      // Rescaled only when the maximum grows: after the first blocks it mostly does not, and a
      // factor of exactly 1 would change nothing (an exp and the multiplications saved).
      if (block_max > running_max[g]) {
        const v8f rescale = splat(std::exp(running_max[g] - block_max));
        running_max[g] = block_max;
        denom8[g] *= rescale;
        denom[g] *= rescale[0];
        for (int64_t l = 0; l < lanes; ++l) acc[g][l] *= rescale;
      }
      const v8f max8 = splat(running_max[g]);
      for (t = 0; t + 8 <= valid; t += 8) {
        const v8f p = exp8(load8(row + t) - max8);
        store8(row + t, p);
        denom8[g] += p;
      }
      for (; t < valid; ++t) {
        row[t] = std::exp(row[t] - running_max[g]);
        denom[g] += row[t];
      }
    }
    for (int64_t l0 = 0; l0 < lanes; l0 += kValueLanes) {
      v8f a[G][kValueLanes];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < kValueLanes; ++j)
          if (l0 + j < lanes) a[g][j] = acc[g][l0 + j];
      for (t = 0; t < valid; ++t) {
        spread.step(lines_per_step);
        v8f p[G];
        for (int g = 0; g < G; ++g) p[g] = splat(scores[g * block_size + t]);
        for (int j = 0; j < kValueLanes; ++j) {
          if (l0 + j >= lanes) break;
          const v8f v = load_kv8(vb + t * D + 8 * (l0 + j));
          for (int g = 0; g < G; ++g) a[g][j] += p[g] * v;
        }
      }
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < kValueLanes; ++j)
          if (l0 + j < lanes) acc[g][l0 + j] = a[g][j];
    }
  }
  for (int g = 0; g < G; ++g) {
    const v8f inv = splat(1.0f / (hsum(denom8[g]) + denom[g]));
    for (int64_t l = 0; l < lanes; ++l) store8(out + g * D + 8 * l, acc[g][l] * inv);
  }
}

// A KV head group's query heads in runs of at most kMaxHeads, as even as possible (4 -> 2 + 2),
// through attend<T, lanes, run> for the head dims that have their own build, else the general one.
template <typename T>
void attend_group(const float* q, int64_t group, int64_t D, const T* k_cache, const T* v_cache, int64_t block_stride,
                  int64_t head_offset, const int64_t* table, int64_t block_size, int64_t len, float scale,
                  float* scratch, float* out) {
  const int64_t runs = (group + kMaxHeads - 1) / kMaxHeads;
  for (int64_t r = 0, h = 0; r < runs; ++r) {
    const int64_t heads = (group - h) / (runs - r);
    auto run = [&](auto kernel) {
      kernel(q + h * D, D, k_cache, v_cache, block_stride, head_offset, table, block_size, len, scale, scratch,
             out + h * D);
    };
    auto by_heads = [&](auto one, auto two, auto three) {
      switch (heads) {
        case 1: return run(one);
        case 2: return run(two);
        default: return run(three);
      }
    };
    switch (D) {
      case 64: by_heads(attend<T, 8, 1>, attend<T, 8, 2>, attend<T, 8, 3>); break;
      case 128: by_heads(attend<T, 16, 1>, attend<T, 16, 2>, attend<T, 16, 3>); break;
      default: by_heads(attend<T, 0, 1>, attend<T, 0, 2>, attend<T, 0, 3>);
    }
    h += heads;
  }
}

}  // namespace

// q: [T, H, D] float32; caches: [num_blocks, KVH, block_size, D] float32 or bfloat16;
// tables: [S, max_blocks] int64; row_seq: [T] int64 (the table row of each query);
// row_len: [T] int64 (keys visible to each query, >= 1). Returns [T, H, D] float32.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                              torch::Tensor row_seq, torch::Tensor row_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be [T, H, D] float32");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  q = q.contiguous();
  tables = tables.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0 && H / KVH <= 16, "query heads per KV head must be at most 16");
  TORCH_CHECK(D % 8 == 0 && D <= 256 && k_cache.size(3) == D, "head_dim must be a multiple of 8, at most 256");
  const int64_t group = H / KVH, block_stride = KVH * block_size * D, max_blocks = tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* seq = row_seq.data_ptr<int64_t>();
  const int64_t* lens = row_len.data_ptr<int64_t>();
  at::parallel_for(0, T * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(group * block_size);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t t = work / KVH, h = work % KVH;
      const float* qh = qp + (t * H + h * group) * D;
      float* oh = op + (t * H + h * group) * D;
      const int64_t* table = tp + seq[t] * max_blocks;
      const int64_t offset = h * block_size * D;
      if (k_cache.scalar_type() == torch::kBFloat16) {
        attend_group(qh, group, D, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), block_stride,
                   offset, table, block_size, lens[t], static_cast<float>(scale), scratch.data(), oh);
      } else {
        attend_group(qh, group, D, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), block_stride, offset, table,
                   block_size, lens[t], static_cast<float>(scale), scratch.data(), oh);
      }
    }
  });
  return out;
}

// The small per-layer ops of a decode step, one call each instead of five to ten of torch's: at one
// token per step their dispatch, not their arithmetic, is the cost. fp32 only.

// RMSNorm as HF computes it; with residual, x + residual first. Returns (normed, x + residual).
std::vector<torch::Tensor> rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight,
                                    double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [T, hidden] float32");
  x = x.contiguous();
  const int64_t T = x.size(0), H = x.size(1);
  auto sum = residual.has_value() ? torch::empty_like(x) : x;
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.has_value() ? residual->contiguous().data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = sp + t * H;
      if (rp != nullptr)
        for (int64_t i = 0; i < H; ++i) row[i] = xp[t * H + i] + rp[t * H + i];
      float squares = 0.0f;
      for (int64_t i = 0; i < H; ++i) squares += row[i] * row[i];
      const float inv = 1.0f / std::sqrt(squares / H + static_cast<float>(eps));
      for (int64_t i = 0; i < H; ++i) op[t * H + i] = wp[i] * (row[i] * inv);
    }
  });
  return {out, sum};
}

// Rotary embedding of q [T, Hq, D] and k [T, Hk, D] (any strides between tokens and heads, D
// contiguous) with cos, sin [T, D]: HF's rotate-half form. Returns new contiguous q and k.
std::vector<torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32, "q, k must be float32");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "head_dim must be contiguous");
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  std::vector<torch::Tensor> outs;
  for (const auto& x : {q, k}) {
    auto out = torch::empty(x.sizes(), x.options());
    const int64_t heads = x.size(1), st = x.stride(0), sh = x.stride(1);
    const float* xp = x.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* snp = sin.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const float* in = xp + t * st + h * sh;
        const float* c = cp + t * D;
        const float* sn = snp + t * D;
        float* o = op + (t * heads + h) * D;
        for (int64_t i = 0; i < half; ++i) o[i] = in[i] * c[i] - in[i + half] * sn[i];
        for (int64_t i = half; i < D; ++i) o[i] = in[i] * c[i] + in[i - half] * sn[i];
      }
    outs.push_back(out);
  }
  return outs;
}

// cache[slot_blocks[t], :, slot_offsets[t]] = new[t] for a step's K or V ([T, KVH, D]), in the
// cache's dtype (a bf16 cache under an fp32 model rounds each value once, here).
void write_cache(torch::Tensor cache, torch::Tensor values, torch::Tensor slot_blocks, torch::Tensor slot_offsets) {
  TORCH_CHECK(cache.is_contiguous(), "the cache must be contiguous");
  values = values.to(cache.scalar_type()).contiguous();
  const int64_t T = values.size(0), KVH = cache.size(1), block_size = cache.size(2), D = cache.size(3);
  const int64_t row_bytes = D * cache.element_size();
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  char* cp = static_cast<char*>(cache.data_ptr());
  const char* vp = static_cast<const char*>(values.data_ptr());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < KVH; ++h)
      std::memcpy(cp + ((blocks[t] * KVH + h) * block_size + offsets[t]) * row_bytes, vp + (t * KVH + h) * row_bytes,
                  row_bytes);
}

// SiLU of 8 values: g * sigmoid(g), the sigmoid from e^-|g| (exp8 takes x <= 0), so that no
// term overflows: 1 / (1 + e) for g >= 0, e / (1 + e) below.
inline v8f silu8(v8f g) {
  const v8f e = exp8(g < 0 ? g : -g);
  const v8f positive = splat(1.0f) / (splat(1.0f) + e);
  return g * (g < 0 ? e * positive : positive);
}

// SiLU(gate) * up for x = [gate | up] ([T, 2I]) -> [T, I] (the layer stack's; Python uses torch's).
// Vectorized and across threads from a few rows: scalar and on one thread (libm's expf per
// value), a batch of 32 spent ~8 % of its decode step here while the other thread waited.
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) % 2 == 0, "x must be [T, 2I] float32");
  x = x.contiguous();
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = xp + t * 2 * I;
      const float* up = gate + I;
      float* row = op + t * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) store8(row + i, silu8(load8(gate + i)) * load8(up + i));
      if (i < I) {  // the last few, through a zero-padded vector
        float g[8] = {}, u[8] = {}, r[8];
        std::memcpy(g, gate + i, (I - i) * sizeof(float));
        std::memcpy(u, up + i, (I - i) * sizeof(float));
        store8(r, silu8(load8(g)) * load8(u));
        std::memcpy(row + i, r, (I - i) * sizeof(float));
      }
    }
  });
  return out;
}

// The decoder layers of a step whose every row is a decode or a short chunk served by the paged
// kernel, in one call: the same ops as model/llama.py, without a Python call per op (at a few
// tokens per step those calls cost a third of the step). Weights are dense fp32 or grouped;
// tensor parallelism and other formats take the Python path.
class DecodeStack {
 public:
  // A linear layer: grouped (q, d, m) or dense (weight); bias optional.
  struct Linear {
    c10::optional<torch::Tensor> weight, q, d, m, bias;
    bool int8_activations;
    torch::Tensor operator()(const torch::Tensor& x) const {
      if (q.has_value()) return group_linear(x, *q, *d, m.has_value() ? *m : *d, bias, int8_activations);
      return at::linear(x, *weight, bias);
    }
  };
  struct Layer {
    torch::Tensor input_norm, post_norm;
    Linear qkv, o, gate_up, down;
  };

  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, torch::Tensor final_norm)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), final_norm_(final_norm) {}

  // Each linear: (weight, q, d, m, bias, int8_activations), the unused tensors None.
  using LinearParts = std::tuple<c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                                 c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                                 c10::optional<torch::Tensor>, bool>;
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, const LinearParts& qkv, const LinearParts& o,
                 const LinearParts& gate_up, const LinearParts& down) {
    layers_.push_back({input_norm, post_norm, linear(qkv), linear(o), linear(gate_up), linear(down)});
  }

  // x: [T, hidden] input embeddings; cos, sin: [T, head_dim]; k_caches, v_caches: one per layer.
  // Returns the final norm of the last layer's output (the hidden states the LM head reads).
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, const std::vector<torch::Tensor>& k_caches,
                        const std::vector<torch::Tensor>& v_caches, torch::Tensor slot_blocks,
                        torch::Tensor slot_offsets, torch::Tensor tables, torch::Tensor row_seq, torch::Tensor row_len) {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(), "one K and V cache per layer");
    const int64_t T = x.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
    c10::optional<torch::Tensor> residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      auto normed = rms_norm(x, residual, layer.input_norm, eps_);
      residual = normed[1];
      auto qkv = layer.qkv(normed[0]);
      auto q = qkv.narrow(1, 0, q_size).view({T, heads_, head_dim_});
      auto k = qkv.narrow(1, q_size, kv_size).view({T, kv_heads_, head_dim_});
      auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, kv_heads_, head_dim_});
      auto rotated = rotary(q, k, cos, sin);
      write_cache(k_caches[i], rotated[1], slot_blocks, slot_offsets);
      write_cache(v_caches[i], v, slot_blocks, slot_offsets);
      auto attended = paged_attention(rotated[0], k_caches[i], v_caches[i], tables, row_seq, row_len, scale);
      normed = rms_norm(layer.o(attended.view({T, q_size})), residual, layer.post_norm, eps_);
      residual = normed[1];
      x = layer.down(silu_and_mul(layer.gate_up(normed[0])));
    }
    return rms_norm(x, residual, final_norm_, eps_)[0];
  }

 private:
  static Linear linear(const LinearParts& parts) {
    const auto& [weight, q, d, m, bias, int8_activations] = parts;
    TORCH_CHECK(weight.has_value() || (q.has_value() && d.has_value()), "a linear needs a weight or q and d");
    return {weight, q, d, m, bias, int8_activations};
  }

  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  torch::Tensor final_norm_;
  std::vector<Layer> layers_;
};

// Every op lets go of the GIL while it runs, as torch's own ops do: a server's event loop thread
// (streaming tokens) shares the process with the engine thread.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, "RMSNorm, with the residual added first when given", no_gil);
  m.def("rotary", &rotary, "rotate-half rotary embedding of q and k", no_gil);
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up of x = [gate | up]", no_gil);
  m.def("write_cache", &write_cache, "a step's K or V into its cache slots", no_gil);
  m.def("group_linear", &group_linear, "x @ W^T with W in GGUF groups of 32 (Q4_1 or Q8_0)", py::arg("x"),
        py::arg("qweight"), py::arg("d"), py::arg("m"), py::arg("bias"), py::arg("int8_activations") = false, no_gil);
  m.def("set_dense_from", &set_dense_from, "from how many rows of x group_linear takes torch's GEMM");
  m.def("dense_from", [] { return dense_from.load(); }, "from how many rows of x group_linear takes torch's GEMM");
  m.def("panels_for", &panels_for, "whether group_linear multiplies this many rows of x in panels here");
  m.def("amx_tiles", &amx_tiles, "whether group_linear multiplies on AMX tiles on this host");
  m.def("group_dequantize", &group_dequantize, "a grouped weight as float32", no_gil);
  m.def("group_recover", &group_recover, "a float32 weight as the GGUF groups it holds exactly, if any", no_gil);
  m.def("paged_attention", &paged_attention, "attention over a paged KV cache, read in place", no_gil);
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t, double, torch::Tensor>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward, no_gil);
}
