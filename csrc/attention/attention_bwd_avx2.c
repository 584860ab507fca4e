/*
 * The AVX2 build of the attention backward's vector path: attention_bwd_body.h
 * with 8-float vectors, which x86-64-v3 keeps in ymm registers. Built where
 * TF_ATTN_VECTOR_CLONES (attention_tile.h) calls it, under the same condition.
 */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TF_ATTN_VW 8
#include "attention_bwd_body.h"

TF_ATTN_AVX2_BUILD(bwd_unit, TF_ATTN_BWD_UNIT_PARAMS, TF_ATTN_BWD_UNIT_ARGS)
TF_ATTN_AVX2_BUILD(dkdv_unit, TF_ATTN_DKDV_UNIT_PARAMS, TF_ATTN_DKDV_UNIT_ARGS)
TF_ATTN_AVX2_BUILD(dq_unit, TF_ATTN_DQ_UNIT_PARAMS, TF_ATTN_DQ_UNIT_ARGS)
#else
typedef int tf_attn_bwd_avx2_empty; /* ISO C wants a declaration in every file */
#endif
