// The CUDA launchers of csrc/cuda/fp8, run under the host emulation
// (cuda_runtime.h here), against the C core: the same bytes, amax bits and
// scales for vector bodies and tails, misaligned input and output pointers,
// partial tiles and strided rows, and grids smaller than the work.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "cuda/fp8/fp8_cuda.h"
extern "C" {
#include "fp8/fp8_quantize.h"
}

namespace {

#include "../check.h"

uint64_t rng = 88172645463325252ull;
uint32_t rand_u32() {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return static_cast<uint32_t>(rng);
}

// Mostly values around the FP8 range; some arbitrary bit patterns (Inf, NaN, subnormals).
float rand_float() {
  uint32_t u = rand_u32();
  if (rand_u32() % 4 != 0) u = (u & 0x807FFFFFu) | ((100u + rand_u32() % 45u) << 23);
  return tf_f32_from_bits(u);
}

size_t elem_size(tf_dtype d) { return d == TF_FLOAT32 ? 4 : 2; }

void fill(uint8_t *p, size_t count, tf_dtype d) {
  for (size_t i = 0; i < count; ++i) {
    const float f = rand_float();
    if (d == TF_FLOAT32) {
      std::memcpy(p + 4 * i, &f, 4);
    } else {
      uint16_t h = d == TF_BFLOAT16 ? tf_f32_to_bf16(f) : tf_f32_to_f16(f);
      if (rand_u32() % 50 == 0) h = static_cast<uint16_t>(rand_u32());
      std::memcpy(p + 2 * i, &h, 2);
    }
  }
}

// A buffer whose data() is 16-byte aligned.
struct Aligned {
  std::vector<uint8_t> storage;
  uint8_t *data;
  explicit Aligned(size_t bytes) : storage(bytes + 16) {
    data = reinterpret_cast<uint8_t *>((reinterpret_cast<uintptr_t>(storage.data()) + 15) & ~uintptr_t{15});
  }
};

const tf_dtype kDtypes[3] = {TF_FLOAT32, TF_BFLOAT16, TF_FLOAT16};
const tf_fp8_format kFormats[2] = {TF_FP8_E4M3, TF_FP8_E5M2};

void test_elementwise() {
  for (tf_dtype d : kDtypes)
    for (tf_fp8_format f : kFormats)
      for (int64_t n : {0, 1, 9, 17, 4097, 40001})
        for (const auto &[x_off, y_off] : {std::pair{0, 0}, std::pair{1, 0}, std::pair{3, 2}}) {
            const size_t es = elem_size(d);
            Aligned xb((n + 4) * es), yb(n + 4), out(static_cast<size_t>(n + 4) * es);
            uint8_t *x = xb.data + x_off * es;
            uint8_t *y = yb.data + y_off;
            fill(x, n, d);
            std::vector<uint8_t> y_ref(n + 1), out_ref((n + 1) * es);
            const float scale = rand_u32() % 2 ? 0.37f : 2.0f;
            float amax = n % 2 ? -0.5f : 0.0f;  // a negative stored amax counts by its magnitude
            uint32_t amax_ref = 0;
            CHECK(tf_fp8_quantize_cuda(x, d, n, &scale, f, y, &amax, nullptr) == TF_OK, "quantize");
            CHECK(tf_fp8_quantize(x, d, 0, n, scale, f, y_ref.data(), &amax_ref) == TF_OK, "C");
            const uint32_t start = n % 2 ? tf_f32_bits(0.5f) : 0u;
            CHECK(std::memcmp(y, y_ref.data(), n) == 0, "quantize bytes dtype %d format %d n %ld x+%d y+%d",
                  d, f, static_cast<long>(n), x_off, y_off);
            CHECK(tf_f32_bits(amax) == (amax_ref > start ? amax_ref : start), "quantize amax n %ld",
                  static_cast<long>(n));
            float plain_amax = 0.0f;
            CHECK(tf_fp8_amax_cuda(x, d, n, &plain_amax, nullptr) == TF_OK &&
                      tf_f32_bits(plain_amax) == amax_ref,
                  "amax dtype %d n %ld", d, static_cast<long>(n));
            const float scale_inv = 1.0f / scale;
            uint8_t *o = out.data + x_off * es;
            CHECK(tf_fp8_dequantize_cuda(y, f, n, &scale_inv, o, d, nullptr) == TF_OK, "dequantize");
            CHECK(tf_fp8_dequantize(y, f, 0, n, scale_inv, out_ref.data(), d) == TF_OK, "C");
            CHECK(std::memcmp(o, out_ref.data(), n * es) == 0, "dequantize dtype %d format %d n %ld", d, f,
                  static_cast<long>(n));
          }
}

void test_cast_transpose() {
  const int64_t shapes[][3] = {{1, 1, 1},   {31, 33, 33},  {32, 32, 40}, {33, 31, 31}, {65, 127, 130},
                               {100, 1, 1}, {1, 100, 100}, {0, 9, 9},    {9, 0, 0},    {300, 77, 80}};
  for (const auto &shape : shapes)
    for (tf_dtype d : kDtypes) {
      const int64_t rows = shape[0], cols = shape[1], ld = shape[2];
      Aligned x(static_cast<size_t>(rows * ld + 1) * elem_size(d));
      fill(x.data, rows * ld, d);
      const size_t bytes = rows * cols + 1;
      std::vector<uint8_t> y(bytes, 0xAA), y_t(bytes, 0xAA), y_ref(bytes, 0x55), y_t_ref(bytes, 0x55);
      const float scale = 1.7f;
      float amax = 0.25f;
      uint32_t amax_ref = 0;
      CHECK(tf_fp8_cast_transpose_cuda(x.data, d, rows, cols, ld, &scale, TF_FP8_E4M3, y.data(), y_t.data(),
                                       &amax, nullptr) == TF_OK,
            "cast_transpose");
      CHECK(tf_fp8_cast_transpose(x.data, d, rows, cols, ld, 0, rows, scale, TF_FP8_E4M3, y_ref.data(),
                                  y_t_ref.data(), &amax_ref) == TF_OK,
            "C");
      CHECK(std::memcmp(y.data(), y_ref.data(), rows * cols) == 0 &&
                std::memcmp(y_t.data(), y_t_ref.data(), rows * cols) == 0,
            "cast_transpose bytes %ld x %ld (stride %ld) dtype %d", static_cast<long>(rows),
            static_cast<long>(cols), static_cast<long>(ld), d);
      const uint32_t start = tf_f32_bits(0.25f);
      CHECK(tf_f32_bits(amax) == (amax_ref > start ? amax_ref : start), "cast_transpose amax");
    }
}

void test_scaling() {
  for (int64_t len : {1, 2, 7})
    for (int64_t n : {1, 5, 600})
      for (tf_amax_algo algo : {TF_AMAX_MAX, TF_AMAX_MOST_RECENT}) {
        std::vector<float> h(len * n), s(n), si(n);
        for (float &v : h) v = rand_u32() % 5 == 0 ? tf_f32_from_bits(rand_u32()) : rand_float();
        for (int64_t j = 0; j < n; j += 3) h[j] = 0.0f;  // tensors that recorded nothing
        for (float &v : s) v = rand_float();
        std::vector<float> h_ref = h, s_ref = s, si_ref = si;
        CHECK(tf_fp8_delayed_scaling_update_cuda(h.data(), len, n, s.data(), si.data(), 448.0f, 1, algo,
                                                 nullptr) == TF_OK,
              "delayed");
        CHECK(tf_fp8_delayed_scaling_update(h_ref.data(), len, n, s_ref.data(), si_ref.data(), 448.0f, 1, algo) ==
                  TF_OK,
              "C");
        CHECK(std::memcmp(h.data(), h_ref.data(), 4 * len * n) == 0, "history");
        CHECK(std::memcmp(s.data(), s_ref.data(), 4 * n) == 0 && std::memcmp(si.data(), si_ref.data(), 4 * n) == 0,
              "delayed update history %ld x %ld", static_cast<long>(len), static_cast<long>(n));
      }
  for (float a : {0.0f, 3.0f, 1e-45f, 1e-6f, 448.0f}) {
    float s = 0.0f, s_inv = 0.0f;
    CHECK(tf_fp8_current_scale_cuda(&a, 448.0f, 1e-3f, 1, &s, &s_inv, nullptr) == TF_OK &&
              s == tf_fp8_current_scale(a, 448.0f, 1e-3f, 1) && s_inv == 1.0f / s,
          "current scale of %g", static_cast<double>(a));
  }
}

}  // namespace

int main() {
  test_elementwise();
  test_cast_transpose();
  test_scaling();
  std::fprintf(stderr, "(%ld emulated launches)\n", emu_launch_count);
  return check_report();
}
