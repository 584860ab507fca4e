// The fused-op CUDA kernels (csrc/cuda/ops) run on the host through the CUDA
// emulation of this directory and checked against the C core (csrc/ops): the
// element-wise kernels bit for bit (same float32 math, no FMA contraction on
// either side), FP8 bytes and amax exactly, dbias/dgamma/dbeta exactly against
// the C core split into the same 64-row bands, and the row statistics of the
// norms (a tree sum on the GPU, a double sum on the CPU) within float32 rounding.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

extern "C" {
#include "ops/activation.h"
#include "ops/norm.h"
}
#include "cuda/ops/fused_ops_cuda.h"

#include "../check.h"

static uint64_t rng_state = 0x13198A2E03707344ull;
static float rand_f(float scale) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  const uint32_t bits = static_cast<uint32_t>((rng_state * 0x2545F4914F6CDD1Dull) >> 40);
  return (static_cast<float>(bits) / static_cast<float>(1u << 24) * 2.0f - 1.0f) * scale;
}

static std::vector<float> random_vector(size_t n, float scale) {
  std::vector<float> v(n);
  for (float &x : v) x = rand_f(scale);
  return v;
}

static bool same_bits(const void *a, const void *b, size_t bytes) { return std::memcmp(a, b, bytes) == 0; }

static double max_abs_diff(const std::vector<float> &a, const std::vector<float> &b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) m = std::fmax(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}

// The C core over 64-row bands with partial sums combined in order, like the CUDA path.
static void cpu_act_backward(const std::vector<float> &dy, const std::vector<float> &x, const std::vector<float> &b,
                             int64_t rows, int64_t cols, tf_activation act, std::vector<float> &dx,
                             std::vector<float> &db) {
  const int64_t bands = tf_ops_cuda_bands(rows);
  std::vector<float> partials(static_cast<size_t>(bands * cols));
  const tf_ops_output out = {dx.data(), TF_FLOAT32, 0, TF_FP8_E4M3, 1.0f};
  for (int64_t k = 0; k < bands; ++k) {
    uint32_t amax = 0;
    const int64_t r0 = k * TF_OPS_CUDA_BAND_ROWS, r1 = std::min(rows, r0 + TF_OPS_CUDA_BAND_ROWS);
    tf_act_bias_backward(dy.data(), TF_FLOAT32, x.data(), TF_FLOAT32, b.data(), TF_FLOAT32, rows, cols, r0, r1, act,
                         &out, partials.data() + k * cols, &amax);
  }
  tf_ops_sum_partials(partials.data(), bands, cols, 0, cols, db.data(), TF_FLOAT32);
}

