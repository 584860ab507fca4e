// The fused-op CUDA kernels (csrc/cuda/ops) run on the host through the CUDA
// emulation of this directory and checked against the C core (csrc/ops): RoPE (every layout,
// interleaved, partial, start positions, context parallelism, per-sequence angles, strided bf16
// views) bit for bit, with NaN on the tokens bad cu_seqlens or start_positions misplace; the
// element-wise kernels (every activation, plain and gated, edge values included) bit for bit (same float32 math, no FMA contraction on
// either side), FP8 bytes and amax exactly, dbias/dgamma/dbeta exactly against
// the C core split into the same 64-row bands, and the row statistics of the
// norms (a tree sum on the GPU, a double sum on the CPU) within float32 rounding; cross-entropy's row
// statistics within float32 rounding (tree against sequential sums), its gradient bit for bit.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

extern "C" {
#include "ops/activation.h"
#include "ops/cross_entropy.h"
#include "ops/norm.h"
#include "ops/rope.h"
}
#include "cuda/ops/cross_entropy_cuda.h"
#include "cuda/ops/fused_ops_cuda.h"
#include "cuda/ops/rope_cuda.h"

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

// The same float bits, except that any two NaNs match: which NaN an operation with a NaN operand
// returns depends on the operand order the compiler picked, not on the kernel.
static bool same_floats(const std::vector<float> &a, const std::vector<float> &b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (!(std::isnan(a[i]) && std::isnan(b[i])) && !same_bits(&a[i], &b[i], sizeof(float))) return false;
  return a.size() == b.size();
}

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

// Every activation code, and edge values: zeros, past the exp clamps, huge, infinite and NaN.
static const tf_activation kActs[] = {TF_ACT_NONE, TF_ACT_GELU_TANH, TF_ACT_RELU, TF_ACT_QGELU, TF_ACT_SRELU,
                                      TF_ACT_SILU};
static const float kEdges[] = {0.0f, -0.0f, 60.0f, -60.0f, 100.0f, -100.0f, 1e12f, -1e12f, INFINITY, -INFINITY, NAN};

static void put_edges(std::vector<float> &x, size_t stride) {
  for (size_t i = 0; i < sizeof(kEdges) / sizeof(kEdges[0]) && i * stride < x.size(); ++i) x[i * stride] = kEdges[i];
}

