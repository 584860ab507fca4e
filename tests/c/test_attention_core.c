/*
 * Standalone test of the attention C core (no torch): forward, lse and
 * backward against a naive double-precision implementation written from the
 * definitions (masks, GQA, packed and padded layouts, dropout, FP8 and bf16
 * operands, strided views), and every size, pointer and overflow check.
 * Run by tests/c/run_attention.sh under ASan and UBSan.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "attention/attention_amx.h"
#include "attention/attention_bf16.h"
#include "attention/attention_dropout.h"
#include "attention/attention_tile.h"
#include "common/cpu_features.h"
#include "fp8/fp8_format.h"

#include "check.h"

static uint64_t rng_state = 88172645463325252ull;

static double uniform(void) { /* xorshift64 in [-1, 1) */
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (double)(rng_state >> 11) / 4503599627370496.0 - 1.0;
}

/* A [B, S, H, D] float operand stored with dims (S, B, H, D) in memory (an sbhd view). */
typedef struct buffer {
  float *data;
  tf_attn_operand op;
} buffer;

static buffer make_buffer(int64_t b, int64_t s, int64_t h, int64_t d, double amplitude) {
  buffer x;
  x.data = malloc((size_t)(b * s * h * d) * sizeof(float));
  for (int64_t i = 0; i < b * s * h * d; ++i) x.data[i] = (float)(amplitude * uniform());
  x.op.data = x.data;
  x.op.elem = TF_ATTN_F32;
  x.op.stride_s = b * h * d;
  x.op.stride_b = h * d;
  x.op.stride_h = d;
  x.op.descale = 1.0f;
  return x;
}

static double at(const buffer *x, int64_t b, int64_t s, int64_t h, int64_t d) {
  return x->data[b * x->op.stride_b + s * x->op.stride_s + h * x->op.stride_h + d];
}

typedef struct seg {
  int64_t b, q0, lq, k0, lkv;
} seg;

static int64_t segments_of(const tf_attn_problem *p, seg *out) {
  if (p->cu_seqlens_q) {
    for (int64_t n = 0; n < p->num_seqs; ++n) {
      seg s = {0, p->cu_seqlens_q[n], p->cu_seqlens_q[n + 1] - p->cu_seqlens_q[n], p->cu_seqlens_kv[n],
               p->cu_seqlens_kv[n + 1] - p->cu_seqlens_kv[n]};
      out[n] = s;
    }
    return p->num_seqs;
  }
  for (int64_t b = 0; b < p->batch; ++b) {
    seg s = {b, 0, p->seqlens_q ? p->seqlens_q[b] : p->seq_q, 0, p->seqlens_kv ? p->seqlens_kv[b] : p->seq_kv};
    out[b] = s;
  }
  return p->batch;
}

/*
 * Naive attention in double: out, lse (lse-shaped), and the grads of sum(out * dout)
 * in dense [B, S, H, D] arrays. Rows outside every sequence stay 0 (lse -inf).
 */
static void reference(const tf_attn_problem *p, const buffer *q, const buffer *k, const buffer *v,
                      const buffer *dout, double *out, double *lse, double *dq, double *dk, double *dv) {
  const int64_t H = p->heads_q, D = p->head_dim, group = p->heads_q / p->heads_kv;
  const int64_t nq = p->batch * p->seq_q * H * D, nkv = p->batch * p->seq_kv * p->heads_kv * D;
  memset(out, 0, (size_t)nq * sizeof *out);
  memset(dq, 0, (size_t)nq * sizeof *dq);
  memset(dk, 0, (size_t)nkv * sizeof *dk);
  memset(dv, 0, (size_t)nkv * sizeof *dv);
  for (int64_t i = 0; i < p->batch * H * p->seq_q; ++i) lse[i] = -INFINITY;
  seg segs[64];
  const int64_t n = segments_of(p, segs);
  const tf_attn_dropout_key_t key = tf_attn_dropout_key(p->seed, p->offset);
  const uint32_t threshold = tf_attn_dropout_threshold(p->dropout_p);
  double *prob = malloc((size_t)(p->seq_kv + 1) * sizeof(double));
  double *keep = malloc((size_t)(p->seq_kv + 1) * sizeof(double));
  double *dprob = malloc((size_t)(p->seq_kv + 1) * sizeof(double));
#define QI(b, s, h, d) ((((b) * p->seq_q + (s)) * H + (h)) * D + (d))
#define KI(b, s, h, d) ((((b) * p->seq_kv + (s)) * p->heads_kv + (h)) * D + (d))
  for (int64_t sn = 0; sn < n; ++sn) {
    const seg g = segs[sn];
    for (int64_t h = 0; h < H; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < g.lq; ++i) {
        const int64_t visible = p->causal ? (i + 1 < g.lkv ? i + 1 : g.lkv) : g.lkv;
        if (visible <= 0) continue;
        double m = -INFINITY, sum = 0.0;
        for (int64_t j = 0; j < visible; ++j) {
          double s = 0.0;
          for (int64_t d = 0; d < D; ++d) s += at(q, g.b, g.q0 + i, h, d) * at(k, g.b, g.k0 + j, hk, d);
          prob[j] = s * p->softmax_scale;
          m = prob[j] > m ? prob[j] : m;
        }
        for (int64_t j = 0; j < visible; ++j) sum += (prob[j] = exp(prob[j] - m));
        lse[(g.b * H + h) * p->seq_q + g.q0 + i] = m + log(sum);
        double delta = 0.0;
        for (int64_t j = 0; j < visible; ++j) {
          prob[j] /= sum;
          const uint32_t bits = tf_attn_dropout_bits(key, (uint32_t)sn, (uint32_t)h, (uint32_t)i, (uint32_t)j);
          keep[j] = p->dropout_p > 0.0f ? (bits >= threshold ? 1.0 / (1.0 - p->dropout_p) : 0.0) : 1.0;
        }
        for (int64_t d = 0; d < D; ++d) {
          double o = 0.0;
          for (int64_t j = 0; j < visible; ++j) o += prob[j] * keep[j] * at(v, g.b, g.k0 + j, hk, d);
          out[QI(g.b, g.q0 + i, h, d)] = o;
          delta += o * at(dout, g.b, g.q0 + i, h, d);
        }
        for (int64_t j = 0; j < visible; ++j) {
          double dpj = 0.0;
          for (int64_t d = 0; d < D; ++d) {
            dpj += at(dout, g.b, g.q0 + i, h, d) * at(v, g.b, g.k0 + j, hk, d);
            dv[KI(g.b, g.k0 + j, hk, d)] += prob[j] * keep[j] * at(dout, g.b, g.q0 + i, h, d);
          }
          dprob[j] = prob[j] * (dpj * keep[j] - delta);
          for (int64_t d = 0; d < D; ++d) {
            dq[QI(g.b, g.q0 + i, h, d)] += p->softmax_scale * dprob[j] * at(k, g.b, g.k0 + j, hk, d);
            dk[KI(g.b, g.k0 + j, hk, d)] += p->softmax_scale * dprob[j] * at(q, g.b, g.q0 + i, h, d);
          }
        }
      }
    }
  }
