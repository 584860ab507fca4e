/*
 * Standalone test of the RoPE C core (csrc/ops/rope.c, no torch): forward and backward against a
 * double-precision reference written from the rotation of each channel pair, for sbhd, bshd and
 * thd, interleaved or not, partial rotation, per-sequence angles, start positions and context
 * parallelism (positions derived independently, from the chunks a rank holds), on strided views
 * with edge values; the backward as the exact transpose (<R x, g> = <x, R^T g>); pass-through
 * channels bit for bit (NaN payloads included); results independent of the token split; every
 * size, overflow, sequence and pointer check. Run by tests/c/run_rope.sh under ASan and UBSan.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/tf_dtype.h"
#include "ops/rope.h"

#include "check.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rand_u32(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (uint32_t)((rng_state * 0x2545F4914F6CDD1Dull) >> 32);
}
static float rand_f(float scale) { return ((float)(rand_u32() >> 8) / (float)(1u << 24) * 2.0f - 1.0f) * scale; }

/* A value of x: mostly uniform, with zeros, signed zeros, tiny and large magnitudes. */
static float edge_value(tf_dtype dtype) {
  const float big = dtype == TF_FLOAT16 ? 3.0e4f : 1.0e30f;
  switch (rand_u32() % 16) {
    case 0: return 0.0f;
    case 1: return -0.0f;
    case 2: return rand_f(1e-30f);
    case 3: return rand_f(big);
    default: return rand_f(4.0f);
  }
}

static float load(const void *buf, tf_dtype dtype, int64_t i) {
  if (dtype == TF_FLOAT32) return ((const float *)buf)[i];
  const uint16_t h = ((const uint16_t *)buf)[i];
  return dtype == TF_BFLOAT16 ? tf_bf16_to_f32(h) : tf_f16_to_f32(h);
}
static void store(void *buf, tf_dtype dtype, int64_t i, float v) {
  if (dtype == TF_FLOAT32)
    ((float *)buf)[i] = v;
  else
    ((uint16_t *)buf)[i] = dtype == TF_BFLOAT16 ? tf_f32_to_bf16(v) : tf_f32_to_f16(v);
}
static uint32_t bits(const void *buf, tf_dtype dtype, int64_t i) {
  return dtype == TF_FLOAT32 ? ((const uint32_t *)buf)[i] : ((const uint16_t *)buf)[i];
}

/* The global position of local token s of a sequence of local length len, from the chunks this
   rank holds: the sequence of len * cp positions cut into 2 cp equal chunks, of which rank r has
   chunks r and 2 cp - 1 - r, in that order. */
static int64_t reference_position(int64_t s, int64_t len, int64_t start, int64_t cp, int64_t rank) {
  if (cp == 1) return start + s;
  const int64_t chunk = len / 2;
  const int64_t which = s < chunk ? rank : 2 * cp - 1 - rank;
  return which * chunk + s % chunk;
}

typedef struct rope_case {
  tf_rope_format format;
  int interleaved;
  tf_dtype dtype;
  int64_t seq, batch, heads, dim, rot_dim;
  int64_t freq_rows, freq_batch;
  int with_start;
  int64_t cp, rank;
  const int32_t *cu; /* thd: global boundaries */
  int padded;        /* x and the output as views into larger buffers, with odd strides */
} rope_case;

/* Strides (s or t, b, h, d) of a view; padded ones put the heads and channels apart, as a QKV split. */
static void view_strides(const rope_case *c, int padded, int64_t st[4], int64_t *total) {
  const int64_t hd = padded ? c->dim * 2 + 1 : c->dim, dd = padded ? 2 : 1;
  const int64_t per_head = padded ? hd * dd : c->dim;
  const int64_t per_token = c->heads * per_head + (padded ? 3 : 0);
  st[3] = dd;
  st[2] = per_head;
  if (c->format == TF_ROPE_THD) {
    st[0] = per_token;
    st[1] = 0;
    *total = c->seq * per_token;
  } else if (c->format == TF_ROPE_SBHD) {
    st[1] = per_token;
    st[0] = per_token * c->batch;
    *total = st[0] * c->seq;
  } else {
    st[0] = per_token;
    st[1] = per_token * c->seq;
    *total = st[1] * c->batch;
  }
}

