// The block-scaled quantizers of csrc/cuda/block, run under the host emulation (cuda_runtime.h here),
// against the C quantizers of csrc/fp8/fp8_block.h and csrc/fp4/nvfp4.h: the same data and scale bytes
// (scale buffers wider than needed and pre-filled, so a stray write shows) for every dtype and format,
// matrices of every FP8 / E2M1 code point, ragged sizes (partial last blocks and tiles), strided rows,
// all-zero, Inf and NaN blocks, and blocks whose scales are subnormal; NVFP4 with 2D blocks, the
// Hadamard transform and stochastic rounding under several seeds; the dequantizers over every data and
// scale code; and the launchers' argument checks.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <set>
#include <vector>

#include "cuda/block/block_cuda.h"
extern "C" {
#include "fp4/nvfp4.h"
#include "fp4/nvfp4_format.h"
#include "fp8/fp8_block.h"
#include "fp8/fp8_block_format.h"
}

namespace {

#include "../check.h"

uint64_t rng = 0x853C49E6748FEA9Bull;
uint32_t rand_u32() {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return static_cast<uint32_t>(rng);
}

const tf_dtype kDtypes[3] = {TF_FLOAT32, TF_BFLOAT16, TF_FLOAT16};
const tf_fp8_format kFormats[2] = {TF_FP8_E4M3, TF_FP8_E5M2};
size_t elem_size(tf_dtype d) { return d == TF_FLOAT32 ? 4 : 2; }

// A rows x ld matrix of dtype d, set and read as float32 (stored rounded to d).
struct Matrix {
  tf_dtype dtype;
  int64_t rows, cols, ld;
  std::vector<uint8_t> bytes;
  Matrix(tf_dtype d, int64_t r, int64_t c, int64_t l)
      : dtype(d), rows(r), cols(c), ld(l), bytes(static_cast<size_t>(r * l + 1) * elem_size(d)) {}
  void set(int64_t r, int64_t c, float f) {
    const int64_t i = r * ld + c;
    if (dtype == TF_FLOAT32) {
      std::memcpy(&bytes[4 * i], &f, 4);
    } else {
      const uint16_t h = dtype == TF_BFLOAT16 ? tf_f32_to_bf16(f) : tf_f32_to_f16(f);
      std::memcpy(&bytes[2 * i], &h, 2);
    }
  }
  const void *data() const { return bytes.data(); }
};

// Random values around 1 spread over many binades, some arbitrary bit patterns (Inf, NaN, subnormals).
float rand_float(bool finite) {
  uint32_t u = rand_u32();
  if (rand_u32() % 8 != 0) u = (u & 0x807FFFFFu) | ((110u + rand_u32() % 30u) << 23);
  if (finite && ((u >> 23) & 0xFFu) > 141u) u = (u & 0x807FFFFFu) | (141u << 23);  // float16 keeps it finite
  return tf_f32_from_bits(u);
}

// Random values, then whole blocks of the block shape br x bc overwritten: all zero, holding an Inf or a
// NaN, or tiny (so their scales are subnormal, or the smallest ones), or spread over 2^-k of the rest.
void fill(Matrix &m, int64_t br, int64_t bc, bool finite) {
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.ld; ++c) m.set(r, c, rand_float(finite));
  for (int64_t r0 = 0; r0 < m.rows; r0 += br)
    for (int64_t c0 = 0; c0 < m.cols; c0 += bc) {
      const uint32_t kind = rand_u32() % 8;
      const float tiny = tf_f32_from_bits(rand_u32() % 2 ? 0x00000001u + rand_u32() % 0x800000u : 0x01000000u);
      const float shrink = tf_f32_from_bits((127u - rand_u32() % 24u) << 23);
      for (int64_t r = r0; r < r0 + br && r < m.rows; ++r)
        for (int64_t c = c0; c < c0 + bc && c < m.cols; ++c) {
          const float v = rand_float(true);
          if (kind == 0) m.set(r, c, rand_u32() % 2 ? 0.0f : -0.0f);
          if (kind == 1) m.set(r, c, v * tiny);
          if (kind == 2) m.set(r, c, v * shrink * 1e-3f);
        }
      const int64_t r = r0 + rand_u32() % br, c = c0 + rand_u32() % bc;
      if (!finite && kind == 3 && r < m.rows && c < m.cols) m.set(r, c, rand_u32() % 2 ? INFINITY : -INFINITY);
      if (!finite && kind == 4 && r < m.rows && c < m.cols) m.set(r, c, rand_u32() % 2 ? NAN : -NAN);
    }
}