#undef QI
#undef KI
  free(prob);
  free(keep);
  free(dprob);
}

static double max_error(const buffer *x, const double *ref, int64_t b, int64_t s, int64_t h, int64_t d) {
  double e = 0.0;
  for (int64_t ib = 0; ib < b; ++ib)
    for (int64_t is = 0; is < s; ++is)
      for (int64_t ih = 0; ih < h; ++ih)
        for (int64_t id = 0; id < d; ++id) {
          const double diff = fabs(at(x, ib, is, ih, id) - ref[((ib * s + is) * h + ih) * d + id]);
          e = diff > e || isnan(diff) ? diff : e;
        }
  return e;
}

static float *scratch_for(int64_t floats) { return malloc((size_t)floats * sizeof(float)); }

/* Runs forward and backward of p in float32 and compares with the naive reference. */
static void check_against_reference(const char *name, tf_attn_problem p) {
  const int64_t B = p.batch, Sq = p.seq_q, Skv = p.seq_kv, H = p.heads_q, Hk = p.heads_kv, D = p.head_dim;
  buffer q = make_buffer(B, Sq, H, D, 1.5), k = make_buffer(B, Skv, Hk, D, 1.5), v = make_buffer(B, Skv, Hk, D, 1.0);
  buffer dout = make_buffer(B, Sq, H, D, 1.0);
  buffer out = make_buffer(B, Sq, H, D, 0.0), dq = make_buffer(B, Sq, H, D, 0.0);
  buffer dk = make_buffer(B, Skv, Hk, D, 0.0), dv = make_buffer(B, Skv, Hk, D, 0.0);
  /* Poison the outputs: every element must be written. */
  for (int64_t i = 0; i < B * Sq * H * D; ++i) out.data[i] = dq.data[i] = NAN;
  for (int64_t i = 0; i < B * Skv * Hk * D; ++i) dk.data[i] = dv.data[i] = NAN;
  const int64_t stats = B * H * Sq;
  float *lse = malloc((size_t)stats * sizeof(float)), *delta = malloc((size_t)stats * sizeof(float));
  float *scratch = scratch_for(tf_attn_fwd_scratch_floats(&p) > tf_attn_bwd_scratch_floats(&p)
                                   ? tf_attn_fwd_scratch_floats(&p)
                                   : tf_attn_bwd_scratch_floats(&p));
  /* Two calls over split unit ranges, as two threads would. */
  const int64_t units = tf_attn_fwd_units(&p);
  CHECK(tf_attn_fwd(&p, &q.op, &k.op, &v.op, &out.op, lse, 0, units / 2, scratch) == TF_OK, "%s fwd", name);
  CHECK(tf_attn_fwd(&p, &q.op, &k.op, &v.op, &out.op, lse, units / 2, units, scratch) == TF_OK, "%s fwd", name);
  const int64_t runits = tf_attn_rowdot_units(&p);
  CHECK(tf_attn_bwd_rowdot(&p, &dout.op, &out.op, delta, 0, runits / 2) == TF_OK, "%s rowdot", name);
  CHECK(tf_attn_bwd_rowdot(&p, &dout.op, &out.op, delta, runits / 2, runits) == TF_OK, "%s rowdot", name);
  const int64_t bunits = tf_attn_bwd_units(&p);
  CHECK(tf_attn_bwd(&p, &dout.op, &q.op, &k.op, &v.op, lse, delta, &dq.op, &dq.op, &dk.op, &dv.op, 0, bunits,
                    scratch) == TF_OK, "%s bwd", name);
  /* The two-pass backward, into its own (poisoned) buffers. */
  buffer dq2 = make_buffer(B, Sq, H, D, 0.0), dk2 = make_buffer(B, Skv, Hk, D, 0.0), dv2 = make_buffer(B, Skv, Hk, D, 0.0);
  for (int64_t i = 0; i < B * Sq * H * D; ++i) dq2.data[i] = NAN;
  for (int64_t i = 0; i < B * Skv * Hk * D; ++i) dk2.data[i] = dv2.data[i] = NAN;
  const int64_t kunits = tf_attn_bwd_dkdv_units(&p);
  CHECK(tf_attn_bwd_dkdv(&p, &dout.op, &q.op, &k.op, &v.op, lse, delta, &dk2.op, &dv2.op, 0, kunits / 3, scratch) ==
            TF_OK && tf_attn_bwd_dkdv(&p, &dout.op, &q.op, &k.op, &v.op, lse, delta, &dk2.op, &dv2.op, kunits / 3,
                                      kunits, scratch) == TF_OK, "%s bwd dkdv", name);
  CHECK(tf_attn_bwd_dq(&p, &dout.op, &q.op, &k.op, &v.op, lse, delta, &dq2.op, 0, units, scratch) == TF_OK,
        "%s bwd dq", name);

  double *r_out = malloc((size_t)(B * Sq * H * D) * sizeof(double)), *r_lse = malloc((size_t)stats * sizeof(double));
  double *r_dq = malloc((size_t)(B * Sq * H * D) * sizeof(double));
  double *r_dk = malloc((size_t)(B * Skv * Hk * D) * sizeof(double)), *r_dv = malloc((size_t)(B * Skv * Hk * D) * sizeof(double));
  reference(&p, &q, &k, &v, &dout, r_out, r_lse, r_dq, r_dk, r_dv);
  double lse_err = 0.0;
  for (int64_t i = 0; i < stats; ++i) {
    const double e = isinf(r_lse[i]) ? (lse[i] == r_lse[i] ? 0.0 : INFINITY) : fabs(lse[i] - r_lse[i]);
    lse_err = e > lse_err || isnan(e) ? e : lse_err;
  }
  CHECK(max_error(&out, r_out, B, Sq, H, D) < 2e-5, "%s out error %g", name, max_error(&out, r_out, B, Sq, H, D));
  CHECK(lse_err < 2e-5, "%s lse error %g", name, lse_err);
  CHECK(max_error(&dq, r_dq, B, Sq, H, D) < 2e-4, "%s dq error %g", name, max_error(&dq, r_dq, B, Sq, H, D));
  CHECK(max_error(&dk, r_dk, B, Skv, Hk, D) < 2e-4, "%s dk error %g", name, max_error(&dk, r_dk, B, Skv, Hk, D));
  CHECK(max_error(&dv, r_dv, B, Skv, Hk, D) < 2e-4, "%s dv error %g", name, max_error(&dv, r_dv, B, Skv, Hk, D));
  CHECK(max_error(&dq2, r_dq, B, Sq, H, D) < 2e-4, "%s split dq error %g", name, max_error(&dq2, r_dq, B, Sq, H, D));
  CHECK(max_error(&dk2, r_dk, B, Skv, Hk, D) < 2e-4, "%s split dk error %g", name, max_error(&dk2, r_dk, B, Skv, Hk, D));
  CHECK(max_error(&dv2, r_dv, B, Skv, Hk, D) < 2e-4, "%s split dv error %g", name, max_error(&dv2, r_dv, B, Skv, Hk, D));
  free(dq2.data), free(dk2.data), free(dv2.data);
  free(r_out), free(r_lse), free(r_dq), free(r_dk), free(r_dv);
  free(q.data), free(k.data), free(v.data), free(dout.data), free(out.data), free(dq.data), free(dk.data);
  free(dv.data), free(lse), free(delta), free(scratch);
}

