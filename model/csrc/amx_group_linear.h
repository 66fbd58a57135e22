// group_linear on Intel AMX tiles (included by cpu_ops.cpp where the build's -march has AMX-BF16).
//
// AMX multiplies bf16 pairs into fp32 sums, 16 x 16 outputs x 32 inputs per instruction. The GGUF's
// quantized values q are small integers, exact in bf16; x is split into three bf16 parts whose sum
// is x exactly (truncated to 8, then 16 bits of mantissa, and what is left: 24 in all). Each
// product q * part is exact in fp32, so a group's sum(q * x) comes out with fp32 rounding only,
// then it is scaled by d (Q4_1's m * sum(x) is the caller's): the fp32 GEMM of the dequantized
// weight, up to summation order, like the few-row path of group_linear. Nothing is rounded to bf16.
//
// Layout: A is a tile of 16 rows of W (one group of 32 values each, unpacked to bf16), B a tile of
// one group of x's parts for 16 rows of x (pairs of inputs interleaved, as the instruction reads
// them), C = A . B is 16 outputs of W by 16 rows of x, scaled by each W row's d and added up over
// the groups in fp32.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace amx {

constexpr int64_t kTile = 16;  // rows of W and of x per tile
constexpr int kParts = 3;      // bf16 parts of each x value

// Linux grants a process AMX's tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); a tile instruction before that is SIGILL. A kernel or hypervisor that says
// no leaves the other paths, as does PAGODA_AMX=0 (to compare them).
inline bool available() {
  static const bool usable = [] {
    const char* setting = std::getenv("PAGODA_AMX");
    return !(setting && std::string(setting) == "0") && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return usable;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Eight tiles of 16 rows x 64 bytes (C: 16 floats, A: 32 bf16, B: 16 bf16 pairs), on this thread.
inline void configure() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTile;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}

// bf16 bit patterns of 0..15 (and 16..31 unused), for one-instruction nibble lookups.
inline __m512i nibble_table() {
  alignas(64) uint16_t table[32] = {};
  for (int i = 0; i < 16; ++i) {
    const float f = static_cast<float>(i);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    table[i] = static_cast<uint16_t>(bits >> 16);
  }
  return _mm512_load_si512(table);
}

// W rows [n0, n0 + 16), group g, as an A tile: 16 rows of 32 bf16 (64 bytes each).
inline void unpack_rows(const GroupedWeight& w, int64_t n0, int64_t g, const __m512i& table, uint16_t* out) {
  const int64_t groups = w.K / kGroup;
  for (int64_t r = 0; r < kTile; ++r) {
    const int64_t group = (n0 + r) * groups + g;
    __m512i row;
    if (w.q4) {  // byte j: weight j in the low nibble, weight j + 16 in the high one
      const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q + group * 16)));
      const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi16(0xF)), high = _mm256_srli_epi16(bytes, 4);
      row = _mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1), table);
    } else {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q + group * 32));
      const __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
      const __m512 second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
      row = (__m512i)_mm512_cvtne2ps_pbh(second, first);  // integers below 256: exact
    }
    _mm512_storeu_si512(out + r * 32, row);
  }
}