// A matrix of every code point: row 0 and column 0 hold +-max, whose blocks then quantize with scale 1,
// and the other elements run through decode(code) for every code in turn.
template <class Decode>
void fill_code_points(Matrix &m, float max, int codes, Decode decode) {
  int code = 0;
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) {
      const float v = r == 0 || c == 0 ? (rand_u32() % 2 ? max : -max) : decode(code);
      if (r != 0 && c != 0) code = (code + 1) % codes;
      m.set(r, c, v);
    }
}

float fp8_decode(tf_fp8_format f, int code) {
  return f == TF_FP8_E4M3 ? tf_fp8_e4m3_decode(static_cast<uint8_t>(code))
                          : tf_fp8_e5m2_decode(static_cast<uint8_t>(code));
}

// The codes the encoder can produce (those that decode and encode back to themselves).
size_t reachable_fp8_codes(tf_fp8_format f) {
  std::set<uint8_t> codes;
  for (int c = 0; c < 256; ++c) {
    const float v = fp8_decode(f, c);
    codes.insert(f == TF_FP8_E4M3 ? tf_fp8_e4m3_encode(v) : tf_fp8_e5m2_encode(v));
  }
  return codes.size();
}

bool same(const std::vector<uint8_t> &a, const std::vector<uint8_t> &b) { return a == b; }
bool same(const std::vector<float> &a, const std::vector<float> &b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), 4 * a.size()) == 0;
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- MXFP8 --------------------------------------------------------------------------------------

// Quantizes m on both sides; returns the C rowwise and columnwise data (the CUDA ones compared equal).
std::vector<uint8_t> check_mxfp8(const Matrix &m, tf_fp8_format f, bool rowwise, bool columnwise) {
  const int64_t rows = m.rows, cols = m.cols, ld_s = cdiv(cols, 32) + 3, ld_sc = cols + 5;
  const size_t n = static_cast<size_t>(rows * cols), ns = static_cast<size_t>(rows * ld_s),
               nsc = static_cast<size_t>(cdiv(rows, 32) * ld_sc);
  std::vector<uint8_t> y(n + 1, 0xA5), s(ns + 1, 0x5A), yc(n + 1, 0xA5), sc(nsc + 1, 0x5A);
  std::vector<uint8_t> y_ref = y, s_ref = s, yc_ref = yc, sc_ref = sc;
  auto p = [](std::vector<uint8_t> &v, bool used) { return used ? v.data() : nullptr; };
  CHECK(tf_mxfp8_quantize_cuda(m.data(), m.dtype, rows, cols, m.ld, f, p(y, rowwise), p(s, rowwise), ld_s,
                               p(yc, columnwise), p(sc, columnwise), ld_sc, nullptr) == TF_OK,
        "mxfp8 cuda status");
  CHECK(tf_mxfp8_quantize(m.data(), m.dtype, rows, cols, m.ld, 0, rows, f, p(y_ref, rowwise), p(s_ref, rowwise), ld_s,
                          p(yc_ref, columnwise), p(sc_ref, columnwise), ld_sc) == TF_OK,
        "mxfp8 C status");
  CHECK(same(y, y_ref) && same(s, s_ref) && same(yc, yc_ref) && same(sc, sc_ref),
        "mxfp8 %ld x %ld (ld %ld) dtype %d format %d rowwise %d columnwise %d: data %d scale %d col data %d "
        "col scale %d",
        static_cast<long>(rows), static_cast<long>(cols), static_cast<long>(m.ld), m.dtype, f, rowwise, columnwise,
        same(y, y_ref), same(s, s_ref), same(yc, yc_ref), same(sc, sc_ref));
  y_ref.resize(n);
  yc_ref.resize(n);
  if (columnwise) y_ref.insert(y_ref.end(), yc_ref.begin(), yc_ref.end());
  return y_ref;
}