static void test_activations(int64_t rows, int64_t cols) {
  const size_t n = static_cast<size_t>(rows * cols);
  const std::vector<float> x = random_vector(n, 6.0f), dy = random_vector(n, 1.0f);
  const std::vector<float> b = random_vector(static_cast<size_t>(cols), 1.0f);
  for (tf_activation act : {TF_ACT_NONE, TF_ACT_GELU_TANH, TF_ACT_RELU}) {
    std::vector<float> y_cpu(n), y_gpu(n);
    uint32_t amax = 0;
    const tf_ops_output cpu_out = {y_cpu.data(), TF_FLOAT32, 0, TF_FP8_E4M3, 1.0f};
    tf_bias_act_forward(x.data(), TF_FLOAT32, b.data(), TF_FLOAT32, rows, cols, 0, rows, act, &cpu_out, &amax);
    const tf_ops_cuda_output gpu_out = {y_gpu.data(), TF_FLOAT32, 0, TF_FP8_E4M3, nullptr, nullptr};
    CHECK(tf_bias_act_forward_cuda(x.data(), TF_FLOAT32, b.data(), TF_FLOAT32, rows, cols, act, &gpu_out,
                                   nullptr) == TF_OK, "forward launch");
    CHECK(same_bits(y_cpu.data(), y_gpu.data(), n * 4), "forward act %d %lldx%lld", act, (long long)rows,
          (long long)cols);

    std::vector<float> dx_cpu(n), dx_gpu(n), db_cpu(static_cast<size_t>(cols)), db_gpu(static_cast<size_t>(cols));
    cpu_act_backward(dy, x, b, rows, cols, act, dx_cpu, db_cpu);
    std::vector<float> partials(static_cast<size_t>(tf_ops_cuda_bands(rows) * cols));
    const tf_ops_cuda_output gpu_dx = {dx_gpu.data(), TF_FLOAT32, 0, TF_FP8_E4M3, nullptr, nullptr};
    CHECK(tf_act_bias_backward_cuda(dy.data(), TF_FLOAT32, x.data(), TF_FLOAT32, b.data(), TF_FLOAT32, rows, cols,
                                    act, &gpu_dx, partials.data(), db_gpu.data(), TF_FLOAT32, nullptr) == TF_OK,
          "backward launch");
    CHECK(same_bits(dx_cpu.data(), dx_gpu.data(), n * 4), "dx act %d", act);
    CHECK(same_bits(db_cpu.data(), db_gpu.data(), db_cpu.size() * 4), "dbias act %d", act);
  }

  // FP8 output: the same bytes and amax.
  std::vector<uint8_t> q_cpu(n), q_gpu(n);
  uint32_t amax_bits = 0;
  const tf_ops_output cpu_q = {q_cpu.data(), TF_FLOAT32, 1, TF_FP8_E4M3, 16.0f};
  tf_bias_act_forward(x.data(), TF_FLOAT32, b.data(), TF_FLOAT32, rows, cols, 0, rows, TF_ACT_GELU_TANH, &cpu_q,
                      &amax_bits);
  float scale = 16.0f, amax = 0.0f;
  const tf_ops_cuda_output gpu_q = {q_gpu.data(), TF_FLOAT32, 1, TF_FP8_E4M3, &scale, &amax};
  CHECK(tf_bias_act_forward_cuda(x.data(), TF_FLOAT32, b.data(), TF_FLOAT32, rows, cols, TF_ACT_GELU_TANH, &gpu_q,
                                 nullptr) == TF_OK, "fp8 launch");
  CHECK(same_bits(q_cpu.data(), q_gpu.data(), n), "FP8 bytes");
  CHECK(tf_f32_bits(amax) == amax_bits, "FP8 amax");

  // SwiGLU on (rows, 2 * cols).
  const std::vector<float> xs = random_vector(2 * n, 8.0f);
  std::vector<float> s_cpu(n), s_gpu(n), ds_cpu(2 * n), ds_gpu(2 * n);
  const tf_ops_output s_out = {s_cpu.data(), TF_FLOAT32, 0, TF_FP8_E4M3, 1.0f};
  const tf_ops_output ds_out = {ds_cpu.data(), TF_FLOAT32, 0, TF_FP8_E4M3, 1.0f};
  tf_swiglu_forward(xs.data(), TF_FLOAT32, rows, cols, 0, rows, &s_out, &amax_bits);
  tf_swiglu_backward(dy.data(), TF_FLOAT32, xs.data(), TF_FLOAT32, rows, cols, 0, rows, &ds_out, &amax_bits);
  const tf_ops_cuda_output sg_out = {s_gpu.data(), TF_FLOAT32, 0, TF_FP8_E4M3, nullptr, nullptr};
  CHECK(tf_swiglu_forward_cuda(xs.data(), TF_FLOAT32, rows, cols, &sg_out, nullptr) == TF_OK, "swiglu launch");
  CHECK(tf_swiglu_backward_cuda(dy.data(), TF_FLOAT32, xs.data(), TF_FLOAT32, rows, cols, ds_gpu.data(), nullptr) ==
        TF_OK, "swiglu backward launch");
  CHECK(same_bits(s_cpu.data(), s_gpu.data(), n * 4), "swiglu");
  CHECK(same_bits(ds_cpu.data(), ds_gpu.data(), 2 * n * 4), "swiglu backward");
}

