/*
 * The AVX2 build of the attention forward's vector path: attention_fwd_body.h
 * with 8-float vectors, which x86-64-v3 keeps in ymm registers. Built where
 * TF_ATTN_VECTOR_CLONES (attention_tile.h) calls it, under the same condition.
 */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TF_ATTN_VW 8
#include "attention_fwd_body.h"

TF_ATTN_AVX2_BUILD(fwd_block, TF_ATTN_FWD_BLOCK_PARAMS, TF_ATTN_FWD_BLOCK_ARGS)
#else
typedef int tf_attn_fwd_avx2_empty; /* ISO C wants a declaration in every file */
#endif