const int64_t kShapes[][3] = {{1, 1, 1},    {31, 33, 33},  {32, 32, 40},   {33, 129, 129}, {64, 256, 256},
                              {100, 70, 75}, {7, 300, 300}, {130, 127, 130}, {257, 31, 31}};

void test_mxfp8() {
  for (tf_dtype d : kDtypes)
    for (tf_fp8_format f : kFormats) {
      for (const auto &shape : kShapes) {
        Matrix m(d, shape[0], shape[1], shape[2]);
        fill(m, 32, 32, false);
        check_mxfp8(m, f, true, true);
        check_mxfp8(m, f, true, false);
        check_mxfp8(m, f, false, true);
      }
      Matrix m(d, 64, 96, 96);
      fill_code_points(m, tf_fp8_max(f), 256, [&](int code) { return fp8_decode(f, code); });
      const std::vector<uint8_t> out = check_mxfp8(m, f, true, true);
      CHECK(std::set<uint8_t>(out.begin(), out.end()).size() == reachable_fp8_codes(f),
            "mxfp8 code points: dtype %d format %d gives %zu distinct codes of %zu", d, f,
            std::set<uint8_t>(out.begin(), out.end()).size(), reachable_fp8_codes(f));
    }
}

// ---- Float8 block scaling -----------------------------------------------------------------------

std::vector<uint8_t> check_fp8_block(const Matrix &m, tf_fp8_format f, int block_dim, float eps, int pow2,
                                     bool rowwise, bool columnwise) {
  const int64_t rows = m.rows, cols = m.cols, rb = cdiv(rows, 128), cb = cdiv(cols, 128);
  const int64_t ld_s = (block_dim == 1 ? rows : cb) + 2, ld_st = (block_dim == 1 ? cols : rb) + 3;
  const size_t n = static_cast<size_t>(rows * cols);
  const size_t ns = static_cast<size_t>((block_dim == 1 ? cb : rb) * ld_s),
               nst = static_cast<size_t>((block_dim == 1 ? rb : cb) * ld_st);
  std::vector<uint8_t> y(n + 1, 0xA5), yt(n + 1, 0xA5);
  std::vector<float> s(ns + 1, -7.0f), st(nst + 1, -7.0f);
  std::vector<uint8_t> y_ref = y, yt_ref = yt;
  std::vector<float> s_ref = s, st_ref = st;
  auto p = [](auto &v, bool used) { return used ? v.data() : nullptr; };
  CHECK(tf_fp8_block_quantize_cuda(m.data(), m.dtype, rows, cols, m.ld, f, block_dim, eps, pow2, p(y, rowwise),
                                   p(s, rowwise), ld_s, p(yt, columnwise), p(st, columnwise), ld_st,
                                   nullptr) == TF_OK,
        "fp8 block cuda status");
  CHECK(tf_fp8_block_quantize(m.data(), m.dtype, rows, cols, m.ld, 0, rows, f, block_dim, eps, pow2, p(y_ref, rowwise),
                              p(s_ref, rowwise), ld_s, p(yt_ref, columnwise), p(st_ref, columnwise), ld_st) == TF_OK,
        "fp8 block C status");
  CHECK(same(y, y_ref) && same(s, s_ref) && same(yt, yt_ref) && same(st, st_ref),
        "fp8 block %ld x %ld (ld %ld) dtype %d format %d block_dim %d eps %g pow2 %d rowwise %d columnwise %d: "
        "data %d scale_inv %d data_t %d scale_inv_t %d",
        static_cast<long>(rows), static_cast<long>(cols), static_cast<long>(m.ld), m.dtype, f, block_dim,
        static_cast<double>(eps), pow2, rowwise, columnwise, same(y, y_ref), same(s, s_ref), same(yt, yt_ref),
        same(st, st_ref));
  y_ref.resize(n);
  return y_ref;
}