static void test_activations(int64_t rows, int64_t cols) {
  const size_t n = static_cast<size_t>(rows * cols);
  const std::vector<float> finite_x = random_vector(n, 6.0f), dy = random_vector(n, 1.0f);
  const std::vector<float> b = random_vector(static_cast<size_t>(cols), 1.0f);
  std::vector<float> x = finite_x;
  put_edges(x, 7);
  for (tf_activation act : kActs) {
    std::vector<float> y_cpu(n), y_gpu(n);
    uint32_t amax = 0;
    const tf_ops_output cpu_out = {y_cpu.data(), TF_FLOAT32, 0, TF_FP8_E4M3, 1.0f};
    tf_bias_act_forward(x.data(), TF_FLOAT32, b.data(), TF_FLOAT32, rows, cols, 0, rows, act, &cpu_out, &amax);
    const tf_ops_cuda_output gpu_out = {y_gpu.data(), TF_FLOAT32, 0, TF_FP8_E4M3, nullptr, nullptr};
    CHECK(tf_bias_act_forward_cuda(x.data(), TF_FLOAT32, b.data(), TF_FLOAT32, rows, cols, act, &gpu_out,
                                   nullptr) == TF_OK, "forward launch");
    CHECK(same_floats(y_cpu, y_gpu), "forward act %d %lldx%lld", act, (long long)rows,
          (long long)cols);

    std::vector<float> dx_cpu(n), dx_gpu(n), db_cpu(static_cast<size_t>(cols)), db_gpu(static_cast<size_t>(cols));
    cpu_act_backward(dy, x, b, rows, cols, act, dx_cpu, db_cpu);
    std::vector<float> partials(static_cast<size_t>(tf_ops_cuda_bands(rows) * cols));
    const tf_ops_cuda_output gpu_dx = {dx_gpu.data(), TF_FLOAT32, 0, TF_FP8_E4M3, nullptr, nullptr};
    CHECK(tf_act_bias_backward_cuda(dy.data(), TF_FLOAT32, x.data(), TF_FLOAT32, b.data(), TF_FLOAT32, rows, cols,
                                    act, &gpu_dx, partials.data(), db_gpu.data(), TF_FLOAT32, nullptr) == TF_OK,
          "backward launch");
    CHECK(same_floats(dx_cpu, dx_gpu), "dx act %d", act);
    CHECK(same_floats(db_cpu, db_gpu), "dbias act %d", act);
  }

  // FP8 output (finite input, so the amax is a number): the same bytes and amax.
  std::vector<uint8_t> q_cpu(n), q_gpu(n);
  uint32_t amax_bits = 0;
  const tf_ops_output cpu_q = {q_cpu.data(), TF_FLOAT32, 1, TF_FP8_E4M3, 16.0f};
  tf_bias_act_forward(finite_x.data(), TF_FLOAT32, b.data(), TF_FLOAT32, rows, cols, 0, rows, TF_ACT_GELU_TANH, &cpu_q,
                      &amax_bits);
  float scale = 16.0f, amax = 0.0f;
  const tf_ops_cuda_output gpu_q = {q_gpu.data(), TF_FLOAT32, 1, TF_FP8_E4M3, &scale, &amax};
  CHECK(tf_bias_act_forward_cuda(finite_x.data(), TF_FLOAT32, b.data(), TF_FLOAT32, rows, cols, TF_ACT_GELU_TANH, &gpu_q,
                                 nullptr) == TF_OK, "fp8 launch");
  CHECK(same_bits(q_cpu.data(), q_gpu.data(), n), "FP8 bytes");
  CHECK(tf_f32_bits(amax) == amax_bits, "FP8 amax");

  // The gated activations on (rows, 2 * cols).
  const std::vector<float> finite_xs = random_vector(2 * n, 8.0f);
  std::vector<float> xs = finite_xs;
  put_edges(xs, 5);
  for (tf_activation act : kActs) {
    if (act == TF_ACT_NONE) continue;
    std::vector<float> s_cpu(n), s_gpu(n), ds_cpu(2 * n), ds_gpu(2 * n);
    const tf_ops_output s_out = {s_cpu.data(), TF_FLOAT32, 0, TF_FP8_E4M3, 1.0f};
    const tf_ops_output ds_out = {ds_cpu.data(), TF_FLOAT32, 0, TF_FP8_E4M3, 1.0f};
    tf_gated_act_forward(xs.data(), TF_FLOAT32, rows, cols, 0, rows, act, &s_out, &amax_bits);
    tf_gated_act_backward(dy.data(), TF_FLOAT32, xs.data(), TF_FLOAT32, rows, cols, 0, rows, act, &ds_out, &amax_bits);
    const tf_ops_cuda_output sg_out = {s_gpu.data(), TF_FLOAT32, 0, TF_FP8_E4M3, nullptr, nullptr};
    CHECK(tf_gated_act_forward_cuda(xs.data(), TF_FLOAT32, rows, cols, act, &sg_out, nullptr) == TF_OK,
          "gated launch");
    CHECK(tf_gated_act_backward_cuda(dy.data(), TF_FLOAT32, xs.data(), TF_FLOAT32, rows, cols, act, ds_gpu.data(),
                                     nullptr) == TF_OK, "gated backward launch");
    CHECK(same_floats(s_cpu, s_gpu), "gated act %d", act);
    CHECK(same_floats(ds_cpu, ds_gpu), "gated act %d backward", act);
  }

  // The gated forward's FP8 output: the same bytes and amax.
  uint32_t gated_amax_bits = 0;
  const tf_ops_output cpu_gq = {q_cpu.data(), TF_FLOAT32, 1, TF_FP8_E5M2, 2.0f};
  tf_gated_act_forward(finite_xs.data(), TF_FLOAT32, rows, cols, 0, rows, TF_ACT_QGELU, &cpu_gq, &gated_amax_bits);
  float gscale = 2.0f, gamax = 0.0f;
  const tf_ops_cuda_output gpu_gq = {q_gpu.data(), TF_FLOAT32, 1, TF_FP8_E5M2, &gscale, &gamax};
  CHECK(tf_gated_act_forward_cuda(finite_xs.data(), TF_FLOAT32, rows, cols, TF_ACT_QGELU, &gpu_gq, nullptr) == TF_OK,
        "gated fp8 launch");
  CHECK(same_bits(q_cpu.data(), q_gpu.data(), n), "gated FP8 bytes");
  CHECK(tf_f32_bits(gamax) == gated_amax_bits, "gated FP8 amax");
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
  CHECK(tf_bias_act_forward_cuda(x, TF_FLOAT32, nullptr, TF_FLOAT32, 2, 2, TF_ACT_COUNT, &out, nullptr) ==
        TF_ERR_BAD_ARGUMENT, "unknown activation");
  CHECK(tf_gated_act_forward_cuda(x, TF_FLOAT32, 2, 1, TF_ACT_NONE, &out, nullptr) == TF_ERR_BAD_ARGUMENT,
        "a gated activation needs an activation");
  CHECK(tf_gated_act_backward_cuda(x, TF_FLOAT32, x, TF_FLOAT32, 1, INT64_MAX / 2 + 1, TF_ACT_SILU, x, nullptr) ==
        TF_ERR_OVERFLOW, "2 * cols overflows");
}

