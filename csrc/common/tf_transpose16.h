/*
 * A 16 x 16 matrix of 32-bit words held in 16 AVX-512 registers, transposed in place: the FP8 GEMM
 * packs b's pairs with it (gemm/gemm_pack_bf16.c), and the bf16 attention turns its tiles with it
 * (attention/attention_bf16_tile.h).
 */
#ifndef TF_TRANSPOSE16_H
#define TF_TRANSPOSE16_H

#include "cpu_features.h"

#if TF_X86
#include <immintrin.h>

TF_TARGET_AVX512 static inline void tf_transpose16_epi32(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  /* u[4 g + j], 128-bit lane l: column 4 l + j of rows 4 g .. 4 g + 3 */
  for (int g = 0; g < 4; ++g) {
    const __m512i *s = t + 4 * g;
    u[4 * g + 0] = _mm512_unpacklo_epi64(s[0], s[2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(s[0], s[2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(s[1], s[3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(s[1], s[3]);
  }
  /* then whole lanes: column 4 l + j gathers lane l of u[j], u[4 + j], u[8 + j] and u[12 + j] */
  for (int j = 0; j < 4; ++j) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}
#endif

#endif /* TF_TRANSPOSE16_H */