void test_fp8_block() {
  const int64_t shapes[][3] = {{1, 1, 1}, {127, 129, 129}, {128, 128, 136}, {200, 64, 64}, {3, 400, 401},
                               {260, 131, 131}};
  for (tf_dtype d : kDtypes)
    for (tf_fp8_format f : kFormats)
      for (int block_dim : {1, 2}) {
        for (const auto &shape : shapes) {
          Matrix m(d, shape[0], shape[1], shape[2]);
          fill(m, block_dim == 2 ? 128 : 1, 128, false);
          for (const auto &[eps, pow2] : {std::pair{0.0f, 0}, std::pair{0.0f, 1}, std::pair{1e-4f, 1}})
            check_fp8_block(m, f, block_dim, eps, pow2, true, true);
          check_fp8_block(m, f, block_dim, 0.0f, 0, true, false);
          check_fp8_block(m, f, block_dim, 0.0f, 0, false, true);
        }
        Matrix m(d, 128, 256, 256);
        fill_code_points(m, tf_fp8_max(f), 256, [&](int code) { return fp8_decode(f, code); });
        const std::vector<uint8_t> out = check_fp8_block(m, f, block_dim, 0.0f, 0, true, true);
        CHECK(std::set<uint8_t>(out.begin(), out.end()).size() == reachable_fp8_codes(f),
              "fp8 block code points: dtype %d format %d block_dim %d gives %zu distinct codes", d, f, block_dim,
              std::set<uint8_t>(out.begin(), out.end()).size());
      }
}

// ---- NVFP4 --------------------------------------------------------------------------------------

struct Nvfp4Case {
  int block_2d, rht, stochastic;
  uint64_t seed;
};

// Amax and quantize on both sides; returns the C rowwise data.
std::vector<uint8_t> check_nvfp4(const Matrix &m, const Nvfp4Case &k, bool rowwise, bool columnwise) {
  // Ragged sizes: the zero-padded matrix's (rows_p x cols_p) packed data.
  const int64_t rows = m.rows, cols = m.cols, rows_p = (rows + 15) / 16 * 16, cols_p = (cols + 15) / 16 * 16;
  const int64_t ld_s = cols_p / 16 + 2, ld_st = rows_p / 16 + 1;
  float amax = 0.0f, amax_t = 0.0f, amax_ref = -1.0f, amax_t_ref = -1.0f;
  CHECK(tf_nvfp4_amax_cuda(m.data(), m.dtype, rows, cols, m.ld, 0, &amax, nullptr) == TF_OK &&
            tf_nvfp4_amax(m.data(), m.dtype, rows, cols, m.ld, 0, rows, 0, &amax_ref) == TF_OK,
        "nvfp4 amax status");
  const int rht_t = columnwise && k.rht;
  CHECK(tf_nvfp4_amax_cuda(m.data(), m.dtype, rows, cols, m.ld, rht_t, &amax_t, nullptr) == TF_OK &&
            tf_nvfp4_amax(m.data(), m.dtype, rows, cols, m.ld, 0, rows, rht_t, &amax_t_ref) == TF_OK,
        "nvfp4 amax_t status");
  CHECK(tf_f32_bits(amax) == tf_f32_bits(amax_ref) && tf_f32_bits(amax_t) == tf_f32_bits(amax_t_ref),
        "nvfp4 amax %ld x %ld dtype %d rht %d: %a vs %a, %a vs %a", static_cast<long>(rows), static_cast<long>(cols),
        m.dtype, rht_t, static_cast<double>(amax), static_cast<double>(amax_ref), static_cast<double>(amax_t),
        static_cast<double>(amax_t_ref));
  const size_t n = static_cast<size_t>(rows * cols_p / 2), n_t = static_cast<size_t>(cols * rows_p / 2);
  std::vector<uint8_t> y(n + 1, 0xA5), s(static_cast<size_t>(rows * ld_s) + 1, 0x5A), yt(n_t + 1, 0xA5),
      st(static_cast<size_t>(cols * ld_st) + 1, 0x5A);
  std::vector<uint8_t> y_ref = y, s_ref = s, yt_ref = yt, st_ref = st;
  auto p = [](std::vector<uint8_t> &v, bool used) { return used ? v.data() : nullptr; };
  const float *amax_t_ptr = k.block_2d ? &amax : &amax_t;
  CHECK(tf_nvfp4_quantize_cuda(m.data(), m.dtype, rows, cols, m.ld, k.block_2d, rht_t, k.stochastic, k.seed, &amax,
                               amax_t_ptr, p(y, rowwise), p(s, rowwise), ld_s, p(yt, columnwise), p(st, columnwise),
                               ld_st, nullptr) == TF_OK,
        "nvfp4 cuda status");
  CHECK(tf_nvfp4_quantize(m.data(), m.dtype, rows, cols, m.ld, 0, rows, k.block_2d, rht_t, k.stochastic, k.seed,
                          amax_ref, *amax_t_ptr, p(y_ref, rowwise), p(s_ref, rowwise), ld_s, p(yt_ref, columnwise),
                          p(st_ref, columnwise), ld_st) == TF_OK,
        "nvfp4 C status");
  CHECK(same(y, y_ref) && same(s, s_ref) && same(yt, yt_ref) && same(st, st_ref),
        "nvfp4 %ld x %ld (ld %ld) dtype %d 2d %d rht %d stochastic %d seed %llu rowwise %d columnwise %d: data %d "
        "scale %d data_t %d scale_t %d",
        static_cast<long>(rows), static_cast<long>(cols), static_cast<long>(m.ld), m.dtype, k.block_2d, rht_t,
        k.stochastic, static_cast<unsigned long long>(k.seed), rowwise, columnwise, same(y, y_ref), same(s, s_ref),
        same(yt, yt_ref), same(st, st_ref));
  y_ref.resize(n);
  return y_ref;
}