static tf_attn_problem problem(int64_t b, int64_t sq, int64_t skv, int64_t h, int64_t hk, int64_t d, int causal) {
  tf_attn_problem p;
  memset(&p, 0, sizeof p);
  p.batch = b, p.seq_q = sq, p.seq_kv = skv, p.heads_q = h, p.heads_kv = hk, p.head_dim = d;
  p.softmax_scale = (float)(1.0 / sqrt((double)d));
  p.causal = causal;
  return p;
}

static void test_numerics(void) {
  check_against_reference("no mask", problem(2, 70, 70, 2, 2, 16, 0));
  check_against_reference("causal gqa tiles", problem(1, 150, 150, 4, 2, 17, 1));
  check_against_reference("cross causal", problem(2, 131, 67, 2, 1, 1, 1));
  check_against_reference("head dim 100", problem(1, 40, 90, 2, 2, 100, 0));
  tf_attn_problem p = problem(3, 45, 50, 2, 1, 8, 1);
  const int32_t lq[3] = {45, 0, 13}, lkv[3] = {50, 7, 0};
  p.seqlens_q = lq, p.seqlens_kv = lkv;
  check_against_reference("padding causal, empty rows", p);
  tf_attn_problem packed = problem(1, 160, 140, 3, 3, 9, 1);
  const int32_t cu_q[4] = {0, 1, 130, 150}, cu_kv[4] = {0, 5, 5, 140};
  packed.cu_seqlens_q = cu_q, packed.cu_seqlens_kv = cu_kv, packed.num_seqs = 3;
  check_against_reference("packed with tail", packed);
  tf_attn_problem drop = problem(2, 70, 80, 2, 2, 12, 1);
  drop.dropout_p = 0.25f, drop.seed = 42, drop.offset = 9;
  check_against_reference("dropout", drop);
  /* Sequences of several query tiles: the forward computes two of a head's tiles together when a call holds both. */
  check_against_reference("query tile blocks", problem(1, 300, 200, 2, 2, 64, 0));
  tf_attn_problem blocks = problem(2, 400, 390, 2, 1, 24, 1);
  const int32_t blq[2] = {400, 290}, blkv[2] = {390, 301};
  blocks.seqlens_q = blq, blocks.seqlens_kv = blkv;
  blocks.dropout_p = 0.1f, blocks.seed = 5, blocks.offset = 3;
  check_against_reference("query tile blocks, padding causal, dropout", blocks);
}

