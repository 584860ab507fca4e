#include "fp8_scaling.h"

#include "../common/tf_checks.h"

tf_status tf_fp8_delayed_scaling_update(float *amax_history, int64_t history_len,
                                        int64_t num_scales, float *amax, float *scale,
                                        float *scale_inv, float fp8_max, int32_t margin,
                                        tf_amax_algo algo) {
  if (history_len < 1 || num_scales < 0) return TF_ERR_BAD_SIZE;
  if (!tf_mul_fits(history_len, num_scales)) return TF_ERR_OVERFLOW;
  if (algo != TF_AMAX_MAX && algo != TF_AMAX_MOST_RECENT) return TF_ERR_BAD_ARGUMENT;
  if (margin < -126 || margin > 126 || !(fp8_max > 0.0f)) return TF_ERR_BAD_ARGUMENT;
  if (num_scales > 0 && (!amax_history || !amax || !scale || !scale_inv))
    return TF_ERR_NULL_POINTER;
  for (int64_t j = 0; j < num_scales; ++j) {
    for (int64_t i = history_len - 1; i > 0; --i)
      amax_history[i * num_scales + j] = amax_history[(i - 1) * num_scales + j];
    amax_history[j] = amax[j];
    /* Reduce with the comparison that lets NaN through, so a NaN amax keeps the old scale. */
    float reduced = amax[j];
    if (algo == TF_AMAX_MAX)
      for (int64_t i = 1; i < history_len; ++i) {
        const float h = amax_history[i * num_scales + j];
        reduced = (h > reduced || h != h) ? h : reduced;
      }
    scale[j] = tf_fp8_delayed_scale(reduced, scale[j], fp8_max, margin);
    scale_inv[j] = 1.0f / scale[j];
    amax[j] = 0.0f;
  }
  return TF_OK;
}