// A vocabulary shard [vocab_start, vocab_start + cols) of rows x cols logits with ignored, local, remote and
// invalid targets.
static void test_cross_entropy(int64_t rows, int64_t cols) {
  const int64_t vocab_start = cols, vocab_size = 3 * cols, ignore = -100;
  const size_t n = static_cast<size_t>(rows * cols);
  std::vector<float> x = random_vector(n, 20.0f);
  x[3] = -INFINITY;
  std::vector<int64_t> target(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) target[r] = (r * 7919) % vocab_size;  // local and remote classes
  target[0] = ignore;
  target[1] = vocab_start + cols - 1;
  std::vector<float> cpu(4 * static_cast<size_t>(rows)), gpu(cpu.size());
  CHECK(tf_cross_entropy_stats(x.data(), TF_FLOAT32, rows, cols, target.data(), vocab_start, vocab_size, ignore, 0,
                               rows, cpu.data()) == TF_OK, "cross-entropy stats (C core)");
  CHECK(tf_cross_entropy_stats_cuda(x.data(), TF_FLOAT32, rows, cols, target.data(), vocab_start, vocab_size, ignore,
                                    gpu.data(), nullptr) == TF_OK, "cross-entropy stats launch");
  bool close = true;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const bool exact = i % 4 == 0 || i % 4 == 2;  // the max and the target logit are read, not summed
    close &= exact ? same_bits(&cpu[i], &gpu[i], sizeof(float))
                   : cpu[i] == gpu[i] || std::fabs(cpu[i] - gpu[i]) <= 1e-5f * (std::fabs(cpu[i]) + 1.0f) * static_cast<float>(cols);
  }
  CHECK(close, "cross-entropy stats of %lld x %lld", static_cast<long long>(rows), static_cast<long long>(cols));

  std::vector<float> lse(static_cast<size_t>(rows)), scale(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) lse[r] = cpu[4 * r] + std::log(cpu[4 * r + 1]), scale[r] = rand_f(2.0f);
  std::vector<float> dx_cpu(n), dx_gpu(n);
  CHECK(tf_cross_entropy_backward(x.data(), TF_FLOAT32, rows, cols, target.data(), vocab_start, vocab_size, ignore,
                                  lse.data(), scale.data(), 0.01f, 0.9f, 0, rows, dx_cpu.data(), TF_FLOAT32) == TF_OK,
        "cross-entropy backward (C core)");
  CHECK(tf_cross_entropy_backward_cuda(x.data(), TF_FLOAT32, rows, cols, target.data(), vocab_start, vocab_size,
                                       ignore, lse.data(), scale.data(), 0.01f, 0.9f, dx_gpu.data(), nullptr) == TF_OK,
        "cross-entropy backward launch");
  CHECK(same_floats(dx_cpu, dx_gpu), "cross-entropy gradient bits");

  // An invalid target: the C core refuses the call, the CUDA kernels mark the row with NaN.
  target[2] = vocab_size;
  CHECK(tf_cross_entropy_stats_cuda(x.data(), TF_FLOAT32, rows, cols, target.data(), vocab_start, vocab_size, ignore,
                                    gpu.data(), nullptr) == TF_OK && std::isnan(gpu[4 * 2 + 2]),
        "an invalid target gives a NaN target logit");
  CHECK(tf_cross_entropy_backward_cuda(x.data(), TF_FLOAT32, rows, cols, target.data(), vocab_start, vocab_size,
                                       ignore, lse.data(), scale.data(), 0.0f, 1.0f, dx_gpu.data(), nullptr) == TF_OK &&
            std::isnan(dx_gpu[2 * cols]),
        "and a NaN gradient");
  CHECK(tf_cross_entropy_stats_cuda(x.data(), TF_FLOAT32, rows, cols, target.data(), vocab_size - cols + 1, vocab_size,
                                    ignore, gpu.data(), nullptr) == TF_ERR_BAD_SIZE,
        "a shard past the vocabulary's end");
}