/*
 * FP8 E4M3 inputs with descales and a bf16 output, against float32 inputs
 * holding the decoded values. The E4M3 problem takes the AMX path where
 * tf_attn_amx_applies says so (an AMX CPU at the amx tier; in the emulated
 * build, emulate_amx turns the tile model on for its forward), else the
 * vector path's bf16 products where tf_attn_bf16_applies says so (the
 * avx512_bf16 tier and above), and both round P to bf16; the float32
 * one always the vector path.
 */
static void test_fp8_and_bf16(int emulate_amx) {
  tf_attn_problem p = problem(1, 33, 33, 2, 2, 16, 1);
  const int64_t n = 33 * 2 * 16;
  uint8_t *q8 = malloc((size_t)n), *k8 = malloc((size_t)n), *v8 = malloc((size_t)n);
  buffer qf = make_buffer(1, 33, 2, 16, 0), kf = make_buffer(1, 33, 2, 16, 0), vf = make_buffer(1, 33, 2, 16, 0);
  const float descale[3] = {0.01f, 0.02f, 0.005f};
  for (int64_t i = 0; i < n; ++i) {
    q8[i] = tf_fp8_e4m3_encode((float)(300 * uniform()));
    k8[i] = tf_fp8_e4m3_encode((float)(300 * uniform()));
    v8[i] = tf_fp8_e4m3_encode((float)(300 * uniform()));
    qf.data[i] = tf_fp8_e4m3_decode(q8[i]) * descale[0];
    kf.data[i] = tf_fp8_e4m3_decode(k8[i]) * descale[1];
    vf.data[i] = tf_fp8_e4m3_decode(v8[i]) * descale[2];
  }
  tf_attn_operand o8[3] = {qf.op, kf.op, vf.op};
  o8[0].data = q8, o8[1].data = k8, o8[2].data = v8;
  for (int i = 0; i < 3; ++i) o8[i].elem = TF_ATTN_E4M3, o8[i].descale = descale[i];
  buffer out_f = make_buffer(1, 33, 2, 16, 0);
  uint16_t *out_bf = malloc((size_t)n * sizeof(uint16_t));
  tf_attn_operand obf = out_f.op;
  obf.data = out_bf, obf.elem = TF_ATTN_BF16;
  float lse[66], lse_f[66];
  float *scratch = scratch_for(tf_attn_fwd_scratch_floats(&p));
  const int64_t units = tf_attn_fwd_units(&p);
#if defined(TF_ATTN_AMX_EMULATE)
  tf_attn_amx_emulated = emulate_amx;
#else
  (void)emulate_amx;
#endif
  const int amx = tf_attn_amx_applies(&p, &o8[0]);
  const int rounded_p = amx || tf_attn_bf16_applies(&p, &o8[0], &o8[1], &o8[2]);
  CHECK(tf_attn_fwd(&p, &o8[0], &o8[1], &o8[2], &obf, lse, 0, units, scratch) == TF_OK, "fp8 fwd");
#if defined(TF_ATTN_AMX_EMULATE)
  tf_attn_amx_emulated = 0;
  CHECK(amx == emulate_amx, "fp8 problem takes the %s path", emulate_amx ? "AMX" : "vector");
#endif
  CHECK(tf_attn_fwd(&p, &qf.op, &kf.op, &vf.op, &out_f.op, lse_f, 0, units, scratch) == TF_OK, "f32 fwd");
  /*
   * Vector path: the same values up to float32 rounding (the descale is folded
   * into another multiply), then bf16 rounding of out: relative 1/256.
   * AMX path and bf16 products: P is rounded to bf16 (relative 2^-8 at most) before P.V, while the
   * float32 problem keeps P in float32 and both divide by the float32 row sum
   * l, so out differs by at most 2^-8 sum_j (p_j / l) |v_j| <= 2^-8 max|v| (the
   * largest |v| of the element's kv head); out can be near zero through
   * cancellation, so no relative bound holds. The bound checked is
   *   |out_bf - out_f| <= 2^-8 max|v| + 2^-8 |out_f|,
   * the second term for the bf16 rounding of out. e is |out_bf - out_f| over
   * the allowed error, so both paths pass at e <= 1.
   */
  double vmax[2] = {0.0, 0.0};
  for (int64_t i = 0; i < n; ++i) vmax[i / 16 % 2] = fmax(vmax[i / 16 % 2], fabs(vf.data[i]));
  double out_err = 0.0, lse_err = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double diff = fabs(tf_bf16_to_f32(out_bf[i]) - out_f.data[i]), f = fabs(out_f.data[i]);
    const double e = rounded_p ? diff / (0x1p-8 * vmax[i / 16 % 2] + 0x1p-8 * f) : diff / (f + 1e-3) * 256.0;
    out_err = e > out_err || isnan(e) ? e : out_err;
  }
  for (int i = 0; i < 66; ++i) lse_err = fabs(lse[i] - lse_f[i]) > lse_err ? fabs(lse[i] - lse_f[i]) : lse_err;
  CHECK(out_err <= 1.0 && lse_err < 1e-5, "fp8 vs decoded float32 (%s path): out %g of the bound, lse %g",
        amx ? "AMX" : rounded_p ? "bf16 products" : "vector", out_err, lse_err);
  free(q8), free(k8), free(v8), free(qf.data), free(kf.data), free(vf.data), free(out_f.data), free(out_bf);
  free(scratch);
}

