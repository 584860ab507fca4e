/*
 * FP8 scaling-factor updates (per-tensor scales), shared by the CPU path and,
 * through TF_HD, by the CUDA kernels.
 */
#ifndef TF_FP8_SCALING_H
#define TF_FP8_SCALING_H

#include <stdint.h>

#include "../common/tf_dtype.h"
#include "../common/tf_status.h"

typedef enum tf_amax_algo {
  TF_AMAX_MAX = 0,         /* max over the whole history */
  TF_AMAX_MOST_RECENT = 1  /* the amax just recorded */
} tf_amax_algo;

#define TF_FLT_MAX 0x1.fffffep+127f

TF_HD int tf_is_finite(float v) { return (tf_f32_bits(v) & 0x7F800000u) != 0x7F800000u; }

/*
 * Delayed scaling for one tensor: new scale = (fp8_max / amax) / 2^margin,
 * the old scale kept when amax is 0 or not finite, an infinite scale clamped
 * to FLT_MAX.
 */
TF_HD float tf_fp8_delayed_scale(float amax, float old_scale, float fp8_max, int32_t margin) {
  if (!(amax > 0.0f) || !tf_is_finite(amax)) return old_scale;
  float scale = fp8_max / amax;
  scale = tf_is_finite(scale) ? scale : TF_FLT_MAX;
  /* Dividing by the power of two 2^margin is exact unless it underflows. */
  return scale / tf_f32_from_bits((uint32_t)(127 + margin) << 23);
}

/*
 * Current scaling: scale = fp8_max / max(amax, epsilon); 1 when amax is 0,
 * Inf or NaN; FLT_MAX when the quotient overflows; optionally rounded down
 * to a power of two (mantissa bits cleared).
 */
TF_HD float tf_fp8_current_scale(float amax, float fp8_max, float epsilon, int force_pow2) {
  if (!(amax > 0.0f) || !tf_is_finite(amax)) return 1.0f;
  const float floored = amax < epsilon ? epsilon : amax;
  float scale = fp8_max / floored;
  scale = tf_is_finite(scale) ? scale : TF_FLT_MAX;
  return force_pow2 ? tf_f32_from_bits(tf_f32_bits(scale) & 0xFF800000u) : scale;
}

/*
 * One tensor's delayed-scaling update, in TransformerEngine's history layout:
 * `column` is its column of a history_len-row history whose rows lie `stride`
 * floats apart; row 0 holds the amax recorded since the last update, rows 1..
 * the completed amaxes, oldest first. With nothing recorded (row 0 is 0: a
 * cached weight was not cast again) the column and the scale stay as they are.
 * Otherwise the window (every row) is reduced with `algo`, letting NaN through
 * so that a NaN keeps the old scale; the rows move up one (the recorded amax
 * becomes the newest completed one, the oldest drops out); row 0 is reset to
 * 0; and the new scale is returned.
 */
TF_HD float tf_fp8_delayed_update_column(float *column, int64_t history_len, int64_t stride,
                                         float old_scale, float fp8_max, int32_t margin,
                                         tf_amax_algo algo) {
  const float recorded = column[0];
  if (recorded == 0.0f) return old_scale;
  float reduced = recorded;
  if (algo == TF_AMAX_MAX)
    for (int64_t i = 1; i < history_len; ++i) {
      const float h = column[i * stride];
      reduced = (h > reduced || h != h) ? h : reduced;
    }
  for (int64_t i = 1; i + 1 < history_len; ++i) column[i * stride] = column[(i + 1) * stride];
  if (history_len > 1) column[(history_len - 1) * stride] = recorded;
  column[0] = 0.0f;
  return tf_fp8_delayed_scale(reduced, old_scale, fp8_max, margin);
}

/*
 * Delayed-scaling update of num_scales tensors that share one history
 * (history_len x num_scales, TransformerEngine's layout: see
 * tf_fp8_delayed_update_column): each tensor's column is updated and its
 * scale[j] and scale_inv[j] = 1 / scale[j] written. margin must lie in
 * [-126, 126] so 2^margin is a normal float.
 */
tf_status tf_fp8_delayed_scaling_update(float *amax_history, int64_t history_len,
                                        int64_t num_scales, float *scale, float *scale_inv,
                                        float fp8_max, int32_t margin, tf_amax_algo algo);

#endif /* TF_FP8_SCALING_H */