static void test_norms(int64_t rows, int64_t cols) {
  const size_t n = static_cast<size_t>(rows * cols);
  const std::vector<float> x = random_vector(n, 2.0f), dy = random_vector(n, 1.0f);
  std::vector<float> w = random_vector(static_cast<size_t>(cols), 1.0f), b = random_vector(static_cast<size_t>(cols), 1.0f);
  for (int layer : {0, 1}) {
    std::vector<float> y_cpu(n), y_gpu(n), mean_cpu(rows), mean_gpu(rows), rstd_cpu(rows), rstd_gpu(rows);
    uint32_t amax = 0;
    const tf_ops_output cpu_out = {y_cpu.data(), TF_FLOAT32, 0, TF_FP8_E4M3, 1.0f};
    if (layer)
      tf_layernorm_forward(x.data(), TF_FLOAT32, w.data(), b.data(), TF_FLOAT32, 0, 1e-5f, rows, cols, 0, rows,
                           &cpu_out, mean_cpu.data(), rstd_cpu.data(), &amax);
    else
      tf_rmsnorm_forward(x.data(), TF_FLOAT32, w.data(), TF_FLOAT32, 0, 1e-5f, rows, cols, 0, rows, &cpu_out,
                         rstd_cpu.data(), &amax);
    const tf_ops_cuda_output gpu_out = {y_gpu.data(), TF_FLOAT32, 0, TF_FP8_E4M3, nullptr, nullptr};
    CHECK(tf_norm_forward_cuda(x.data(), TF_FLOAT32, w.data(), layer ? b.data() : nullptr, TF_FLOAT32, 0, 1e-5f,
                               rows, cols, &gpu_out, layer ? mean_gpu.data() : nullptr, rstd_gpu.data(),
                               nullptr) == TF_OK, "norm forward launch");
    CHECK(max_abs_diff(y_cpu, y_gpu) < 2e-5, "norm %d forward: %g", layer, max_abs_diff(y_cpu, y_gpu));
    CHECK(max_abs_diff(rstd_cpu, rstd_gpu) < 2e-5, "norm %d rstd", layer);

    std::vector<float> dx_cpu(n), dx_gpu(n), dg_cpu(cols), dg_gpu(cols), db_cpu(cols), db_gpu(cols);
    std::vector<float> pg(cols), pb(cols), partials(static_cast<size_t>(2 * tf_ops_cuda_bands(rows) * cols));
    if (layer)
      tf_layernorm_backward(dy.data(), TF_FLOAT32, x.data(), TF_FLOAT32, mean_cpu.data(), rstd_cpu.data(), w.data(),
                            TF_FLOAT32, 0, rows, cols, 0, rows, dx_cpu.data(), TF_FLOAT32, dg_cpu.data(),
                            db_cpu.data());
    else
      tf_rmsnorm_backward(dy.data(), TF_FLOAT32, x.data(), TF_FLOAT32, rstd_cpu.data(), w.data(), TF_FLOAT32, 0,
                          rows, cols, 0, rows, dx_cpu.data(), TF_FLOAT32, dg_cpu.data());
    CHECK(tf_norm_backward_cuda(dy.data(), TF_FLOAT32, x.data(), TF_FLOAT32, layer ? mean_cpu.data() : nullptr,
                                rstd_cpu.data(), w.data(), TF_FLOAT32, 0, rows, cols, dx_gpu.data(), partials.data(),
                                dg_gpu.data(), layer ? db_gpu.data() : nullptr, nullptr) == TF_OK,
          "norm backward launch");
    CHECK(max_abs_diff(dx_cpu, dx_gpu) < 1e-4, "norm %d dx: %g", layer, max_abs_diff(dx_cpu, dx_gpu));
    CHECK(max_abs_diff(dg_cpu, dg_gpu) < 1e-3, "norm %d dgamma: %g", layer, max_abs_diff(dg_cpu, dg_gpu));
    if (layer) CHECK(max_abs_diff(db_cpu, db_gpu) < 1e-3, "dbeta: %g", max_abs_diff(db_cpu, db_gpu));
  }
}

static void test_checks() {
  float x[4] = {0};
  const tf_ops_cuda_output out = {x, TF_FLOAT32, 0, TF_FP8_E4M3, nullptr, nullptr};
  const tf_ops_cuda_output fp8_without_scale = {x, TF_FLOAT32, 1, TF_FP8_E4M3, nullptr, nullptr};
  CHECK(tf_bias_act_forward_cuda(x, TF_FLOAT32, nullptr, TF_FLOAT32, -1, 2, TF_ACT_NONE, &out, nullptr) ==
        TF_ERR_BAD_SIZE, "negative rows");
  CHECK(tf_bias_act_forward_cuda(x, TF_FLOAT32, nullptr, TF_FLOAT32, INT64_MAX / 2, 4, TF_ACT_NONE, &out,
                                 nullptr) == TF_ERR_OVERFLOW, "rows * cols overflows");
  CHECK(tf_bias_act_forward_cuda(x, TF_FLOAT32, nullptr, TF_FLOAT32, 2, 2, TF_ACT_NONE, &fp8_without_scale,
                                 nullptr) == TF_ERR_NULL_POINTER, "FP8 output without scale");
  CHECK(tf_act_bias_backward_cuda(x, TF_FLOAT32, x, TF_FLOAT32, nullptr, TF_FLOAT32, 2, 2, TF_ACT_NONE, &out,
                                  nullptr, x, TF_FLOAT32, nullptr) == TF_ERR_NULL_POINTER, "dbias without partials");
  CHECK(tf_norm_forward_cuda(x, TF_FLOAT32, x, nullptr, TF_FLOAT32, 0, -1.0f, 2, 2, &out, nullptr, x, nullptr) ==
        TF_ERR_BAD_ARGUMENT, "negative eps");
}

int main() {
  test_activations(70, 300);  // two row bands, two column blocks, ragged tails
  test_activations(1, 5);
  test_norms(9, 600);         // rows longer than a block
  test_norms(130, 33);        // three bands of rows
  test_checks();
  return check_report();
}