/*
 * The paths that round P (and dS) to bf16: in the emulated build the AMX
 * kernels on the tile model, otherwise the vector path's bf16 products (the
 * avx512_bf16 tier, also on an AMX CPU). on = 0 selects the float32 vector
 * path (at the avx512 tier outside the emulated build).
 */
static void select_bf16_path(int on) {
#if defined(TF_ATTN_AMX_EMULATE)
  tf_attn_amx_emulated = on;
#else
  tf_set_cpu_isa_cap(on ? TF_ISA_AVX512_BF16 : TF_ISA_AVX512);
#endif
}

static int bf16_path_applies(const tf_attn_problem *p, const tf_attn_operand *qkv, const tf_attn_operand *dout) {
#if defined(TF_ATTN_AMX_EMULATE)
  return dout ? tf_attn_amx_bwd_applies(p, &qkv[0], dout) : tf_attn_amx_applies(p, &qkv[0]);
#else
  return dout ? tf_attn_bf16_bwd_applies(p, &qkv[0], &qkv[1], &qkv[2], dout)
              : tf_attn_bf16_applies(p, &qkv[0], &qkv[1], &qkv[2]);
#endif
}

/* x rounded in place to `elem` (bf16, or E4M3 of x / descale times descale); its encoding in a new array. */
static void *encode_as(buffer *x, int64_t n, tf_attn_elem elem, float descale) {
  if (elem == TF_ATTN_BF16) {
    uint16_t *bits = malloc((size_t)n * sizeof(uint16_t));
    for (int64_t i = 0; i < n; ++i) x->data[i] = tf_bf16_to_f32(bits[i] = tf_f32_to_bf16(x->data[i]));
    return bits;
  }
  uint8_t *bytes = malloc((size_t)n);
  for (int64_t i = 0; i < n; ++i) x->data[i] = tf_fp8_e4m3_decode(bytes[i] = tf_fp8_e4m3_encode(x->data[i] / descale)) * descale;
  return bytes;
}

/*
 * A path that rounds P to bf16 (select_bf16_path) with bf16 or E4M3
 * q/k/v against the double reference of the same values and against the
 * float32 vector path: P is rounded to bf16 for P.V, so out may differ by about
 * 2^-9 of |v|; lse comes from float32 sums of exact products.
 */