// out[i] = column i of the 16 x 16 matrix of 32-bit values whose rows are in[0..16).
inline void transpose16(const __m512i* in, __m512i* out) {
  __m512i a[16], b[16];
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_epi32(in[i], in[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(in[i], in[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: rows 4k+i of each quarter
    a[i] = _mm512_shuffle_i32x4(b[i], b[i + 4], 0x88);
    a[i + 4] = _mm512_shuffle_i32x4(b[i], b[i + 4], 0xDD);
    a[i + 8] = _mm512_shuffle_i32x4(b[i + 8], b[i + 12], 0x88);
    a[i + 12] = _mm512_shuffle_i32x4(b[i + 8], b[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    out[i] = _mm512_shuffle_i32x4(a[i], a[i + 8], 0x88);
    out[i + 8] = _mm512_shuffle_i32x4(a[i], a[i + 8], 0xDD);
    out[i + 4] = _mm512_shuffle_i32x4(a[i + 4], a[i + 12], 0x88);
    out[i + 12] = _mm512_shuffle_i32x4(a[i + 4], a[i + 12], 0xDD);
  }
}

// x's three parts as B tiles: parts[p][(g * row_tiles + t) * 512 + i * 32 + 2 * j + e] is part p of
// x[16 t + j][32 g + 2 i + e] (zero past M); where group_sums is given, group_sums[row * groups + g]
// = the sum of x's group g in that row (for Q4_1's minimums).
void split_x(const float* x, int64_t M, int64_t K, int64_t M16, uint16_t* parts, float* group_sums) {
  const int64_t groups = K / kGroup, row_tiles = M16 / kTile, part_size = M16 * K;
  const __m512i mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  at::parallel_for(0, row_tiles * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t t = index / groups, g = index % groups;
      __m512i rows[kParts][kTile];  // row j: x[16 t + j]'s 16 pairs of group g, per part
      for (int64_t j = 0; j < kTile; ++j) {
        const int64_t row = t * kTile + j;
        __m512 values[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        if (row < M) {
          values[0] = _mm512_loadu_ps(x + row * K + g * kGroup);
          values[1] = _mm512_loadu_ps(x + row * K + g * kGroup + 16);
          if (group_sums) group_sums[row * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(values[0], values[1]));
        }
        __m512 part[kParts][2];
        for (int h = 0; h < 2; ++h) {  // truncations: each part holds 8 bits of mantissa, exactly
          __m512 rest = values[h];
          for (int p = 0; p < kParts; ++p) {
            part[p][h] = (p + 1 < kParts) ? _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(rest), mask)) : rest;
            rest = _mm512_sub_ps(rest, part[p][h]);
          }
        }
        for (int p = 0; p < kParts; ++p) rows[p][j] = (__m512i)_mm512_cvtne2ps_pbh(part[p][1], part[p][0]);
      }
      for (int p = 0; p < kParts; ++p) {  // pair i of row j goes to row i, column j of the tile
        __m512i columns[kTile];
        transpose16(rows[p], columns);
        uint16_t* tile = parts + p * part_size + (g * row_tiles + t) * kTile * 32;
        for (int i = 0; i < kTile; ++i) _mm512_storeu_si512(tile + i * 32, columns[i]);
      }
    }
  });
}

// Tiles (GCC's tile intrinsics take literal numbers), for a block of 32 rows of W (A0, A1) by 32
// rows of x (B0, B1), C_ij = A_i . B_j: C00 0, C01 1, C10 2, C11 3, A0 4, A1 5, B0 6, B1 7.

// out[M, N] = x W^T for a grouped W, without Q4_1's minimums (the caller adds sum(x) . m^T from
// group_sums, [M, K / 32], filled here where given); N a multiple of 32.
void group_linear(const GroupedWeight& w, const float* x, int64_t M, int64_t N, float* out, float* group_sums) {
  const int64_t K = w.K, groups = K / kGroup, M16 = (M + kTile - 1) / kTile * kTile, row_tiles = M16 / kTile;
  thread_local std::vector<uint16_t> parts;
  parts.resize(kParts * M16 * K);
  split_x(x, M, K, M16, parts.data(), group_sums);
  const uint16_t* xp = parts.data();
  constexpr int64_t kTileFloats = kTile * kTile, kTileValues = kTile * 32;
  at::parallel_for(0, N / (2 * kTile), 1, [&](int64_t begin, int64_t end) {
    configure();
    const __m512i table = nibble_table();
    // 32 rows of W, every group unpacked once, for every tile of x's rows
    thread_local std::vector<uint16_t> weights;
    thread_local std::vector<float> scales;
    weights.resize(groups * 2 * kTileValues);
    scales.resize(groups * 2 * kTile);
    alignas(64) float c[4 * kTileFloats], acc[4 * kTileFloats];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * 2 * kTile;
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t i = 0; i < 2; ++i) {
          unpack_rows(w, n0 + i * kTile, g, table, weights.data() + (g * 2 + i) * kTileValues);
          for (int64_t r = 0; r < kTile; ++r)
            scales[(g * 2 + i) * kTile + r] = half_to_float(w.d[(n0 + i * kTile + r) * groups + g]);
        }
      for (int64_t t = 0; t < row_tiles; t += 2) {
        const bool two = t + 1 < row_tiles;  // a second tile of x's rows
        std::memset(acc, 0, sizeof(acc));
        for (int64_t g = 0; g < groups; ++g) {
          _tile_loadd(4, weights.data() + (g * 2) * kTileValues, 64);
          _tile_loadd(5, weights.data() + (g * 2 + 1) * kTileValues, 64);
          _tile_zero(0);
          _tile_zero(2);
          _tile_zero(1);
          _tile_zero(3);
          for (int p = 0; p < kParts; ++p) {
            const uint16_t* b0 = xp + p * M16 * K + (g * row_tiles + t) * kTileValues;
            _tile_loadd(6, b0, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (two) {
              _tile_loadd(7, b0 + kTileValues, 64);
              _tile_dpbf16ps(1, 4, 7);
              _tile_dpbf16ps(3, 5, 7);
            }
          }
          _tile_stored(0, c, 64);
          _tile_stored(2, c + 2 * kTileFloats, 64);
          if (two) {
            _tile_stored(1, c + kTileFloats, 64);
            _tile_stored(3, c + 3 * kTileFloats, 64);
          }
          for (int64_t i = 0; i < 2; ++i) {
            const float* d = scales.data() + (g * 2 + i) * kTile;
            for (int64_t j = 0; j < (two ? 2 : 1); ++j) {
              float* a = acc + (2 * i + j) * kTileFloats;
              const float* ci = c + (2 * i + j) * kTileFloats;
              for (int r = 0; r < kTile; ++r)
                _mm512_store_ps(a + r * kTile, _mm512_fmadd_ps(_mm512_load_ps(ci + r * kTile), _mm512_set1_ps(d[r]),
                                                               _mm512_load_ps(a + r * kTile)));
            }
          }
        }
        for (int64_t j = 0; j < (two ? 2 : 1); ++j) {
          const int64_t first = (t + j) * kTile, rows = std::min(kTile, M - first);
          for (int64_t i = 0; i < 2; ++i) {
            const float* a = acc + (2 * i + j) * kTileFloats;
            for (int64_t row = 0; row < rows; ++row)
              for (int r = 0; r < kTile; ++r) out[(first + row) * N + n0 + i * kTile + r] = a[r * kTile + row];
          }
        }
      }
    }
    _tile_release();
  });
}

}  // namespace amx