// A RoPE problem run by the C core and by the CUDA kernel: the same bits (any NaN matching any NaN).
static void rope_compare(const tf_rope_problem &p, tf_dtype dtype, bool padded, const char *what) {
  const int64_t tokens = tf_rope_tokens(&p);
  const bool thd = p.format == TF_ROPE_THD;
  const int64_t dpad = padded ? 2 : 1, per_token = p.heads * p.dim * dpad + (padded ? 5 : 0);
  int64_t xs[4] = {per_token, 0, p.dim * dpad, dpad}, ys[4] = {p.heads * p.dim, 0, p.dim, 1};
  if (!thd) {
    const bool sbhd = p.format == TF_ROPE_SBHD;
    xs[sbhd ? 1 : 0] = per_token;
    xs[sbhd ? 0 : 1] = per_token * (sbhd ? p.batch : p.seq);
    ys[sbhd ? 1 : 0] = p.heads * p.dim;
    ys[sbhd ? 0 : 1] = p.heads * p.dim * (sbhd ? p.batch : p.seq);
  }
  const size_t n_in = static_cast<size_t>(tokens * per_token + 8), n_out = static_cast<size_t>(tokens * p.heads * p.dim);
  std::vector<float> x = random_vector(n_in, 3.0f);
  std::vector<uint16_t> x16(n_in);
  for (size_t i = 0; i < n_in; ++i) x16[i] = dtype == TF_BFLOAT16 ? tf_f32_to_bf16(x[i]) : tf_f32_to_f16(x[i]);
  const void *xp = dtype == TF_FLOAT32 ? static_cast<const void *>(x.data()) : x16.data();
  const size_t es = dtype == TF_FLOAT32 ? 4 : 2;
  for (int backward = 0; backward < 2; ++backward) {
    std::vector<uint8_t> cpu(n_out * es), gpu(n_out * es, 0xAB);
    const tf_status cs = backward ? tf_rope_backward(&p, dtype, xp, xs, cpu.data(), ys, 0, tokens)
                                  : tf_rope_forward(&p, dtype, xp, xs, cpu.data(), ys, 0, tokens);
    const tf_status gs = backward ? tf_rope_backward_cuda(&p, dtype, xp, xs, gpu.data(), ys, nullptr)
                                  : tf_rope_forward_cuda(&p, dtype, xp, xs, gpu.data(), ys, nullptr);
    CHECK(cs == TF_OK && gs == TF_OK, "%s: statuses %d %d", what, cs, gs);
    bool same = true;
    for (size_t i = 0; i < n_out; ++i) {
      const float a = dtype == TF_FLOAT32 ? reinterpret_cast<const float *>(cpu.data())[i]
                                          : (dtype == TF_BFLOAT16 ? tf_bf16_to_f32 : tf_f16_to_f32)(
                                                reinterpret_cast<const uint16_t *>(cpu.data())[i]);
      const float b = dtype == TF_FLOAT32 ? reinterpret_cast<const float *>(gpu.data())[i]
                                          : (dtype == TF_BFLOAT16 ? tf_bf16_to_f32 : tf_f16_to_f32)(
                                                reinterpret_cast<const uint16_t *>(gpu.data())[i]);
      if (!(std::isnan(a) && std::isnan(b)) && !same_bits(&a, &b, sizeof a)) same = false;
    }
    CHECK(same, "%s: %s differs from the C core", what, backward ? "backward" : "forward");
  }
}