/* For token k: its sequence, local index and local length. */
static void locate(const rope_case *c, int64_t k, int64_t *seqid, int64_t *s, int64_t *len) {
  if (c->format != TF_ROPE_THD) {
    *seqid = k / c->seq;
    *s = k % c->seq;
    *len = c->seq;
    return;
  }
  for (int64_t i = 0; i < c->batch; ++i) {
    const int64_t b0 = c->cu[i] / c->cp, b1 = c->cu[i + 1] / c->cp;
    if (k >= b0 && k < b1) {
      *seqid = i;
      *s = k - b0;
      *len = b1 - b0;
      return;
    }
  }
  *seqid = *s = *len = -1;
}

static double ulp_scale(tf_dtype dtype) {
  return dtype == TF_FLOAT32 ? 0x1p-24 : dtype == TF_BFLOAT16 ? 0x1p-8 : 0x1p-11;
}

/* Half the step of the dtype's subnormals: the rounding error of a result below its smallest normal. */
static double subnormal_half_step(tf_dtype dtype) {
  return dtype == TF_FLOAT32 ? 0x1p-150 : dtype == TF_BFLOAT16 ? 0x1p-134 : 0x1p-25;
}

static void run_case(const rope_case *c, const char *label) {
  tf_rope_problem p = {c->format, c->seq, c->batch, c->heads, c->dim, c->rot_dim, c->interleaved, NULL,
                       c->freq_rows, c->freq_batch, c->cu, NULL, c->cp, c->rank};
  const int64_t tokens = tf_rope_tokens(&p);
  float *freqs = malloc(sizeof(float) * (size_t)(c->freq_rows * c->freq_batch * c->rot_dim + 1));
  for (int64_t i = 0; i < c->freq_rows * c->freq_batch * c->rot_dim; ++i)
    freqs[i] = (i % 7 == 3) ? rand_f(2000.0f) : rand_f(4.0f); /* some angles far from 0 */
  p.freqs = freqs;
  int32_t start[8] = {0};
  if (c->with_start) {
    for (int64_t i = 0; i < c->batch; ++i) {
      int64_t len = c->seq;
      if (c->format == TF_ROPE_THD) len = c->cu[i + 1] - c->cu[i];
      start[i] = (int32_t)(rand_u32() % (uint32_t)(c->freq_rows - len + 1));
    }
    p.start_positions = start;
  }
  int64_t xs[4], ys[4], xn, yn;
  view_strides(c, c->padded, xs, &xn);
  view_strides(c, 0, ys, &yn);
  const int64_t es = tf_dtype_size(c->dtype);
  void *x = malloc((size_t)(xn * es)), *y = malloc((size_t)(yn * es)), *y2 = malloc((size_t)(yn * es));
  void *g = malloc((size_t)(yn * es)), *dx = malloc((size_t)(xn * es));
  for (int64_t i = 0; i < xn; ++i) store(x, c->dtype, i, edge_value(c->dtype));
  for (int64_t i = 0; i < yn; ++i) store(g, c->dtype, i, rand_f(2.0f));
  /* NaNs with payloads and infinities in the pass-through channels, copied bit for bit */
  for (int64_t k = 0; k < tokens && c->dim > c->rot_dim; k += 3) {
    const int64_t seqid = c->format == TF_ROPE_THD ? 0 : k / c->seq, s = c->format == TF_ROPE_THD ? k : k % c->seq;
    const int64_t off = s * xs[0] + seqid * xs[1] + (c->dim - 1) * xs[3];
    if (c->dtype == TF_FLOAT32)
      ((uint32_t *)x)[off] = (k % 2) ? 0x7FC01234u : 0xFF800000u;
    else
      ((uint16_t *)x)[off] = (k % 2) ? 0x7E21u : 0xFC00u;
  }

  CHECK(tf_rope_forward(&p, c->dtype, x, xs, y, ys, 0, tokens) == TF_OK, "%s: forward", label);
  /* split into uneven ranges: same bits */
  const int64_t cut = tokens / 3;
  CHECK(tf_rope_forward(&p, c->dtype, x, xs, y2, ys, 0, cut) == TF_OK &&
            tf_rope_forward(&p, c->dtype, x, xs, y2, ys, cut, tokens) == TF_OK,
        "%s: split forward", label);
  CHECK(memcmp(y, y2, (size_t)(tokens * c->heads * c->dim * es)) == 0, "%s: split forward differs", label);
  CHECK(tf_rope_backward(&p, c->dtype, g, ys, dx, xs, 0, tokens) == TF_OK, "%s: backward", label);

  const int64_t pairs = c->rot_dim / 2;
  const double eps = ulp_scale(c->dtype), sub_floor = subnormal_half_step(c->dtype);
  int bad_fwd = 0, bad_bwd = 0, bad_copy = 0;
  double dot_y_g = 0.0, dot_x_dx = 0.0, dot_scale = 0.0;
  for (int64_t k = 0; k < tokens; ++k) {
    int64_t seqid, s, len;
    locate(c, k, &seqid, &s, &len);
    const int64_t pos = reference_position(s, len, c->with_start ? start[seqid] : 0, c->cp, c->rank);
    const float *f = freqs + (pos * c->freq_batch + (c->freq_batch > 1 ? seqid : 0)) * c->rot_dim;
    const int64_t row = c->format == TF_ROPE_THD ? k : s, b = c->format == TF_ROPE_THD ? 0 : seqid;
    for (int64_t h = 0; h < c->heads; ++h) {
      const int64_t xo = row * xs[0] + b * xs[1] + h * xs[2], yo = row * ys[0] + b * ys[1] + h * ys[2];
      for (int64_t q = 0; q < pairs; ++q) {
        const int64_t a = c->interleaved ? 2 * q : q, bb = c->interleaved ? 2 * q + 1 : q + pairs;
        const double xa = load(x, c->dtype, xo + a * xs[3]), xb = load(x, c->dtype, xo + bb * xs[3]);
        const double ga = load(g, c->dtype, yo + a * ys[3]), gb = load(g, c->dtype, yo + bb * ys[3]);
        const double fa = f[a], fb = f[bb];
        const double ref[2] = {xa * cos(fa) - xb * sin(fa), xb * cos(fb) + xa * sin(fb)};
        const double dref[2] = {ga * cos(fa) + gb * sin(fb), gb * cos(fb) - ga * sin(fa)};
        const double got[2] = {load(y, c->dtype, yo + a * ys[3]), load(y, c->dtype, yo + bb * ys[3])};
        const double dgot[2] = {load(dx, c->dtype, xo + a * xs[3]), load(dx, c->dtype, xo + bb * xs[3])};
        const double mag = fabs(xa) + fabs(xb), dmag = fabs(ga) + fabs(gb);
        for (int j = 0; j < 2; ++j) {
          /* float32 math (a few ulps of the inputs' size), then one rounding to the dtype */
          if (!(fabs(got[j] - ref[j]) <= 8 * 0x1p-24 * mag + eps * fabs(ref[j]) + sub_floor)) ++bad_fwd;
          if (!(fabs(dgot[j] - dref[j]) <= 8 * 0x1p-24 * dmag + eps * fabs(dref[j]) + sub_floor)) ++bad_bwd;
        }
        if (mag < 1e6) { /* <R x, g> = <x, R^T g> on the values the kernels wrote (huge ones checked above) */
          dot_y_g += got[0] * ga + got[1] * gb;
          dot_x_dx += xa * dgot[0] + xb * dgot[1];
          dot_scale += mag * dmag;
        }
      }
      for (int64_t ch = c->rot_dim; ch < c->dim; ++ch) {
        if (bits(y, c->dtype, yo + ch * ys[3]) != bits(x, c->dtype, xo + ch * xs[3])) ++bad_copy;
        if (bits(dx, c->dtype, xo + ch * xs[3]) != bits(g, c->dtype, yo + ch * ys[3])) ++bad_copy;
      }
    }
  }
  CHECK(bad_fwd == 0, "%s: %d forward values off the float64 reference", label, bad_fwd);
  CHECK(bad_bwd == 0, "%s: %d backward values off the float64 reference", label, bad_bwd);
  CHECK(bad_copy == 0, "%s: %d pass-through channels not copied bit for bit", label, bad_copy);
  CHECK(fabs(dot_y_g - dot_x_dx) <= 4 * eps * dot_scale + 1e-9, "%s: <Rx, g> %.17g vs <x, R^T g> %.17g", label,
        dot_y_g, dot_x_dx);
  free(freqs);
  free(x);
  free(y);
  free(y2);
  free(g);
  free(dx);
}

