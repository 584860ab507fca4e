#include "fp8_scaling.h"

#include "../common/tf_checks.h"

tf_status tf_fp8_delayed_scaling_update(float *amax_history, int64_t history_len,
                                        int64_t num_scales, float *scale, float *scale_inv,
                                        float fp8_max, int32_t margin, tf_amax_algo algo) {
  if (history_len < 1 || num_scales < 0) return TF_ERR_BAD_SIZE;
  if (!tf_mul_fits(history_len, num_scales)) return TF_ERR_OVERFLOW;
  if (algo != TF_AMAX_MAX && algo != TF_AMAX_MOST_RECENT) return TF_ERR_BAD_ARGUMENT;
  if (margin < -126 || margin > 126 || !(fp8_max > 0.0f)) return TF_ERR_BAD_ARGUMENT;
  if (num_scales > 0 && (!amax_history || !scale || !scale_inv)) return TF_ERR_NULL_POINTER;
  for (int64_t j = 0; j < num_scales; ++j) {
    scale[j] = tf_fp8_delayed_update_column(amax_history + j, history_len, num_scales, scale[j],
                                            fp8_max, margin, algo);
    scale_inv[j] = 1.0f / scale[j];
  }
  return TF_OK;
}
