/*
 * The vector path with bf16 products (vdpbf16ps: bf16 x bf16 exact, float32
 * accumulation) for bf16 and FP8 E4M3 q/k/v, at the avx512_bf16 tier and above
 * where the AMX path does not take the problem. The numerics are the AMX
 * path's (attention_amx.h, csrc/README.md): products of the raw bf16 values
 * (E4M3 decoded exactly, descales applied to the float32 results), softmax in
 * float32, P (and in the backward dS) rounded to bf16 for the products that
 * take them.
 *
 * The unit bodies are those of attention_fwd_body.h and attention_bwd_body.h,
 * built with TF_ATTN_BF16_DOT set (attention_fwd_bf16.c, attention_bwd_bf16.c)
 * for x86-64-v4 plus AVX512-BF16 by a function attribute, so the library still
 * loads on any x86-64.
 */
#ifndef TF_ATTENTION_BF16_H
#define TF_ATTENTION_BF16_H

#include "attention.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define TF_ATTN_BF16_BUILT 1
#define TF_ATTN_BF16_TARGET __attribute__((target("arch=x86-64-v4,avx512bf16")))
#else
#define TF_ATTN_BF16_BUILT 0
#endif

/* Whether the forward takes this path: q, k, v each bf16 or E4M3, no dropout, tier >= avx512_bf16. */
int tf_attn_bf16_applies(const tf_attn_problem *p, const tf_attn_operand *q,
                         const tf_attn_operand *k, const tf_attn_operand *v);

/* Floats of scratch its forward needs per unit (0 where it is not built). */
int64_t tf_attn_bf16_fwd_scratch_floats(const tf_attn_problem *p);

/* The forward of units [unit, unit + count), as fwd_block (attention_fwd_body.h); where built only. */
void tf_attn_bf16_fwd_block(const tf_attn_problem *p, const tf_attn_operand *q,
                            const tf_attn_operand *k, const tf_attn_operand *v,
                            const tf_attn_operand *out, float *lse, int64_t unit, int64_t count,
                            int64_t tiles, float *scratch);

/*
 * The backward takes this path where the forward does and dout is bf16, and
 * the AMX path does not take it (attention_bwd.c); where built only, the unit
 * functions of attention_bwd_body.h.
 */
int tf_attn_bf16_bwd_applies(const tf_attn_problem *p, const tf_attn_operand *q,
                             const tf_attn_operand *k, const tf_attn_operand *v,
                             const tf_attn_operand *dout);
int64_t tf_attn_bf16_bwd_scratch_floats(const tf_attn_problem *p);
void tf_attn_bf16_bwd_unit(const tf_attn_problem *p, const tf_attn_operand *dout,
                           const tf_attn_operand *q, const tf_attn_operand *k,
                           const tf_attn_operand *v, const float *lse, const float *delta,
                           const tf_attn_operand *acc, const tf_attn_operand *dq,
                           const tf_attn_operand *dk, const tf_attn_operand *dv, int64_t unit,
                           float *scratch);
void tf_attn_bf16_dkdv_unit(const tf_attn_problem *p, const tf_attn_operand *dout,
                            const tf_attn_operand *q, const tf_attn_operand *k,
                            const tf_attn_operand *v, const float *lse, const float *delta,
                            const tf_attn_operand *dk, const tf_attn_operand *dv, int64_t unit,
                            int64_t tiles, float *scratch);
void tf_attn_bf16_dq_unit(const tf_attn_problem *p, const tf_attn_operand *dout,
                          const tf_attn_operand *q, const tf_attn_operand *k,
                          const tf_attn_operand *v, const float *lse, const float *delta,
                          const tf_attn_operand *dq, int64_t unit, int64_t tiles, float *scratch);

#endif /* TF_ATTENTION_BF16_H */