void test_nvfp4() {
  // Ragged rows and columns (a partial last block, a partial 16-row group, a tile cut at 128 columns + 1),
  // below one block, and whole blocks.
  const int64_t shapes[][3] = {{16, 16, 16},    {32, 48, 50}, {48, 272, 272}, {160, 144, 160}, {16, 512, 512},
                               {1, 1, 1},       {5, 7, 9},    {17, 33, 33},   {37, 129, 131},  {200, 20, 24},
                               {16, 150, 150}, {45, 16, 16}};
  const Nvfp4Case cases[] = {{0, 0, 0, 0},  {1, 0, 0, 0},  {0, 1, 0, 0},          {0, 0, 1, 1},
                             {0, 1, 1, 42}, {1, 0, 1, 7},  {0, 0, 1, 1ull << 62}};
  for (tf_dtype d : kDtypes) {
    for (const auto &shape : shapes) {
      Matrix m(d, shape[0], shape[1], shape[2]);
      fill(m, 16, 16, true);
      for (const Nvfp4Case &k : cases) {
        check_nvfp4(m, k, true, true);
        if (!k.block_2d) check_nvfp4(m, k, k.seed % 2 == 0, k.seed % 2 == 1);
      }
    }
    // Every E2M1 code: blocks of amax 6 under a global amax of 2688 quantize with multiplier 1.
    Matrix m(d, 32, 64, 64);
    const float grid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    fill_code_points(m, 6.0f, 16, [&](int code) { return code & 8 ? -grid[code & 7] : grid[code & 7]; });
    m.set(31, 63, 2688.0f);
    const std::vector<uint8_t> out = check_nvfp4(m, {0, 0, 0, 0}, true, true);
    std::set<int> nibbles;
    for (uint8_t b : out) nibbles.insert(b & 15), nibbles.insert(b >> 4);
    CHECK(nibbles.size() == 16, "nvfp4 code points: dtype %d gives %zu distinct codes", d, nibbles.size());
  }
}

// ---- dequantize ---------------------------------------------------------------------------------