static void test_rope() {
  static const int32_t cu[] = {0, 5, 5, 12, 13}, cu_cp[] = {0, 8, 8, 20, 32}, start[] = {2, 0, 1, 3};
  std::vector<float> freqs = random_vector(16 * 4 * 16, 40.0f);
  char what[120];
  for (int fmt = 0; fmt < 3; ++fmt)
    for (int inter = 0; inter < 2; ++inter)
      for (int mode = 0; mode < 4; ++mode) {  // plain, start positions + per-sequence angles, cp rank 0, cp rank 1
        const bool thd = fmt == TF_ROPE_THD, cp = mode >= 2;
        tf_rope_problem p = {static_cast<tf_rope_format>(fmt), 6, 4, 3, 20, mode == 1 ? 12 : 20, inter,
                             freqs.data(), 12, mode == 1 ? 4 : 1, nullptr, mode == 1 ? start : nullptr,
                             cp ? 2 : 1, mode == 3};
        if (thd) {
          p.cu_seqlens = cp ? cu_cp : cu;
          p.seq = cp ? 16 : 13;
        }
        for (int d = 0; d < 2; ++d) {
          std::snprintf(what, sizeof what, "rope format %d interleaved %d mode %d dtype %d", fmt, inter, mode, d);
          rope_compare(p, d ? TF_BFLOAT16 : TF_FLOAT32, (mode + d) % 2 == 1, what);
        }
      }
  // misplaced tokens: NaN on the GPU (which does not read the device arrays on the host), refusal on the CPU
  static const int32_t cu_bad[] = {3, 8, 13}, start_far[] = {0, 9, 0, 0};
  tf_rope_problem bad = {TF_ROPE_THD, 13, 2, 2, 8, 8, 0, freqs.data(), 12, 1, cu_bad, nullptr, 1, 0};
  CHECK(tf_rope_check(&bad) == TF_ERR_BAD_ARGUMENT && tf_rope_check_shape(&bad) == TF_OK, "bad cu_seqlens");
  tf_rope_problem far = {TF_ROPE_SBHD, 6, 4, 2, 8, 8, 0, freqs.data(), 12, 1, nullptr, start_far, 1, 0};
  CHECK(tf_rope_check(&far) == TF_ERR_BAD_SIZE && tf_rope_check_shape(&far) == TF_OK, "start past freqs");
  const int64_t st_thd[4] = {16, 0, 8, 1}, st_sbhd[4] = {64, 16, 8, 1};
  std::vector<float> x = random_vector(13 * 16, 1.0f), y(13 * 16);
  CHECK(tf_rope_forward_cuda(&bad, TF_FLOAT32, x.data(), st_thd, y.data(), st_thd, nullptr) == TF_OK, "bad cu launch");
  bool nan_ok = true;  // tokens 0-2 lie before the first sequence (cu_seqlens[0] = 3)
  for (int t = 0; t < 13; ++t)
    for (int c = 0; c < 16; ++c) nan_ok = nan_ok && (std::isnan(y[t * 16 + c]) == (t < 3));
  CHECK(nan_ok, "tokens outside every sequence give NaN, and only they");
  std::vector<float> xs(6 * 4 * 16, 1.0f), ysb(6 * 4 * 16);
  CHECK(tf_rope_forward_cuda(&far, TF_FLOAT32, xs.data(), st_sbhd, ysb.data(), st_sbhd, nullptr) == TF_OK,
        "far start launch");
  bool far_ok = true;
  for (int s = 0; s < 6; ++s)
    for (int b = 0; b < 4; ++b)
      for (int c = 0; c < 16; ++c) far_ok = far_ok && (std::isnan(ysb[s * 64 + b * 16 + c]) == (b == 1 && s >= 3));
  CHECK(far_ok, "positions past freqs give NaN, and only there");
  // host-side refusals, before any device pointer is read
  tf_rope_problem empty_thd = {TF_ROPE_THD, 4, 0, 2, 8, 8, 0, freqs.data(), 12, 1, cu, nullptr, 1, 0};
  CHECK(tf_rope_forward_cuda(&empty_thd, TF_FLOAT32, x.data(), st_thd, y.data(), st_thd, nullptr) ==
        TF_ERR_BAD_ARGUMENT, "thd tokens without sequences");
  const int64_t huge[4] = {INT64_MAX / 2, 16, 8, 1};
  CHECK(tf_rope_forward_cuda(&far, TF_FLOAT32, xs.data(), huge, ysb.data(), st_sbhd, nullptr) == TF_ERR_OVERFLOW,
        "strides overflow");
  CHECK(tf_rope_backward_cuda(&far, TF_FLOAT32, nullptr, st_sbhd, ysb.data(), st_sbhd, nullptr) == TF_ERR_NULL_POINTER,
        "NULL dy");
}

int main() {
  test_activations(70, 300);  // two row bands, two column blocks, ragged tails
  test_activations(1, 5);
  test_norms(9, 600);         // rows longer than a block
  test_cross_entropy(11, 700);  // rows longer than a block, ragged
  test_cross_entropy(3, 5);
  test_norms(130, 33);        // three bands of rows
  test_checks();
  test_rope();
  return check_report();
}