static void check_bf16_path(const char *name, tf_attn_problem p, tf_attn_elem elem) {
  const int64_t B = p.batch, Sq = p.seq_q, Skv = p.seq_kv, H = p.heads_q, Hk = p.heads_kv, D = p.head_dim;
  const int64_t nq = B * Sq * H * D, nkv = B * Skv * Hk * D, stats = B * H * Sq;
  const float descale[3] = {elem == TF_ATTN_E4M3 ? 0.01f : 1.0f, elem == TF_ATTN_E4M3 ? 0.02f : 1.0f,
                            elem == TF_ATTN_E4M3 ? 0.005f : 1.0f};
  buffer q = make_buffer(B, Sq, H, D, 1.5), k = make_buffer(B, Skv, Hk, D, 1.5), v = make_buffer(B, Skv, Hk, D, 1.0);
  buffer dout = make_buffer(B, Sq, H, D, 1.0);
  tf_attn_operand enc[3] = {q.op, k.op, v.op};
  buffer *src[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    enc[i].data = encode_as(src[i], i == 0 ? nq : nkv, elem, descale[i]);
    enc[i].elem = elem;
    enc[i].descale = descale[i];
  }
  buffer out = make_buffer(B, Sq, H, D, 0.0), out_vec = make_buffer(B, Sq, H, D, 0.0);
  for (int64_t i = 0; i < nq; ++i) out.data[i] = out_vec.data[i] = NAN;
  float *lse = malloc((size_t)stats * sizeof(float)), *lse_vec = malloc((size_t)stats * sizeof(float));
  float *scratch = scratch_for(tf_attn_fwd_scratch_floats(&p));
  const int64_t units = tf_attn_fwd_units(&p);
  select_bf16_path(1);
  CHECK(bf16_path_applies(&p, enc, NULL), "%s takes the path", name);
  CHECK(tf_attn_fwd(&p, &enc[0], &enc[1], &enc[2], &out.op, lse, 0, units / 2, scratch) == TF_OK &&
            tf_attn_fwd(&p, &enc[0], &enc[1], &enc[2], &out.op, lse, units / 2, units, scratch) == TF_OK,
        "%s fwd", name);
  select_bf16_path(0);
  CHECK(tf_attn_fwd(&p, &enc[0], &enc[1], &enc[2], &out_vec.op, lse_vec, 0, units, scratch) == TF_OK,
        "%s vector fwd", name);
  double *r_out = malloc((size_t)nq * sizeof(double)), *r_lse = malloc((size_t)stats * sizeof(double));
  double *r_dq = malloc((size_t)nq * sizeof(double));
  double *r_dk = malloc((size_t)nkv * sizeof(double)), *r_dv = malloc((size_t)nkv * sizeof(double));
  reference(&p, &q, &k, &v, &dout, r_out, r_lse, r_dq, r_dk, r_dv);
  double lse_err = 0.0, vec_out = 0.0, vec_lse = 0.0;
  for (int64_t i = 0; i < stats; ++i) {
    const double e = isinf(r_lse[i]) ? (lse[i] == r_lse[i] ? 0.0 : INFINITY) : fabs(lse[i] - r_lse[i]);
    lse_err = e > lse_err || isnan(e) ? e : lse_err;
    const double ev = isinf(lse_vec[i]) ? (lse[i] == lse_vec[i] ? 0.0 : INFINITY) : fabs(lse[i] - lse_vec[i]);
    vec_lse = ev > vec_lse || isnan(ev) ? ev : vec_lse;
  }
  for (int64_t i = 0; i < nq; ++i) {
    const double e = fabs((double)out.data[i] - out_vec.data[i]);
    vec_out = e > vec_out || isnan(e) ? e : vec_out;
  }
  /* |v| <= 1, so 4e-3 is twice the bound of P's bf16 rounding. */
  CHECK(max_error(&out, r_out, B, Sq, H, D) < 4e-3, "%s out error %g", name, max_error(&out, r_out, B, Sq, H, D));
  CHECK(lse_err < 1e-4, "%s lse error %g", name, lse_err);
  CHECK(vec_out < 4e-3 && vec_lse < 1e-4, "%s vs vector path: out %g, lse %g", name, vec_out, vec_lse);

  /*
   * Backward with a bf16 dout, fused and split, on the same path: P and dS are
   * rounded to bf16 for the tile products, so the gradients may differ by
   * about 2^-8 of their largest magnitude.
   */
  tf_attn_operand dout_bf = dout.op;
  dout_bf.data = encode_as(&dout, nq, TF_ATTN_BF16, 1.0f);
  dout_bf.elem = TF_ATTN_BF16;
  reference(&p, &q, &k, &v, &dout, r_out, r_lse, r_dq, r_dk, r_dv);
  float *delta = malloc((size_t)stats * sizeof(float));
  float *bscratch = scratch_for(tf_attn_bwd_scratch_floats(&p));
  buffer g[6];
  for (int i = 0; i < 6; ++i) {
    const int kv = i % 3 != 0;
    g[i] = make_buffer(B, kv ? Skv : Sq, kv ? Hk : H, D, 0.0);
    for (int64_t e = 0; e < (kv ? nkv : nq); ++e) g[i].data[e] = NAN;
  }
  const int64_t bunits = tf_attn_bwd_units(&p), kunits = tf_attn_bwd_dkdv_units(&p);
  select_bf16_path(1);
  CHECK(bf16_path_applies(&p, enc, &dout_bf), "%s backward takes the path", name);
  CHECK(tf_attn_bwd_rowdot(&p, &dout_bf, &out.op, delta, 0, tf_attn_rowdot_units(&p)) == TF_OK, "%s rowdot", name);
  CHECK(tf_attn_bwd(&p, &dout_bf, &enc[0], &enc[1], &enc[2], lse, delta, &g[0].op, &g[0].op, &g[1].op, &g[2].op, 0,
                    bunits, bscratch) == TF_OK, "%s bwd", name);
  CHECK(tf_attn_bwd_dkdv(&p, &dout_bf, &enc[0], &enc[1], &enc[2], lse, delta, &g[4].op, &g[5].op, 0, kunits,
                         bscratch) == TF_OK &&
            tf_attn_bwd_dq(&p, &dout_bf, &enc[0], &enc[1], &enc[2], lse, delta, &g[3].op, 0, units, bscratch) == TF_OK,
        "%s split bwd", name);
  select_bf16_path(0);
  const double *refs[3] = {r_dq, r_dk, r_dv};
  const char *names[3] = {"dq", "dk", "dv"};
  for (int i = 0; i < 6; ++i) {
    const int kv = i % 3 != 0;
    const double *r = refs[i % 3];
    double big = 0.0;
    for (int64_t e = 0; e < (kv ? nkv : nq); ++e) big = fabs(r[e]) > big ? fabs(r[e]) : big;
    const double err = max_error(&g[i], r, B, kv ? Skv : Sq, kv ? Hk : H, D);
    CHECK(err <= 8e-3 * (big > 1.0 ? big : 1.0), "%s %s%s error %g (largest %g)", name, i < 3 ? "" : "split ",
          names[i % 3], err, big);
  }
  for (int i = 0; i < 6; ++i) free(g[i].data);
  free(dout_bf.data), free(delta), free(bscratch);
  for (int i = 0; i < 3; ++i) free(enc[i].data);
  free(r_out), free(r_lse), free(r_dq), free(r_dk), free(r_dv);
  free(q.data), free(k.data), free(v.data), free(dout.data), free(out.data), free(out_vec.data);
  free(lse), free(lse_vec), free(scratch);
}

static void test_bf16_paths(void) {
  const tf_attn_elem elems[2] = {TF_ATTN_BF16, TF_ATTN_E4M3};
  for (int e = 0; e < 2; ++e) {
    const tf_attn_elem el = elems[e];
    check_bf16_path("no mask", problem(2, 70, 70, 2, 2, 16, 0), el);
    check_bf16_path("causal gqa tiles", problem(1, 150, 150, 4, 2, 17, 1), el);
    check_bf16_path("cross causal d1", problem(2, 131, 67, 2, 1, 1, 1), el);
    check_bf16_path("head dim 100", problem(1, 40, 90, 2, 2, 100, 0), el);
    tf_attn_problem pad = problem(3, 45, 50, 2, 1, 8, 1);
    const int32_t lq[3] = {45, 0, 13}, lkv[3] = {50, 7, 0};
    pad.seqlens_q = lq, pad.seqlens_kv = lkv;
    check_bf16_path("padding causal, empty rows", pad, el);
    tf_attn_problem packed = problem(1, 160, 140, 3, 3, 9, 1);
    const int32_t cu_q[4] = {0, 1, 130, 150}, cu_kv[4] = {0, 5, 5, 140};
    packed.cu_seqlens_q = cu_q, packed.cu_seqlens_kv = cu_kv, packed.num_seqs = 3;
    check_bf16_path("packed with tail", packed, el);
    check_bf16_path("query tiles d64 causal", problem(1, 300, 300, 2, 2, 64, 1), el);
  }
  check_bf16_path("head dim 256", problem(1, 40, 33, 1, 1, 256, 1), TF_ATTN_BF16);
}