// Every FP8 code as data and every E8M0 code (or random float32 scales: Inf, NaN, subnormals) as scales,
// in each layout of the quantizers, with ragged edges.
void test_block_dequantize() {
  const int64_t shapes[][2] = {{1, 1}, {33, 129}, {130, 70}, {64, 256}};
  const int64_t layouts[][3] = {{1, 32, 0}, {32, 1, 0}, {1, 128, 1}, {128, 1, 0}, {128, 128, 0}, {128, 128, 1}};
  for (const auto &shape : shapes)
    for (const auto &layout : layouts)
      for (tf_fp8_format f : kFormats)
        for (tf_block_scale_kind kind : {TF_BLOCK_SCALE_E8M0, TF_BLOCK_SCALE_F32})
          for (tf_dtype d : kDtypes) {
            const int64_t rows = shape[0], cols = shape[1], br = layout[0], bc = layout[1];
            const int transposed = static_cast<int>(layout[2]);
            const int64_t row_blocks = cdiv(rows, br), col_blocks = cdiv(cols, bc);
            const int64_t sr = transposed ? col_blocks : row_blocks, sc = (transposed ? row_blocks : col_blocks) + 1;
            std::vector<uint8_t> y(static_cast<size_t>(rows * cols));
            for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<uint8_t>(i % 3 ? rand_u32() : i / 3);
            std::vector<uint8_t> codes(static_cast<size_t>(sr * sc));
            std::vector<float> values(codes.size());
            // Inf and 0 scales meet zero and Inf codes: Inf * 0 is the CPU's NaN on both
            const float specials[] = {INFINITY, -INFINITY, 0.0f, NAN, 1e-45f};
            for (size_t i = 0; i < codes.size(); ++i) {
              codes[i] = static_cast<uint8_t>(i % 2 ? rand_u32() : i / 2);
              values[i] = i % 3 == 1 ? specials[(i / 3) % 5] : rand_float(false);
            }
            const void *scale = kind == TF_BLOCK_SCALE_E8M0 ? static_cast<const void *>(codes.data()) : values.data();
            const size_t bytes = y.size() * elem_size(d) + 1;
            std::vector<uint8_t> x(bytes, 0xA5), x_ref(bytes, 0xA5);
            CHECK(tf_block_dequantize_cuda(y.data(), f, rows, cols, scale, kind, sr, sc, br, bc, transposed, x.data(),
                                           d, nullptr) == TF_OK &&
                      tf_block_dequantize(y.data(), f, rows, cols, 0, rows, scale, kind, sr, sc, br, bc, transposed,
                                          x_ref.data(), d) == TF_OK,
                  "block dequantize status");
            CHECK(same(x, x_ref),
                  "block dequantize %ld x %ld blocks %ld x %ld transposed %d format %d kind %d dtype %d",
                  static_cast<long>(rows), static_cast<long>(cols), static_cast<long>(br), static_cast<long>(bc),
                  transposed, f, kind, d);
          }
}

// Every byte of packed E2M1 data under every non-NaN E4M3 block scale and amaxes from 0 to 1e30.
void test_nvfp4_dequantize() {
  const int64_t shapes[][2] = {{1, 16}, {33, 48}, {16, 512}};
  for (const auto &shape : shapes)
    for (tf_dtype d : kDtypes)
      for (float amax : {0.0f, 1.0f, 2688.0f, 3e-30f, 1e30f}) {
        const int64_t rows = shape[0], cols = shape[1], ld_s = cols / 16 + 1;
        std::vector<uint8_t> y(static_cast<size_t>(rows * cols / 2)), s(static_cast<size_t>(rows * ld_s));
        for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<uint8_t>(i % 2 ? rand_u32() : i / 2);
        for (size_t i = 0; i < s.size(); ++i) {
          s[i] = static_cast<uint8_t>(i % 2 ? rand_u32() : i / 2);
          if ((s[i] & 0x7Fu) == 0x7Fu) s[i] ^= 1u;  // no NaN scale: the quantizer never writes one
        }
        const size_t bytes = static_cast<size_t>(rows * cols) * elem_size(d) + 1;
        std::vector<uint8_t> x(bytes, 0xA5), x_ref(bytes, 0xA5);
        CHECK(tf_nvfp4_dequantize_cuda(y.data(), rows, cols, s.data(), ld_s, &amax, x.data(), d, nullptr) == TF_OK &&
                  tf_nvfp4_dequantize(y.data(), rows, cols, 0, rows, s.data(), ld_s, amax, x_ref.data(), d) == TF_OK,
              "nvfp4 dequantize status");
        CHECK(same(x, x_ref), "nvfp4 dequantize %ld x %ld dtype %d amax %g", static_cast<long>(rows),
              static_cast<long>(cols), d, static_cast<double>(amax));
      }
}

// ---- argument checks ----------------------------------------------------------------------------

