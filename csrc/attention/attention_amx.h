/*
 * The matrix-engine (AMX) path of the CPU attention, for bfloat16 and FP8
 * E4M3 q/k/v: the products run as tdpbf16ps tile products (bf16 x bf16,
 * float32 accumulation); softmax, scales and descales stay in float32.
 *
 * Every tile the kernels use is 16 rows x 64 bytes (16 floats, or 32 bf16 /
 * 16 bf16 pairs), so one tile configuration serves all of them:
 *   C (float32) 16 x 16  +=  A (bf16) 16 x 32  .  B (bf16 pairs) 16 x 16 x 2,
 * where B row r holds, for each of its 16 columns n, the pair
 * (B[2r][n], B[2r + 1][n]) ("VNNI" layout). Tile numbers: 0..3 accumulators,
 * 4 the A operand, 5 the B operand.
 *
 * tdpbf16ps adds the two exact products of a pair to the float32 accumulator
 * one at a time, each rounded to nearest even; it treats bf16 subnormal inputs
 * and float32 subnormal results as zero.
 *
 * Built for the machine: the kernels carry GCC's AMX target attribute and are
 * called only when tf_cpu_isa() reports AMX (cpu_features.h), so the library
 * loads on any CPU. Built with TF_ATTN_AMX_EMULATE (tests/c/run_attention.sh),
 * the same kernels run on a software model of the tiles below, with the
 * operand bytes read and written exactly as the hardware would (so ASan checks
 * every tile load and store), and tf_attn_amx_emulated switches them on.
 */
#ifndef TF_ATTENTION_AMX_H
#define TF_ATTENTION_AMX_H

#include <stdint.h>
#include <string.h>

#include "attention.h"

#if defined(TF_ATTN_AMX_EMULATE)
#define TF_ATTN_AMX_BUILT 1
#define TF_ATTN_AMX_TARGET
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TF_ATTN_AMX_BUILT 1
#define TF_ATTN_AMX_TARGET \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))
#else
#define TF_ATTN_AMX_BUILT 0
#endif

/* Keys per step of the P.V and dS.K products (the A tile's 32 bf16). */
#define TF_ATTN_AMX_K 32

/* Head dims the AMX path takes (larger ones run on the vector path). */
#define TF_ATTN_AMX_MAX_DIM 256

/* Head dim rounded up to whole A tiles (32 bf16). */
static inline int64_t tf_attn_amx_dim(int64_t head_dim) { return (head_dim + 31) / 32 * 32; }

/*
 * Whether the problem's q/k/v take the AMX path: bf16 or E4M3 operands, no
 * dropout, head dim at most TF_ATTN_AMX_MAX_DIM, and a CPU with AMX.
 */
int tf_attn_amx_applies(const tf_attn_problem *p, const tf_attn_operand *q);

/* The backward takes the AMX path when the forward does and dout is bf16. */
int tf_attn_amx_bwd_applies(const tf_attn_problem *p, const tf_attn_operand *q,
                            const tf_attn_operand *dout);

/* Floats of scratch the AMX forward and backward need per unit. */
int64_t tf_attn_amx_fwd_scratch_floats(const tf_attn_problem *p);
int64_t tf_attn_amx_bwd_scratch_floats(const tf_attn_problem *p);

/* The forward of one unit (sequence, query head, query tile): out rows and lse, as fwd_block. */
void tf_attn_amx_fwd_unit(const tf_attn_problem *p, const tf_attn_operand *q,
                          const tf_attn_operand *k, const tf_attn_operand *v,
                          const tf_attn_operand *out, float *lse, int64_t unit, int64_t tiles,
                          float *scratch);

/*
 * The backward's key_tile_grads (attention_bwd.c) for keys [k0, k0 + nk) of kv
 * head hk: stores their dK and dV rows, and with acc adds dS k into acc's rows
 * (dQ before softmax_scale).
 */
void tf_attn_amx_key_tile_grads(const tf_attn_problem *p, const tf_attn_operand *dout,
                                const tf_attn_operand *q, const tf_attn_operand *k,
                                const tf_attn_operand *v, const float *lse, const float *delta,
                                const tf_attn_operand *acc, const tf_attn_operand *dk,
                                const tf_attn_operand *dv, int64_t seg, int64_t hk, int64_t k0,
                                int64_t nk, float *scratch);

/* dQ rows [r0, r0 + rows) of query head h against keys [0, kv_end), stored (the split backward's second pass). */
void tf_attn_amx_dq_rows(const tf_attn_problem *p, const tf_attn_operand *dout,
                         const tf_attn_operand *q, const tf_attn_operand *k,
                         const tf_attn_operand *v, const float *lse, const float *delta,
                         const tf_attn_operand *dq, int64_t seg, int64_t h, int64_t r0,
                         int64_t rows, int64_t kv_end, float *scratch);

#if defined(TF_ATTN_AMX_EMULATE)
/* Test switch of the emulated build: nonzero makes tf_attn_amx_applies answer as on an AMX CPU. */
extern int tf_attn_amx_emulated;
#endif

#endif /* TF_ATTENTION_AMX_H */