static void test_layouts(void) {
  static const int32_t cu1[] = {0, 5, 5, 12, 13};      /* an empty and a one-token sequence */
  static const int32_t cu2[] = {0, 8, 8, 20, 32};       /* multiples of 2 cp for cp = 2 */
  static const tf_dtype dtypes[] = {TF_FLOAT32, TF_BFLOAT16, TF_FLOAT16};
  char label[160];
  for (int di = 0; di < 3; ++di)
    for (int fmt = 0; fmt < 3; ++fmt)
      for (int inter = 0; inter < 2; ++inter)
        for (int partial = 0; partial < 2; ++partial)
          for (int mode = 0; mode < 4; ++mode) { /* plain, start positions, cp rank 0 of 2, cp rank 1 of 2 */
            const int cp_mode = mode >= 2;
            rope_case c = {(tf_rope_format)fmt, inter, dtypes[di], 6, 3, 2, 20, partial ? 12 : 20, 0, 1,
                           mode == 1, cp_mode ? 2 : 1, mode == 3, NULL, (mode + partial) % 2};
            if (fmt == TF_ROPE_THD) {
              c.cu = cp_mode ? cu2 : cu1;
              c.batch = 4;
              c.seq = cp_mode ? 16 : 13;
              c.freq_rows = cp_mode ? 12 : 9;
            } else {
              c.freq_rows = cp_mode ? 12 : 10;
            }
            c.freq_batch = (mode == 1 && partial) ? c.batch : 1;
            snprintf(label, sizeof label, "dtype %d format %d interleaved %d rot %lld mode %d", di, fmt, inter,
                     (long long)c.rot_dim, mode);
            run_case(&c, label);
          }
  /* more pairs than one tile, odd head counts */
  rope_case wide = {TF_ROPE_BSHD, 0, TF_FLOAT32, 3, 2, 3, 300, 290, 3, 2, 0, 1, 0, NULL, 1};
  run_case(&wide, "bshd, 145 pairs");
  wide.interleaved = 1;
  run_case(&wide, "bshd, 145 pairs, interleaved");
}

