#include "rope.h"

#include <math.h>
#include <string.h>

#include "../common/tf_checks.h"

/* Pairs rotated per tile: the angles' coefficients of a tile stay on the stack. */
#define ROPE_TILE 128

static int dtype_ok(tf_dtype dtype) {
  return dtype == TF_FLOAT32 || dtype == TF_BFLOAT16 || dtype == TF_FLOAT16;
}

int64_t tf_rope_tokens(const tf_rope_problem *p) {
  if (!p || p->seq < 0 || p->batch < 0) return 0;
  if (p->format == TF_ROPE_THD) return p->seq;
  return tf_mul_fits(p->seq, p->batch) ? p->seq * p->batch : 0;
}

/* Positions [start, start + len) of one sequence must lie in [0, freq_rows). */
static tf_status check_span(int64_t start, int64_t len, int64_t freq_rows) {
  if (len == 0) return TF_OK;
  if (start < 0 || len > freq_rows || start > freq_rows - len) return TF_ERR_BAD_SIZE;
  return TF_OK;
}

/* The positions of a sequence of local length len (the whole sequence spans len * cp_size). */
static tf_status check_sequence(const tf_rope_problem *p, int64_t i, int64_t len) {
  if (p->cp_size > 1) {
    if (len % 2) return TF_ERR_BAD_ARGUMENT;
    if (!tf_mul_fits(len, p->cp_size)) return TF_ERR_OVERFLOW;
    return check_span(0, len * p->cp_size, p->freq_rows);
  }
  return check_span(p->start_positions ? p->start_positions[i] : 0, len, p->freq_rows);
}

/* thd's boundaries, once tf_rope_check_shape has passed. */
static tf_status check_cu_seqlens(const tf_rope_problem *p) {
  const int32_t *cu = p->cu_seqlens;
  if (cu[0] != 0 || (int64_t)cu[p->batch] != p->seq * p->cp_size) return TF_ERR_BAD_ARGUMENT;
  for (int64_t i = 0; i < p->batch; ++i) {
    if (cu[i + 1] < cu[i]) return TF_ERR_BAD_ARGUMENT;
    if (p->cp_size > 1 && (int64_t)cu[i + 1] % (2 * p->cp_size) != 0) return TF_ERR_BAD_ARGUMENT;
  }
  for (int64_t i = 0; i < p->batch; ++i) {
    const tf_status s = check_sequence(p, i, ((int64_t)cu[i + 1] - cu[i]) / p->cp_size);
    if (s != TF_OK) return s;
  }
  return TF_OK;
}

tf_status tf_rope_check_shape(const tf_rope_problem *p) {
  if (!p) return TF_ERR_NULL_POINTER;
  if (p->format != TF_ROPE_SBHD && p->format != TF_ROPE_BSHD && p->format != TF_ROPE_THD)
    return TF_ERR_BAD_ARGUMENT;
  if (p->seq < 0 || p->batch < 0 || p->heads < 0 || p->dim < 0 || p->rot_dim < 0 || p->freq_rows < 0)
    return TF_ERR_BAD_SIZE;
  if (p->rot_dim % 2 || p->rot_dim > p->dim) return TF_ERR_BAD_SIZE;
  if (p->interleaved != 0 && p->interleaved != 1) return TF_ERR_BAD_ARGUMENT;
  if (p->cp_size < 1 || p->cp_rank < 0 || p->cp_rank >= p->cp_size) return TF_ERR_BAD_ARGUMENT;
  if (p->start_positions && p->cp_size > 1) return TF_ERR_BAD_ARGUMENT;
  if (p->freq_batch != 1 && p->freq_batch != p->batch) return TF_ERR_BAD_SIZE;
  if (p->format != TF_ROPE_THD && !tf_mul_fits(p->seq, p->batch)) return TF_ERR_OVERFLOW;
  const int64_t tokens = tf_rope_tokens(p);
  if (!tf_mul_fits(p->heads, p->dim) || !tf_mul_fits(tokens, p->heads) || !tf_mul_fits(tokens * p->heads, p->dim))
    return TF_ERR_OVERFLOW;
  if (!tf_mul_fits(p->freq_rows, p->freq_batch) || !tf_mul_fits(p->freq_rows * p->freq_batch, p->rot_dim))
    return TF_ERR_OVERFLOW;
  if (p->freq_rows * p->freq_batch * p->rot_dim > 0 && !p->freqs) return TF_ERR_NULL_POINTER;
  if (p->format == TF_ROPE_THD) {
    if (!p->cu_seqlens) return TF_ERR_NULL_POINTER;
    if (p->batch == 0 && p->seq > 0) return TF_ERR_BAD_ARGUMENT; /* tokens, and no sequence to hold them */
    return tf_mul_fits(p->seq, p->cp_size) ? TF_OK : TF_ERR_OVERFLOW;
  }
  if (p->cp_size > 1) return check_sequence(p, 0, p->seq);
  return p->start_positions ? TF_OK : check_span(0, p->seq, p->freq_rows);
}