/* The softmax's 2^x (attention_tile.h) against exp2 in double, on a sweep and its edge values. */
static void test_exp2(void) {
  double worst = 0.0;
  int edges_ok = 1;
  for (int64_t i = 0; i <= 140000; i += TF_ATTN_VW) {
    tf_vf x;
    for (int l = 0; l < TF_ATTN_VW; ++l) x[l] = (float)(-138.0 + (double)(i + l) * 1e-3);
    const tf_vf y = tf_vf_exp2(x);
    for (int l = 0; l < TF_ATTN_VW; ++l) {
      const double want = exp2((double)x[l]);
      if (x[l] >= -126.0f)
        worst = fmax(worst, fabs((double)y[l] - want) / want);
      else if (x[l] <= -127.0f)
        edges_ok &= y[l] == 0.0f;
      else
        edges_ok &= fabs((double)y[l] - want) < 0x1p-126; /* flushed or subnormal */
    }
  }
  CHECK(worst < 3e-7, "2^x relative error %.3g over [-126, 2]", worst);
  CHECK(edges_ok, "2^x is 0 at and below -127");
  const tf_vf special = tf_vf_splat(-INFINITY) + (tf_vf){0.0f, NAN, INFINITY * 0.0f};
  const tf_vf y = tf_vf_exp2(special);
  CHECK(y[0] == 0.0f && isnan(y[1]) && isnan(y[2]) && y[3] == 0.0f, "2^-inf = 0 and NaN stays NaN");
}

static void test_dropout_rng(void) {
  const tf_attn_dropout_key_t key = tf_attn_dropout_key(7, 0);
  const uint32_t threshold = tf_attn_dropout_threshold(0.1f);
  int64_t kept = 0;
  for (uint32_t i = 0; i < 200; ++i)
    for (uint32_t j = 0; j < 200; ++j) kept += tf_attn_dropout_bits(key, 0, 0, i, j) >= threshold;
  CHECK(fabs((double)kept / 40000.0 - 0.9) < 0.01, "keep rate %g", (double)kept / 40000.0);
  CHECK(tf_attn_dropout_threshold(0.0f) == 0u, "p = 0 keeps everything");
  CHECK(tf_attn_dropout_bits(key, 1, 2, 3, 4) == tf_attn_dropout_bits(tf_attn_dropout_key(7, 0), 1, 2, 3, 4),
        "reproducible");
  CHECK(tf_attn_dropout_bits(key, 1, 2, 3, 4) != tf_attn_dropout_bits(tf_attn_dropout_key(7, 1), 1, 2, 3, 4),
        "the offset changes the stream");
}