void test_checks() {
  uint8_t y[64], s[64];
  float fs[64], amax = 1.0f;
  const float x[64] = {};
  CHECK(tf_mxfp8_quantize_cuda(x, TF_FLOAT32, 2, 4, 3, TF_FP8_E4M3, y, s, 1, nullptr, nullptr, 0, nullptr) ==
            TF_ERR_BAD_SIZE,
        "mxfp8: ld_x < cols");
  CHECK(tf_mxfp8_quantize_cuda(x, TF_FLOAT32, 2, 4, 4, TF_FP8_E4M3, y, nullptr, 1, nullptr, nullptr, 0, nullptr) ==
            TF_ERR_NULL_POINTER,
        "mxfp8: data without scale");
  CHECK(tf_mxfp8_quantize_cuda(x, TF_FLOAT32, 2, 64, 64, TF_FP8_E4M3, y, s, 1, nullptr, nullptr, 0, nullptr) ==
            TF_ERR_BAD_SIZE,
        "mxfp8: ld_scale too small");
  CHECK(tf_fp8_block_quantize_cuda(x, TF_FLOAT32, 2, 4, 4, TF_FP8_E4M3, 3, 0.0f, 0, y, fs, 2, nullptr, nullptr, 0,
                                   nullptr) == TF_ERR_BAD_ARGUMENT,
        "fp8 block: block_dim 3");
  CHECK(tf_fp8_block_quantize_cuda(x, TF_FLOAT32, 2, 4, 4, TF_FP8_E4M3, 1, -1.0f, 0, y, fs, 2, nullptr, nullptr, 0,
                                   nullptr) == TF_ERR_BAD_ARGUMENT,
        "fp8 block: negative epsilon");
  CHECK(tf_fp8_block_quantize_cuda(x, TF_FLOAT32, 4, 2, 2, TF_FP8_E4M3, 1, 0.0f, 0, y, fs, 3, nullptr, nullptr, 0,
                                   nullptr) == TF_ERR_BAD_SIZE,
        "fp8 block: ld_scale < rows");
  CHECK(tf_nvfp4_amax_cuda(x, TF_FLOAT32, 2, 4, 3, 0, &amax, nullptr) == TF_ERR_BAD_SIZE, "nvfp4 amax: ld_x < cols");
  CHECK(tf_nvfp4_quantize_cuda(x, TF_FLOAT32, 2, 17, 17, 0, 0, 0, 0, &amax, &amax, y, s, 1, nullptr, nullptr, 0,
                               nullptr) == TF_ERR_BAD_SIZE,
        "nvfp4: ld_scale below the padded columns' blocks");
  CHECK(tf_nvfp4_quantize_cuda(x, TF_FLOAT32, 16, 16, 16, 1, 1, 0, 0, &amax, &amax, y, s, 1, nullptr, nullptr, 0,
                               nullptr) == TF_ERR_BAD_ARGUMENT,
        "nvfp4: 2D blocks with the transform");
  CHECK(tf_nvfp4_quantize_cuda(x, TF_FLOAT32, 16, 16, 16, 0, 0, 0, 0, nullptr, &amax, y, s, 1, nullptr, nullptr, 0,
                               nullptr) == TF_ERR_NULL_POINTER,
        "nvfp4: no amax");
  CHECK(tf_nvfp4_quantize_cuda(x, TF_FLOAT16, 16, 16, 16, 0, 0, 0, 0, &amax, &amax, y, s, 0, nullptr, nullptr, 0,
                               nullptr) == TF_ERR_BAD_SIZE,
        "nvfp4: ld_scale too small");
  CHECK(tf_block_dequantize_cuda(y, TF_FP8_E4M3, 2, 64, s, TF_BLOCK_SCALE_E8M0, 2, 1, 1, 32, 0, fs, TF_FLOAT32,
                                 nullptr) == TF_ERR_BAD_SIZE,
        "block dequantize: scales do not cover the blocks");
  CHECK(tf_nvfp4_dequantize_cuda(y, 1, 16, s, 1, nullptr, fs, TF_FLOAT32, nullptr) == TF_ERR_NULL_POINTER,
        "nvfp4 dequantize: no amax");
  CHECK(tf_mxfp8_quantize_cuda(x, static_cast<tf_dtype>(9), 1, 1, 1, TF_FP8_E4M3, y, s, 1, nullptr, nullptr, 0,
                               nullptr) == TF_ERR_BAD_DTYPE,
        "mxfp8: unknown dtype");
}

}  // namespace

int main() {
  test_mxfp8();
  test_fp8_block();
  test_nvfp4();
  test_block_dequantize();
  test_nvfp4_dequantize();
  test_checks();
  std::fprintf(stderr, "(%ld emulated launches)\n", emu_launch_count);
  return check_report();
}