tf_status tf_rope_check(const tf_rope_problem *p) {
  const tf_status s = tf_rope_check_shape(p);
  if (s != TF_OK) return s;
  if (p->format == TF_ROPE_THD) return check_cu_seqlens(p);
  for (int64_t i = 0; p->start_positions && i < p->batch; ++i) {
    const tf_status si = check_sequence(p, i, p->seq);
    if (si != TF_OK) return si;
  }
  return TF_OK;
}

/* The largest element offset of a view of these sizes and strides, times the element size, fits
   in int64 (and every stride is non-negative). */
static tf_status check_view(const int64_t sizes[4], const int64_t strides[4], int64_t elem_size) {
  int64_t extent = 0;
  for (int k = 0; k < 4; ++k) {
    if (strides[k] < 0) return TF_ERR_BAD_SIZE;
    if (sizes[k] == 0) return TF_OK;
  }
  for (int k = 0; k < 4; ++k) {
    if (!tf_mul_fits(sizes[k] - 1, strides[k])) return TF_ERR_OVERFLOW;
    const int64_t span = (sizes[k] - 1) * strides[k];
    if (extent > INT64_MAX - span) return TF_ERR_OVERFLOW;
    extent += span;
  }
  return tf_mul_fits(extent + 1, elem_size) ? TF_OK : TF_ERR_OVERFLOW;
}

tf_status tf_rope_check_view(const tf_rope_problem *p, tf_dtype dtype, const int64_t strides[4]) {
  if (!p || !strides) return TF_ERR_NULL_POINTER;
  if (!dtype_ok(dtype)) return TF_ERR_BAD_DTYPE;
  const int64_t sizes[4] = {p->seq, p->format == TF_ROPE_THD ? 1 : p->batch, p->heads, p->dim};
  return check_view(sizes, strides, tf_dtype_size(dtype));
}

/* v[i] = float(x[off + i * stride]) for i in [0, n). */
static void gather(const void *x, tf_dtype dtype, int64_t off, int64_t stride, int64_t n, float *v) {
  if (dtype == TF_FLOAT32) {
    const float *p = (const float *)x + off;
    for (int64_t i = 0; i < n; ++i) v[i] = p[i * stride];
  } else if (dtype == TF_BFLOAT16) {
    const uint16_t *p = (const uint16_t *)x + off;
    for (int64_t i = 0; i < n; ++i) v[i] = tf_bf16_to_f32(p[i * stride]);
  } else {
    const uint16_t *p = (const uint16_t *)x + off;
    for (int64_t i = 0; i < n; ++i) v[i] = tf_f16_to_f32(p[i * stride]);
  }
}

