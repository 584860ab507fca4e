/*
 * Fused element-wise activation kernels on the CPU: bias + activation forward,
 * activation gradient + bias gradient in one pass, and the gated activations
 * (GEGLU, ReGLU, QGEGLU, SReGLU, SwiGLU).
 *
 * Inputs are row-major rows x cols matrices (float32, bfloat16 or float16);
 * math is float32. Each call handles the rows [row_begin, row_end) so the
 * caller can spread row bands over threads. Forward outputs may be FP8
 * directly (see tf_ops_output); *amax_bits then receives the bit pattern of
 * the largest |value| written in the band (0 when the output is not FP8),
 * combined across bands with an unsigned max.
 *
 * The activations are TransformerEngine's (their math: ops_math.h). GELU is the
 * tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), the form
 * Megatron/TransformerEngine use, equal to torch.nn.functional.gelu(x, approximate="tanh").
 */
#ifndef TF_OPS_ACTIVATION_H
#define TF_OPS_ACTIVATION_H

#include <stdint.h>

#include "../common/tf_dtype.h"
#include "../common/tf_status.h"
#include "ops_io.h"

typedef enum tf_activation {
  TF_ACT_NONE = 0,      /* identity: the kernel is a bias add (and cast) */
  TF_ACT_GELU_TANH = 1, /* gelu, tanh approximation */
  TF_ACT_RELU = 2,      /* relu: x > 0 ? x : 0 (NaN gives 0, as TE's fmaxf) */
  TF_ACT_QGELU = 3,     /* qgelu: x sigmoid(1.702 x) */
  TF_ACT_SRELU = 4,     /* srelu: relu(x)^2 */
  TF_ACT_SILU = 5,      /* silu: x sigmoid(x) */
  TF_ACT_COUNT = 6      /* the number of codes, not an activation */
} tf_activation;

/* Whether act is one of the codes above (TF_ACT_NONE included). */
static inline int tf_activation_known(int64_t act) { return act >= TF_ACT_NONE && act < TF_ACT_COUNT; }

/* y = act(x + bias); bias (cols elements of bias_dtype) may be NULL. */
tf_status tf_bias_act_forward(const void *x, tf_dtype dtype, const void *bias, tf_dtype bias_dtype,
                              int64_t rows, int64_t cols, int64_t row_begin, int64_t row_end,
                              tf_activation act, const tf_ops_output *y, uint32_t *amax_bits);

/*
 * dx = dy * act'(x + bias) (x is the activation's input before the bias add;
 * bias may be NULL). When dbias_partial is not NULL it receives, for each
 * column, the sum of dx over the band's rows in row order (cols float32,
 * overwritten): bands combined in a fixed order give a deterministic dbias.
 */
tf_status tf_act_bias_backward(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                               const void *bias, tf_dtype bias_dtype, int64_t rows, int64_t cols,
                               int64_t row_begin, int64_t row_end, tf_activation act,
                               const tf_ops_output *dx, float *dbias_partial, uint32_t *amax_bits);

/*
 * A gated activation on x of rows x (2 * cols): with a = x[:, :cols] and g = x[:, cols:],
 * y = act(a) * g (rows x cols). TransformerEngine's order (the activation applies to the first
 * half): geglu is TF_ACT_GELU_TANH, reglu TF_ACT_RELU, qgeglu TF_ACT_QGELU, sreglu TF_ACT_SRELU,
 * swiglu TF_ACT_SILU. TF_ACT_NONE is refused (TF_ERR_BAD_ARGUMENT).
 */
tf_status tf_gated_act_forward(const void *x, tf_dtype dtype, int64_t rows, int64_t cols,
                               int64_t row_begin, int64_t row_end, tf_activation act,
                               const tf_ops_output *y, uint32_t *amax_bits);

/* dx (rows x 2 cols) of tf_gated_act_forward: dx_a = act'(a) * (dy * g), dx_g = dy * act(a). */
tf_status tf_gated_act_backward(const void *dy, tf_dtype dy_dtype, const void *x, tf_dtype dtype,
                                int64_t rows, int64_t cols, int64_t row_begin, int64_t row_end,
                                tf_activation act, const tf_ops_output *dx, uint32_t *amax_bits);

/*
 * out[c] = sum of partials[p * cols + c] over p = 0 .. num_parts - 1, in that
 * order, for c in [col_begin, col_end); out has cols elements of out_dtype.
 * Combines the per-band partial sums of the backward kernels deterministically.
 */
tf_status tf_ops_sum_partials(const float *partials, int64_t num_parts, int64_t cols,
                              int64_t col_begin, int64_t col_end, void *out, tf_dtype out_dtype);

#endif /* TF_OPS_ACTIVATION_H */