static void test_checks(void) {
  tf_attn_problem p = problem(1, 8, 8, 2, 2, 4, 0);
  float data[8 * 2 * 4], lse[16];
  float *scratch = scratch_for(tf_attn_fwd_scratch_floats(&p) > tf_attn_bwd_scratch_floats(&p)
                                   ? tf_attn_fwd_scratch_floats(&p)
                                   : tf_attn_bwd_scratch_floats(&p));
  tf_attn_operand op = {data, TF_ATTN_F32, 64, 8, 4, 1.0f};
  CHECK(tf_attn_check(NULL) == TF_ERR_NULL_POINTER, "null problem");
  CHECK(tf_attn_check(&p) == TF_OK, "valid problem");
  tf_attn_problem bad = p;
  bad.seq_q = -1;
  CHECK(tf_attn_check(&bad) == TF_ERR_BAD_SIZE, "negative seq");
  bad = p, bad.heads_kv = 3;
  CHECK(tf_attn_check(&bad) == TF_ERR_BAD_SIZE, "heads not divisible");
  bad = p, bad.head_dim = 0;
  CHECK(tf_attn_check(&bad) == TF_ERR_BAD_SIZE, "zero head dim");
  bad = p, bad.head_dim = INT64_MAX;
  CHECK(tf_attn_check(&bad) == TF_ERR_BAD_SIZE, "huge head dim");
  bad = p, bad.batch = INT64_MAX / 2, bad.seq_q = 1 << 20;
  CHECK(tf_attn_check(&bad) == TF_ERR_OVERFLOW, "lse size overflows");
  bad = p, bad.dropout_p = 1.0f;
  CHECK(tf_attn_check(&bad) == TF_ERR_BAD_ARGUMENT, "dropout 1");
  bad = p, bad.softmax_scale = NAN;
  CHECK(tf_attn_check(&bad) == TF_ERR_BAD_ARGUMENT, "NaN scale");
  const int32_t lens_bad[1] = {9}, cu_bad[3] = {0, 5, 3}, cu_far[3] = {0, 5, 9}, cu_ok[3] = {0, 4, 8};
  bad = p, bad.seqlens_q = lens_bad;
  CHECK(tf_attn_check(&bad) == TF_ERR_BAD_SIZE, "seqlens past the sequence");
  bad = p, bad.cu_seqlens_q = cu_bad, bad.cu_seqlens_kv = cu_ok, bad.num_seqs = 2;
  CHECK(tf_attn_check(&bad) == TF_ERR_BAD_SIZE, "decreasing cu_seqlens");
  bad.cu_seqlens_q = cu_far;
  CHECK(tf_attn_check(&bad) == TF_ERR_BAD_SIZE, "cu_seqlens past the tokens");
  bad.cu_seqlens_kv = NULL;
  CHECK(tf_attn_check(&bad) == TF_ERR_BAD_ARGUMENT, "one cu_seqlens only");
  bad = p, bad.batch = 2, bad.cu_seqlens_q = cu_ok, bad.cu_seqlens_kv = cu_ok, bad.num_seqs = 2;
  CHECK(tf_attn_check(&bad) == TF_ERR_BAD_SIZE, "packed with batch 2");

  CHECK(tf_attn_fwd(&p, &op, &op, &op, &op, lse, 0, tf_attn_fwd_units(&p), scratch) == TF_OK, "valid call");
  CHECK(tf_attn_fwd(&p, &op, &op, &op, &op, lse, 0, tf_attn_fwd_units(&p) + 1, scratch) == TF_ERR_BAD_SIZE,
        "unit range past the end");
  /* The row-dot pass takes every head of a (sequence, query tile) in one unit. */
  CHECK(tf_attn_rowdot_units(&p) == 1, "row-dot units: %lld", (long long)tf_attn_rowdot_units(&p));
  CHECK(tf_attn_bwd_rowdot(&p, &op, &op, lse, 0, 2) == TF_ERR_BAD_SIZE, "row-dot range past the end");
  CHECK(tf_attn_bwd_rowdot(&p, &op, &op, NULL, 0, 1) == TF_ERR_NULL_POINTER, "null delta");
  CHECK(tf_attn_fwd(&p, &op, &op, &op, &op, NULL, 0, 1, scratch) == TF_ERR_NULL_POINTER, "null lse");
  CHECK(tf_attn_fwd(&p, NULL, &op, &op, &op, lse, 0, 1, scratch) == TF_ERR_NULL_POINTER, "null operand");
  tf_attn_operand o = op;
  o.data = NULL;
  CHECK(tf_attn_fwd(&p, &o, &op, &op, &op, lse, 0, 1, scratch) == TF_ERR_NULL_POINTER, "null data");
  o = op, o.stride_s = -1;
  CHECK(tf_attn_fwd(&p, &o, &op, &op, &op, lse, 0, 1, scratch) == TF_ERR_BAD_SIZE, "negative stride");
  o = op, o.stride_s = INT64_MAX / 4;
  CHECK(tf_attn_fwd(&p, &o, &op, &op, &op, lse, 0, 1, scratch) == TF_ERR_OVERFLOW, "extent overflows");
  o = op, o.elem = TF_ATTN_E4M3;
  CHECK(tf_attn_fwd(&p, &op, &op, &op, &o, lse, 0, 1, scratch) == TF_ERR_BAD_DTYPE, "FP8 output");
  o = op, o.elem = (tf_attn_elem)9;
  CHECK(tf_attn_fwd(&p, &o, &op, &op, &op, lse, 0, 1, scratch) == TF_ERR_BAD_DTYPE, "unknown dtype");
  uint16_t half[8 * 2 * 4];
  tf_attn_operand h = op;
  h.data = half, h.elem = TF_ATTN_BF16;
  CHECK(tf_attn_bwd(&p, &op, &op, &op, &op, lse, lse, &h, &op, &op, &op, 0, 1, scratch) == TF_ERR_BAD_DTYPE,
        "non-float32 dq accumulator");
  h.data = data;
  CHECK(tf_attn_bwd(&p, &op, &op, &op, &op, lse, lse, &op, &h, &op, &op, 0, 1, scratch) == TF_ERR_BAD_ARGUMENT,
        "dq accumulator aliasing a bf16 dq");
  CHECK(tf_attn_bwd_dkdv(&p, &op, &op, &op, &op, lse, lse, &op, &op, 0, tf_attn_bwd_dkdv_units(&p) + 1, scratch) ==
            TF_ERR_BAD_SIZE, "dkdv unit range past the end");
  CHECK(tf_attn_bwd_dq(&p, &op, &op, &op, &op, NULL, lse, &op, 0, 1, scratch) == TF_ERR_NULL_POINTER, "dq null lse");
  o = op, o.elem = TF_ATTN_E4M3;
  CHECK(tf_attn_bwd_dq(&p, &op, &op, &op, &op, lse, lse, &o, 0, 1, scratch) == TF_ERR_BAD_DTYPE, "FP8 dq");
  tf_attn_problem empty = problem(0, 0, 0, 1, 1, 4, 1);
  CHECK(tf_attn_fwd_units(&empty) == 0 && tf_attn_fwd(&empty, &op, &op, &op, &op, NULL, 0, 0, NULL) == TF_OK,
        "empty problem");
  free(scratch);
}

int main(void) {
  /*
   * The vector path at the portable tier (its 16-float baseline build) and
   * at the CPU's best (on an AVX2 CPU its 8-float AVX2 build).
   */
  const int caps[2] = {TF_ISA_PORTABLE, -1};
  for (int i = 0; i < 2; ++i) {
    CHECK(tf_set_cpu_isa_cap(caps[i]) == TF_OK, "tf_set_cpu_isa_cap(%d)", caps[i]);
    printf("vector path at the %s tier\n", tf_isa_name(tf_cpu_isa()));
    test_numerics();
    test_fp8_and_bf16(0);
  }
#if defined(TF_ATTN_AMX_EMULATE)
  test_fp8_and_bf16(1);
  printf("AMX kernels on the tile model\n");
  test_bf16_paths();
#else
  if (tf_cpu_isa_detected() >= TF_ISA_AVX512_BF16) {
    printf("vector path with bf16 products\n");
    test_bf16_paths();
    tf_set_cpu_isa_cap(-1);
  }
#endif
  test_exp2();
  test_dropout_rng();
  test_checks();
  return check_report();
}