/* y[off + i * stride] = v[i], rounded to nearest even. */
static void scatter(void *y, tf_dtype dtype, int64_t off, int64_t stride, int64_t n, const float *v) {
  if (dtype == TF_FLOAT32) {
    float *p = (float *)y + off;
    for (int64_t i = 0; i < n; ++i) p[i * stride] = v[i];
  } else if (dtype == TF_BFLOAT16) {
    uint16_t *p = (uint16_t *)y + off;
    for (int64_t i = 0; i < n; ++i) p[i * stride] = tf_f32_to_bf16(v[i]);
  } else {
    uint16_t *p = (uint16_t *)y + off;
    for (int64_t i = 0; i < n; ++i) p[i * stride] = tf_f32_to_f16(v[i]);
  }
}

/* The channels past rot_dim, copied bit for bit. */
static void copy_rest(const void *x, int64_t xoff, int64_t xs, void *y, int64_t yoff, int64_t ys, int64_t n,
                      tf_dtype dtype) {
  if (dtype == TF_FLOAT32) {
    const uint32_t *src = (const uint32_t *)x + xoff;
    uint32_t *dst = (uint32_t *)y + yoff;
    for (int64_t i = 0; i < n; ++i) dst[i * ys] = src[i * xs];
  } else {
    const uint16_t *src = (const uint16_t *)x + xoff;
    uint16_t *dst = (uint16_t *)y + yoff;
    for (int64_t i = 0; i < n; ++i) dst[i * ys] = src[i * xs];
  }
}

/* Where token k lies: its sequence, its index s in the sequence, the sequence's local length,
   and its row (s, or t in thd) for the strides. */
typedef struct token_place {
  int64_t seqid;
  int64_t s;
  int64_t len;
  int64_t row;
} token_place;