static void test_checks(void) {
  static const int32_t cu_ok[] = {0, 4, 8};
  static const int32_t cu_start[] = {1, 4, 8}, cu_down[] = {0, 5, 4, 8}, cu_end[] = {0, 4, 7};
  static const int32_t cu_cp[] = {0, 6, 8};
  float freqs[64] = {0};
  float buf[512] = {0}, out[512];
  const tf_rope_problem ok = {TF_ROPE_SBHD, 4, 2, 2, 8, 4, 0, freqs, 4, 1, NULL, NULL, 1, 0};
  const int64_t st[4] = {32, 16, 8, 1};
  CHECK(tf_rope_forward(&ok, TF_FLOAT32, buf, st, out, st, 0, 8) == TF_OK, "a valid problem");
  CHECK(tf_rope_forward(NULL, TF_FLOAT32, buf, st, out, st, 0, 8) == TF_ERR_NULL_POINTER, "NULL problem");
  CHECK(tf_rope_forward(&ok, (tf_dtype)7, buf, st, out, st, 0, 8) == TF_ERR_BAD_DTYPE, "bad dtype");
  CHECK(tf_rope_forward(&ok, TF_FLOAT32, NULL, st, out, st, 0, 8) == TF_ERR_NULL_POINTER, "NULL x");
  CHECK(tf_rope_forward(&ok, TF_FLOAT32, buf, st, NULL, st, 0, 8) == TF_ERR_NULL_POINTER, "NULL y");
  CHECK(tf_rope_forward(&ok, TF_FLOAT32, buf, NULL, out, st, 0, 8) == TF_ERR_NULL_POINTER, "NULL strides");
  CHECK(tf_rope_forward(&ok, TF_FLOAT32, buf, st, out, st, 0, 9) == TF_ERR_BAD_SIZE, "token range past the end");
  CHECK(tf_rope_forward(&ok, TF_FLOAT32, buf, st, out, st, 5, 4) == TF_ERR_BAD_SIZE, "reversed token range");
  CHECK(tf_rope_backward(&ok, TF_FLOAT32, NULL, st, out, st, 0, 0) == TF_OK, "an empty range touches nothing");

  tf_rope_problem p = ok;
#define EXPECT(field_change, status, what)                                                       \
  do {                                                                                             \
    p = ok;                                                                                        \
    field_change;                                                                                  \
    CHECK(tf_rope_check(&p) == (status), "%s: got %d", what, (int)tf_rope_check(&p));             \
    CHECK(tf_rope_forward(&p, TF_FLOAT32, buf, st, out, st, 0, 0) == (status), "%s (forward)", what); \
  } while (0)
  EXPECT(p.format = (tf_rope_format)3, TF_ERR_BAD_ARGUMENT, "unknown format");
  EXPECT(p.seq = -1, TF_ERR_BAD_SIZE, "negative seq");
  EXPECT(p.heads = -2, TF_ERR_BAD_SIZE, "negative heads");
  EXPECT(p.rot_dim = 3, TF_ERR_BAD_SIZE, "odd rot_dim");
  EXPECT((p.rot_dim = 10, p.freq_rows = 1), TF_ERR_BAD_SIZE, "rot_dim above dim");
  EXPECT(p.interleaved = 2, TF_ERR_BAD_ARGUMENT, "interleaved not 0 or 1");
  EXPECT(p.cp_size = 0, TF_ERR_BAD_ARGUMENT, "cp_size 0");
  EXPECT((p.cp_size = 2, p.cp_rank = 2), TF_ERR_BAD_ARGUMENT, "cp_rank past cp_size");
  EXPECT((p.cp_size = 2, p.cp_rank = -1), TF_ERR_BAD_ARGUMENT, "negative cp_rank");
  EXPECT((p.cp_size = 2, p.freq_rows = 7), TF_ERR_BAD_SIZE, "cp: freqs shorter than the whole sequence");
  EXPECT((p.cp_size = 2, p.seq = 3, p.freq_rows = 8), TF_ERR_BAD_ARGUMENT, "cp: odd local length");
  EXPECT(p.freq_batch = 3, TF_ERR_BAD_SIZE, "freq_batch neither 1 nor batch");
  EXPECT(p.freq_rows = 3, TF_ERR_BAD_SIZE, "freqs shorter than the sequence");
  EXPECT(p.freqs = NULL, TF_ERR_NULL_POINTER, "NULL freqs");
  static const int32_t start_ok[] = {0, 1}, start_neg[] = {0, -1}, start_far[] = {0, 2};
  EXPECT((p.freq_rows = 5, p.start_positions = start_ok), TF_OK, "start positions within freqs");
  EXPECT((p.freq_rows = 5, p.start_positions = start_neg), TF_ERR_BAD_SIZE, "a negative start position");
  EXPECT((p.freq_rows = 5, p.start_positions = start_far), TF_ERR_BAD_SIZE, "start + length past freqs");
  EXPECT((p.start_positions = start_ok, p.cp_size = 2, p.freq_rows = 8), TF_ERR_BAD_ARGUMENT,
         "start positions with cp");
  /* thd */
  EXPECT((p.format = TF_ROPE_THD, p.seq = 8, p.cu_seqlens = cu_ok), TF_OK, "thd");
  EXPECT((p.format = TF_ROPE_THD, p.seq = 8), TF_ERR_NULL_POINTER, "thd without cu_seqlens");
  EXPECT((p.format = TF_ROPE_THD, p.seq = 8, p.cu_seqlens = cu_start), TF_ERR_BAD_ARGUMENT, "cu_seqlens[0] != 0");
  EXPECT((p.format = TF_ROPE_THD, p.seq = 8, p.batch = 3, p.cu_seqlens = cu_down, p.freq_rows = 8),
         TF_ERR_BAD_ARGUMENT, "decreasing cu_seqlens");
  EXPECT((p.format = TF_ROPE_THD, p.seq = 8, p.cu_seqlens = cu_end), TF_ERR_BAD_ARGUMENT,
         "cu_seqlens not ending at the token count");
  EXPECT((p.format = TF_ROPE_THD, p.seq = 8, p.cu_seqlens = cu_ok, p.freq_rows = 3), TF_ERR_BAD_SIZE,
         "thd: a sequence longer than freqs");
  EXPECT((p.format = TF_ROPE_THD, p.seq = 4, p.cu_seqlens = cu_cp, p.cp_size = 2, p.freq_rows = 8),
         TF_ERR_BAD_ARGUMENT, "thd cp: a boundary not a multiple of 2 cp");
  EXPECT((p.format = TF_ROPE_THD, p.seq = 4, p.cu_seqlens = cu_ok, p.cp_size = 2, p.freq_rows = 3),
         TF_ERR_BAD_SIZE, "thd cp: freqs shorter than a whole sequence");
  EXPECT((p.format = TF_ROPE_THD, p.seq = 4, p.batch = 0, p.cu_seqlens = cu_ok), TF_ERR_BAD_ARGUMENT,
         "thd: tokens and no sequence");
  /* the shape checks alone (the CUDA launchers') do not read cu_seqlens or start_positions */
  p = ok;
  p.format = TF_ROPE_THD, p.seq = 8, p.cu_seqlens = cu_end;
  CHECK(tf_rope_check_shape(&p) == TF_OK && tf_rope_check(&p) == TF_ERR_BAD_ARGUMENT, "shape checks skip cu_seqlens");
  p = ok;
  p.freq_rows = 5, p.start_positions = start_far;
  CHECK(tf_rope_check_shape(&p) == TF_OK && tf_rope_check(&p) == TF_ERR_BAD_SIZE, "shape checks skip start_positions");
  p = ok;
  p.freq_rows = 3;
  CHECK(tf_rope_check_shape(&p) == TF_ERR_BAD_SIZE, "shape checks: freqs shorter than the sequence");
  CHECK(tf_rope_check_view(&ok, TF_FLOAT16, st) == TF_OK && tf_rope_check_view(&ok, (tf_dtype)5, st) == TF_ERR_BAD_DTYPE &&
            tf_rope_check_view(&ok, TF_FLOAT32, NULL) == TF_ERR_NULL_POINTER,
        "view checks");
  /* sizes whose products overflow int64, refused before any pointer is read */
  EXPECT((p.seq = INT64_MAX / 2, p.freq_rows = INT64_MAX), TF_ERR_OVERFLOW, "seq * batch");
  EXPECT((p.heads = INT64_MAX / 4, p.freq_rows = 4), TF_ERR_OVERFLOW, "tokens * heads * dim");
  EXPECT((p.heads = INT64_MAX / 4, p.batch = 0, p.freq_rows = 4), TF_ERR_OVERFLOW, "heads * dim");
  EXPECT((p.freq_rows = INT64_MAX / 2, p.freq_batch = 2, p.batch = 2), TF_ERR_OVERFLOW, "freq_rows * batch * d2");
  EXPECT((p.format = TF_ROPE_THD, p.seq = INT64_MAX / 2 + 1, p.cu_seqlens = cu_ok, p.cp_size = 2), TF_ERR_OVERFLOW,
         "thd: seq * cp_size");
#undef EXPECT
  const int64_t huge[4] = {INT64_MAX / 2, 16, 8, 1};
  CHECK(tf_rope_forward(&ok, TF_FLOAT32, buf, huge, out, st, 0, 8) == TF_ERR_OVERFLOW, "x strides overflow");
  const int64_t edge[4] = {INT64_MAX / 8, 0, 0, 0}; /* the extent fits, in bytes it does not */
  CHECK(tf_rope_forward(&ok, TF_FLOAT32, buf, st, out, edge, 0, 0) == TF_ERR_OVERFLOW, "y extent in bytes");
  const int64_t negative[4] = {32, 16, -8, 1};
  CHECK(tf_rope_forward(&ok, TF_FLOAT32, buf, negative, out, st, 0, 8) == TF_ERR_BAD_SIZE, "negative stride");
}

int main(void) {
  test_layouts();
  test_checks();
  return check_report();
}