/* thd: the sequence holding token t (the last one starting at or before t; it ends after t). */
static int64_t thd_sequence_of(const tf_rope_problem *p, int64_t t) {
  int64_t lo = 0, hi = p->batch - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if ((int64_t)p->cu_seqlens[mid] / p->cp_size <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

static token_place place_of(const tf_rope_problem *p, int64_t k, int64_t thd_seq) {
  token_place tp;
  if (p->format == TF_ROPE_THD) {
    const int64_t begin = (int64_t)p->cu_seqlens[thd_seq] / p->cp_size;
    tp.seqid = thd_seq;
    tp.s = k - begin;
    tp.len = (int64_t)p->cu_seqlens[thd_seq + 1] / p->cp_size - begin;
    tp.row = k;
  } else {
    tp.seqid = k / p->seq;
    tp.s = k % p->seq;
    tp.len = p->seq;
    tp.row = tp.s;
  }
  return tp;
}

static int64_t position_of(const tf_rope_problem *p, token_place tp) {
  if (p->cp_size > 1) {
    const int64_t half = tp.len / 2;
    return tp.s < half ? tp.s + p->cp_rank * half : (2 * p->cp_size - p->cp_rank - 1) * half + (tp.s - half);
  }
  return tp.s + (p->start_positions ? p->start_positions[tp.seqid] : 0);
}

/*
 * One token: for each tile of pairs (a, b), y[a] = x[a] c_aa + x[b] c_ab and
 * y[b] = x[b] c_bb + x[a] c_ba, with the forward's or the backward's coefficients.
 */
static void rope_token(const tf_rope_problem *p, const float *f, int backward, tf_dtype dtype, const void *x,
                       int64_t xoff, const int64_t xs[4], void *y, int64_t yoff, const int64_t ys[4]) {
  const int64_t pairs = p->rot_dim / 2;
  const int64_t step = p->interleaved ? 2 : 1;        /* channel distance of consecutive pairs */
  const int64_t partner = p->interleaved ? 1 : pairs; /* b - a */
  float c_aa[ROPE_TILE], c_ab[ROPE_TILE], c_bb[ROPE_TILE], c_ba[ROPE_TILE];
  float xa[ROPE_TILE], xb[ROPE_TILE], ya[ROPE_TILE], yb[ROPE_TILE];
  for (int64_t p0 = 0; p0 < pairs; p0 += ROPE_TILE) {
    const int64_t n = pairs - p0 < ROPE_TILE ? pairs - p0 : ROPE_TILE;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t a = (p0 + i) * step;
      const float fa = f[a], fb = f[a + partner];
      c_aa[i] = cosf(fa);
      c_bb[i] = cosf(fb);
      c_ab[i] = backward ? sinf(fb) : -sinf(fa);
      c_ba[i] = backward ? -sinf(fa) : sinf(fb);
    }
    for (int64_t h = 0; h < p->heads; ++h) {
      const int64_t xa0 = xoff + h * xs[2] + p0 * step * xs[3], ya0 = yoff + h * ys[2] + p0 * step * ys[3];
      gather(x, dtype, xa0, step * xs[3], n, xa);
      gather(x, dtype, xa0 + partner * xs[3], step * xs[3], n, xb);
      for (int64_t i = 0; i < n; ++i) {
        ya[i] = xa[i] * c_aa[i] + xb[i] * c_ab[i];
        yb[i] = xb[i] * c_bb[i] + xa[i] * c_ba[i];
      }
      scatter(y, dtype, ya0, step * ys[3], n, ya);
      scatter(y, dtype, ya0 + partner * ys[3], step * ys[3], n, yb);
    }
  }
  if (p->dim > p->rot_dim) {
    for (int64_t h = 0; h < p->heads; ++h)
      copy_rest(x, xoff + h * xs[2] + p->rot_dim * xs[3], xs[3], y, yoff + h * ys[2] + p->rot_dim * ys[3], ys[3],
                p->dim - p->rot_dim, dtype);
  }
}

static tf_status rope_run(const tf_rope_problem *p, int backward, tf_dtype dtype, const void *x,
                          const int64_t xs[4], void *y, const int64_t ys[4], int64_t token_begin,
                          int64_t token_end) {
  const tf_status st = tf_rope_check(p);
  if (st != TF_OK) return st;
  if (!tf_range_ok(token_begin, token_end, tf_rope_tokens(p))) return TF_ERR_BAD_SIZE;
  tf_status v = tf_rope_check_view(p, dtype, xs);
  if (v == TF_OK) v = tf_rope_check_view(p, dtype, ys);
  if (v != TF_OK) return v;
  const int thd = p->format == TF_ROPE_THD;
  if (token_end > token_begin && p->heads * p->dim > 0 && (!x || !y)) return TF_ERR_NULL_POINTER;
  if (token_end == token_begin || p->heads * p->dim == 0) return TF_OK;

  int64_t seqid = thd ? thd_sequence_of(p, token_begin) : 0;
  for (int64_t k = token_begin; k < token_end; ++k) {
    while (thd && (int64_t)p->cu_seqlens[seqid + 1] / p->cp_size <= k) ++seqid;
    const token_place tp = place_of(p, k, seqid);
    const int64_t pos = position_of(p, tp);
    const float *f = p->rot_dim ? p->freqs + (pos * p->freq_batch + (p->freq_batch > 1 ? tp.seqid : 0)) * p->rot_dim
                                : NULL;
    const int64_t b = thd ? 0 : tp.seqid;
    rope_token(p, f, backward, dtype, x, tp.row * xs[0] + b * xs[1], xs, y, tp.row * ys[0] + b * ys[1], ys);
  }
  return TF_OK;
}

tf_status tf_rope_forward(const tf_rope_problem *p, tf_dtype dtype, const void *x, const int64_t x_strides[4],
                          void *y, const int64_t y_strides[4], int64_t token_begin, int64_t token_end) {
  return rope_run(p, 0, dtype, x, x_strides, y, y_strides, token_begin, token_end);
}

tf_status tf_rope_backward(const tf_rope_problem *p, tf_dtype dtype, const void *dy, const int64_t dy_strides[4],
                           void *dx, const int64_t dx_strides[4], int64_t token_begin, int64_t token_end) {
  return rope_run(p, 1, dtype, dy, dy_strides, dx, dx_strides, token_begin, token_end);
}
