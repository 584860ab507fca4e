/* Block-scaled GEMM driver (block_scaled_gemm.h): per output tile, each K block is packed and
 * summed by the FP8 GEMM's kernel of the tier into a zeroed partial tile, then scaled into the
 * tile's float32 total; the FP8 GEMM's epilogue adds the bias (after NVFP4's alpha) and rounds. The fused
 * paths (AVX512-BF16's bf16 pairs; float32 on the AVX2 and AVX-512 tiers) sum each block in registers and
 * scale it straight into the total. On them, scales are multiplied into the packed values where that gives
 * the same bits:
 * powers of two (MXFP8's, and Float8 block scaling's with power_2_scale) within a range (foldable), and
 * NVFP4's E4M3 scales (e4m3_valued). That saves the kernel two multiplies per vector and block: MXFP8's
 * 1024^2 Linear step went from 1.13-1.29x to 1.12-1.13x the FP8 Linear's (Zen 4, 2 threads,
 * benchmarks/bench_block_linear.py, 2026-11-29). */
#include "block_scaled_gemm.h"

#include <stdlib.h>
#include <string.h>

#include "../common/tf_checks.h"
#include "gemm_kernels.h"

#if TF_X86
#include <immintrin.h>
#endif

int64_t tf_block_scaled_gemm_blocks(int64_t k, int64_t block) {
  if (k < 0 || block < 1) return -1;
  return k / block + (k % block != 0);
}

/* 1 when every scale index (rows - 1) * row stride + (blocks - 1) * block stride fits in int64. */
static int scale_indices_fit(const tf_block_operand *x, int64_t rows, int64_t blocks) {
  if (rows == 0 || blocks == 0) return 1;
  if (!tf_mul_fits(rows - 1, x->scale_row_stride) || !tf_mul_fits(blocks - 1, x->scale_block_stride))
    return 0;
  return (rows - 1) * x->scale_row_stride <= INT64_MAX - (blocks - 1) * x->scale_block_stride;
}

tf_status tf_block_scaled_gemm_check(int64_t m, int64_t n, int64_t k, int64_t block,
                                     const tf_block_operand *a, const tf_block_operand *b,
                                     int has_bias, tf_dtype bias_dtype, tf_dtype out_dtype, tf_isa isa) {
  if (!a || !b) return TF_ERR_NULL_POINTER;
  const tf_status s = tf_fp8_gemm_check(m, n, k, a->format, b->format, has_bias, bias_dtype, out_dtype, isa);
  if (s != TF_OK) return s;
  if (block < 1 || block > TF_GEMM_KC) return TF_ERR_BAD_ARGUMENT;
  if (a->scale_row_stride < 0 || a->scale_block_stride < 0 || b->scale_row_stride < 0 ||
      b->scale_block_stride < 0)
    return TF_ERR_BAD_SIZE;
  const int64_t blocks = tf_block_scaled_gemm_blocks(k, block);
  if (!scale_indices_fit(a, m, blocks) || !scale_indices_fit(b, n, blocks)) return TF_ERR_OVERFLOW;
  return TF_OK;
}

/* ---- combining a block's partial tile into the total ------------------------------------ */

/* total[i, j] += partial[i, j] * (sa[i] * sb[j]) for i < rows, j < cols: three float32 roundings,
 * one statement each so that no compiler fuses them. */
static void combine_portable(float *total, const float *partial, int64_t rows, int64_t cols,
                             const float *sa, int64_t sa_stride, const float *sb) {
  for (int64_t i = 0; i < rows; ++i) {
    const float s = sa[i * sa_stride];
    for (int64_t j = 0; j < cols; ++j) {
      const float scale = s * sb[j];
      const float scaled = partial[i * TF_GEMM_NB + j] * scale;
      total[i * TF_GEMM_NB + j] += scaled;
    }
  }
}

#if TF_X86
/* The same in 8-float vectors; a masked load and store only for a last partial vector (a masked
 * store is slow on some CPUs). */
TF_TARGET_AVX2 static void combine_avx2(float *total, const float *partial, int64_t rows, int64_t cols,
                                        const float *sa, int64_t sa_stride, const float *sb) {
  const int64_t whole = cols / 8 * 8;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(cols - whole)), lane);
  for (int64_t i = 0; i < rows; ++i) {
    const __m256 s = _mm256_set1_ps(sa[i * sa_stride]);
    float *t = total + i * TF_GEMM_NB;
    const float *p = partial + i * TF_GEMM_NB;
    for (int64_t j = 0; j < whole; j += 8) {
      const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(p + j), _mm256_mul_ps(s, _mm256_loadu_ps(sb + j)));
      _mm256_storeu_ps(t + j, _mm256_add_ps(_mm256_loadu_ps(t + j), scaled));
    }
    if (whole < cols) {
      const __m256 scale = _mm256_mul_ps(s, _mm256_maskload_ps(sb + whole, mask));
      const __m256 scaled = _mm256_mul_ps(_mm256_maskload_ps(p + whole, mask), scale);
      _mm256_maskstore_ps(t + whole, mask, _mm256_add_ps(_mm256_maskload_ps(t + whole, mask), scaled));
    }
  }
}

/* The bf16 bits of every FP8 code of a format (exact: FP8 values are bf16 values). */
static void bf16_codes(tf_fp8_format f, uint16_t codes[256]) {
  for (int c = 0; c < 256; ++c) {
    const float v = f == TF_FP8_E4M3 ? tf_fp8_e4m3_decode((uint8_t)c) : tf_fp8_e5m2_decode((uint8_t)c);
    codes[c] = (uint16_t)(tf_f32_bits(v) >> 16);
  }
}
#endif

/* ---- folding scales into the operands ------------------------------------------------------- */

/* Exponents of the FP8 values a format's nonzero finite codes hold: 2^lo <= |v| < 2^hi. */
static void value_exponents(tf_fp8_format f, int *lo, int *hi) {
  *lo = f == TF_FP8_E4M3 ? -9 : -16;
  *hi = f == TF_FP8_E4M3 ? 9 : 16;
}

/* Widens [*lo, *hi] to the exponents of x's scales for `rows` rows; 0 if one is not a positive normal
 * power of two. */
static int scale_exponents(const tf_block_operand *x, int64_t rows, int64_t blocks, int *lo, int *hi) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t kb = 0; kb < blocks; ++kb) {
      const uint32_t bits = tf_f32_bits(x->scales[r * x->scale_row_stride + kb * x->scale_block_stride]);
      const int field = (int)(bits >> 23);
      if ((bits & 0x807FFFFFu) != 0 || field == 0 || field == 255) return 0;
      if (field - 127 < *lo) *lo = field - 127;
      if (field - 127 > *hi) *hi = field - 127;
    }
  return 1;
}

/* 1 when multiplying every value by its scale and summing the scaled products gives each block's sum
 * as P * (sa * sb) exactly: every scale a power of two, and every scaled value, product and partial sum
 * (multiples of the least product, below block times the greatest) a normal float32 (and bf16). Scaling
 * all the terms of a sum by 2^e then scales each of its roundings by 2^e, so P' = P * 2^e, and
 * float32(P * float32(sa * sb)) is that exact product. */
static int foldable(const tf_block_operand *a, const tf_block_operand *b, int64_t m, int64_t n, int64_t block,
                    int64_t blocks) {
  int a_lo = 127, a_hi = -127, b_lo = 127, b_hi = -127, va_lo, va_hi, vb_lo, vb_hi, block_bits = 0;
  if (!scale_exponents(a, m, blocks, &a_lo, &a_hi) || !scale_exponents(b, n, blocks, &b_lo, &b_hi)) return 0;
  value_exponents(a->format, &va_lo, &va_hi);
  value_exponents(b->format, &vb_lo, &vb_hi);
  while (((int64_t)1 << block_bits) < block) ++block_bits;
  return a_lo + va_lo >= -126 && b_lo + vb_lo >= -126 && a_lo + va_lo + b_lo + vb_lo >= -126 &&
         a_hi + va_hi <= 127 && b_hi + vb_hi <= 127 && a_hi + va_hi + b_hi + vb_hi + block_bits <= 127;
}

/* NVFP4's operands (tf_nvfp4_gemm_nt): E2M1 values (at most 2 significant bits, 1/2 to 6) under E4M3 block
 * scales. Foldable when every scale is 0 or has at most 4 significant bits and a magnitude in [2^-9, 2^9), as
 * E4M3 values do: each scaled value (6 bits) is a normal bf16, each product exact, and a block's products
 * are sa * sb (8 bits) times multiples of 1/4 summing to at most 16 * 36, so every partial sum (20 bits) is
 * exact in any order: P' = P * (sa * sb), which is itself exact. */
static int e4m3_valued(const tf_block_operand *x, int64_t rows, int64_t blocks) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t kb = 0; kb < blocks; ++kb) {
      const uint32_t bits = tf_f32_bits(x->scales[r * x->scale_row_stride + kb * x->scale_block_stride]) & 0x7FFFFFFFu;
      const uint32_t field = bits >> 23;
      if (bits != 0 && ((bits & 0x000FFFFFu) != 0 || field < 127 - 9 || field >= 127 + 9)) return 0;
    }
  return 1;
}

/* scale[i] = x's scale of row row0 + i in block kb for i < valid, 1 for the padding up to count. */
static void fold_scales(const tf_block_operand *x, int64_t row0, int64_t valid, int64_t count, int64_t kb,
                        float *scale) {
  for (int64_t i = 0; i < count; ++i)
    scale[i] = i < valid ? x->scales[(row0 + i) * x->scale_row_stride + kb * x->scale_block_stride] : 1.0f;
}

/* ---- driver ----------------------------------------------------------------------------- */

typedef struct {
  const tf_block_operand *a, *b;
  int64_t m, n, k, block, blocks;
  tf_isa isa;
} job;

/* Scratch of one call (see fp8_gemm.c's, whose caching of packed operands this mirrors). */
typedef struct {
  float *total, *partial; /* MB x NB each */
  float *sb;              /* NB: b's scales of the tile's columns for one block */
  void *a_pack, *b_pack;  /* one block of a (MB x KC floats) and of b (NB x KC floats) */
  size_t elem;            /* bytes of a packed element: float32 or bf16 */
  int64_t kstride;        /* packed elements of a row per block: block, or kc_pad on bf16 paths */
  uint16_t codes_a[256], codes_b[256];
  void *a_row;            /* a's packed blocks of one row of tiles ([blocks][MB][kstride]), or NULL */
  int64_t a_row0;         /* the row of tiles a_row holds, -1 for none */
  uint16_t *b_all;        /* bf16 paths: b's packed blocks, [b_slots][blocks][NB][kstride], or NULL */
  int64_t b_slots;        /* n / NB (every column of tiles) or, on the fused path only, 1 */
  uint8_t *b_packed;      /* b_slots == n / NB: per column of tiles, whether b_all holds it yet */
  int64_t b_col;          /* b_slots == 1: the column of tiles b_all holds, -1 for none */
  float *sb_all;          /* fused path: b's scales of the tile's columns, [blocks][NB] */
  int fused;              /* the tiles go through tf_block_gemm_tile_bf16_avx512 */
  int folded;             /* fused path: the packed values carry their scales (foldable) */
} scratch;

#define PACKED_MAX_BYTES ((int64_t)16 << 20)

/* The rows (or columns) of a block that the kernels read for `valid` real ones (as in fp8_gemm.c). */
static int64_t covered(int64_t valid, int64_t block, int64_t limit) {
  const int64_t c = tf_gemm_blocks(valid, block) * block;
  return c < limit ? c : limit;
}

/* partial (zeroed) += the block [k0, k0 + kc) of the tile's product, by the tier's kernel. */
static void block_product(const job *jb, int64_t kb, int64_t row0, int64_t col0, int64_t rows,
                          int64_t cols, int pack_a, scratch *w) {
  const tf_block_operand *a = jb->a, *b = jb->b;
  const int64_t k0 = kb * jb->block, kc = jb->k - k0 < jb->block ? jb->k - k0 : jb->block;
  const int64_t a_rows = covered(rows, 96, TF_GEMM_MB);
  const int64_t b_cols = covered(cols, 32, TF_GEMM_NB);
  void *a_block = w->a_row ? (char *)w->a_row + kb * TF_GEMM_MB * w->kstride * (int64_t)w->elem : w->a_pack;
#if TF_X86
  if (jb->isa >= TF_ISA_AVX512_BF16) {
    const int64_t kc_pad = (kc + 31) / 32 * 32;
    if (pack_a) tf_gemm_pack_a_bf16(a->codes, jb->k, row0, rows, a_rows, k0, kc, kc_pad, w->codes_a, a_block);
    const int64_t col_tile = col0 / TF_GEMM_NB;
    uint16_t *b_block =
        w->b_all ? w->b_all + (col_tile * jb->blocks + kb) * TF_GEMM_NB * w->kstride : w->b_pack;
    if (!w->b_all || !w->b_packed[col_tile])
      tf_gemm_pack_b_bf16(b->codes, jb->k, col0, cols, b_cols, k0, kc, kc_pad, w->codes_b, b_block);
    if (jb->isa == TF_ISA_AMX)
      tf_gemm_block_bf16_amx(kc_pad, a_block, b_block, w->partial, rows, cols);
    else
      tf_gemm_block_bf16_avx512(kc_pad, a_block, b_block, w->partial, rows, cols);
    return;
  }
  if (jb->isa >= TF_ISA_AVX2) {
    if (pack_a) tf_gemm_pack_a_f32_avx2(a->codes, jb->k, row0, rows, a_rows, k0, kc, a->format, a_block);
    tf_gemm_pack_b_f32_avx2(b->codes, jb->k, col0, cols, b_cols, k0, kc, b->format, w->b_pack);
    tf_gemm_block_f32_avx2(kc, a_block, w->b_pack, w->partial, rows, cols);
    return;
  }
#endif
  if (pack_a) tf_gemm_pack_a_f32_portable(a->codes, jb->k, row0, rows, a_rows, k0, kc, a->format, a_block);
  tf_gemm_pack_b_f32_portable(b->codes, jb->k, col0, cols, b_cols, k0, kc, b->format, w->b_pack);
  tf_gemm_block_f32_portable(kc, a_block, w->b_pack, w->partial, rows, cols);
}

/* w->total's first rows x cols = the tile's block-scaled sum. */
static void compute_tile(const job *jb, int64_t row0, int64_t col0, int64_t rows, int64_t cols, scratch *w) {
  const tf_block_operand *a = jb->a, *b = jb->b;
  const int64_t a_rows = covered(rows, 96, TF_GEMM_MB);
  const int pack_a = !w->a_row || w->a_row0 != row0;
  memset(w->total, 0, sizeof(float) * (size_t)(rows * TF_GEMM_NB));
  for (int64_t kb = 0; kb < jb->blocks; ++kb) {
    memset(w->partial, 0, sizeof(float) * (size_t)(a_rows * TF_GEMM_NB)); /* every row a kernel touches */
    block_product(jb, kb, row0, col0, rows, cols, pack_a, w);
    for (int64_t j = 0; j < cols; ++j)
      w->sb[j] = b->scales[(col0 + j) * b->scale_row_stride + kb * b->scale_block_stride];
    const float *sa = a->scales + row0 * a->scale_row_stride + kb * a->scale_block_stride;
#if TF_X86
    if (jb->isa >= TF_ISA_AVX2) {
      combine_avx2(w->total, w->partial, rows, cols, sa, a->scale_row_stride, w->sb);
      continue;
    }
#endif
    combine_portable(w->total, w->partial, rows, cols, sa, a->scale_row_stride, w->sb);
  }
  if (w->b_all && jb->blocks > 0) w->b_packed[col0 / TF_GEMM_NB] = 1;
  w->a_row0 = row0;
}

#if TF_X86
/* Packs rows [r0, r0 + valid) of operand x (a, or b when is_b; `covered` rows in all, the rest zeros) for K
 * block [k0, k0 + kc) in the fused path's layout: bf16 pairs (kc_pad) or float32 (kc); folded, times their
 * scales. */
static void pack_fused(const job *jb, const scratch *w, int is_b, int64_t r0, int64_t valid, int64_t covered_rows,
                       int64_t kb, int64_t k0, int64_t kc, void *dst, float *scale) {
  const tf_block_operand *x = is_b ? jb->b : jb->a;
  const int64_t kc_pad = tf_block_kc_pad(kc);
  if (w->elem == sizeof(float))
    (is_b ? tf_gemm_pack_b_f32_avx2 : tf_gemm_pack_a_f32_avx2)(x->codes, jb->k, r0, valid, covered_rows, k0, kc,
                                                               x->format, dst);
  else
    (is_b ? tf_gemm_pack_b_bf16 : tf_gemm_pack_a_bf16)(x->codes, jb->k, r0, valid, covered_rows, k0, kc, kc_pad,
                                                       is_b ? w->codes_b : w->codes_a, dst);
  if (!w->folded) return;
  fold_scales(x, r0, valid, covered_rows, kb, scale);
  if (w->elem == sizeof(float))
    (is_b ? tf_gemm_fold_b_f32 : tf_gemm_fold_a_f32)(dst, covered_rows, kc, scale);
  else
    (is_b ? tf_gemm_fold_b_bf16 : tf_gemm_fold_a_bf16)(dst, covered_rows, kc_pad, scale);
}

/* The fused paths (AVX512-BF16 pairs, or float32 on the AVX2 and AVX-512 tiers): packs the tile's blocks
 * of a (once per row of tiles) and of b (once per column of tiles), gathers b's scales, and sums the tile
 * with the tier's fused kernel. */
static void compute_tile_fused(const job *jb, int64_t row0, int64_t col0, int64_t rows, int64_t cols, scratch *w) {
  const tf_block_operand *a = jb->a, *b = jb->b;
  const int64_t a_rows = covered(rows, 96, TF_GEMM_MB), b_cols = covered(cols, 32, TF_GEMM_NB);
  const int64_t col_tile = col0 / TF_GEMM_NB, slot = w->b_slots == 1 ? 0 : col_tile;
  const int64_t a_elems = TF_GEMM_MB * w->kstride, b_elems = TF_GEMM_NB * w->kstride;
  char *a_blocks = w->a_row, *b_blocks = (char *)w->b_all + slot * jb->blocks * b_elems * (int64_t)w->elem;
  const int pack_a = w->a_row0 != row0;
  const int pack_b = w->b_slots == 1 ? w->b_col != col_tile : !w->b_packed[col_tile];
  float scale[TF_GEMM_MB > TF_GEMM_NB ? TF_GEMM_MB : TF_GEMM_NB];
  for (int64_t kb = 0; kb < jb->blocks; ++kb) {
    const int64_t k0 = kb * jb->block, kc = jb->k - k0 < jb->block ? jb->k - k0 : jb->block;
    if (pack_a) pack_fused(jb, w, 0, row0, rows, a_rows, kb, k0, kc, a_blocks + kb * a_elems * (int64_t)w->elem, scale);
    if (pack_b) pack_fused(jb, w, 1, col0, cols, b_cols, kb, k0, kc, b_blocks + kb * b_elems * (int64_t)w->elem, scale);
    if (w->folded) continue;
    float *sb = w->sb_all + kb * TF_GEMM_NB;
    for (int64_t j = 0; j < TF_GEMM_NB; ++j)
      sb[j] = j < cols ? b->scales[(col0 + j) * b->scale_row_stride + kb * b->scale_block_stride] : 0.0f;
  }
  w->a_row0 = row0;
  if (w->b_slots == 1)
    w->b_col = col_tile;
  else
    w->b_packed[col_tile] = 1;
  const float *sa = a->scales + row0 * a->scale_row_stride;
  if (w->elem == sizeof(float)) {
    const tf_block_tile_f32 t = {jb->blocks, jb->block, jb->k, (const float *)a_blocks, a_elems,
                                 (const float *)b_blocks, b_elems, sa, a->scale_row_stride, a->scale_block_stride,
                                 w->sb_all, w->folded};
    tf_block_gemm_tile_f32_avx2(&t, w->total, rows, cols);
    return;
  }
  const tf_block_tile t = {jb->blocks, jb->block, jb->k, (const uint16_t *)a_blocks, a_elems,
                           (const uint16_t *)b_blocks, b_elems, sa, a->scale_row_stride, a->scale_block_stride,
                           w->sb_all, w->folded};
  tf_block_gemm_tile_bf16_avx512(&t, w->total, rows, cols);
}
#endif

static void free_scratch(scratch *w) {
  free(w->sb_all);
  free(w->total);
  free(w->partial);
  free(w->sb);
  free(w->a_pack);
  free(w->b_pack);
  free(w->a_row);
  free(w->b_all);
  free(w->b_packed);
}

/* tf_block_scaled_gemm_nt with the epilogue's factor alpha; nvfp4: the operands are NVFP4's (tf_nvfp4_gemm_nt). */
static tf_status gemm(const tf_block_operand *a, const tf_block_operand *b, int64_t m, int64_t n, int64_t k,
                      int64_t block, float alpha, int nvfp4, const void *bias, tf_dtype bias_dtype, void *out,
                      tf_dtype out_dtype, tf_isa isa, int64_t tile_begin, int64_t tile_end) {
  const tf_status s =
      tf_block_scaled_gemm_check(m, n, k, block, a, b, bias != 0, bias_dtype, out_dtype, isa);
  if (s != TF_OK) return s;
  const int64_t tiles = tf_fp8_gemm_tiles(m, n);
  if (!tf_range_ok(tile_begin, tile_end, tiles)) return TF_ERR_BAD_SIZE;
  if (tile_begin == tile_end) return TF_OK;
  if (!out || (k > 0 && (!a->codes || !b->codes || !a->scales || !b->scales))) return TF_ERR_NULL_POINTER;

  const job jb = {a, b, m, n, k, block, tf_block_scaled_gemm_blocks(k, block), isa};
  scratch w;
  memset(&w, 0, sizeof(w));
  w.total = malloc(sizeof(float) * TF_GEMM_MB * TF_GEMM_NB);
  w.partial = malloc(sizeof(float) * TF_GEMM_MB * TF_GEMM_NB);
  w.sb = malloc(sizeof(float) * TF_GEMM_NB);
  w.a_pack = malloc(sizeof(float) * TF_GEMM_MB * TF_GEMM_KC);
  w.b_pack = malloc(sizeof(float) * TF_GEMM_NB * TF_GEMM_KC);
  w.elem = sizeof(float);
  w.kstride = block;
  w.a_row0 = -1;
  const int64_t tiles_n = (n + TF_GEMM_NB - 1) / TF_GEMM_NB;
  const int several_rows = (tile_end - 1) / tiles_n > tile_begin / tiles_n;
  const int several_cols = tile_end - tile_begin > 1 && tiles_n > 1;
#if TF_X86
  /* every tile of the call on the fused kernel (AVX512-BF16's, or the float32 one on the AVX2 and AVX-512
   * tiers), if its buffers can be had (compared by division, so nothing overflows). At the avx2 tier the
   * float32 kernel took a 1024^2 Linear step's three block GEMMs from 43.4-44.8 to 37.9-38.9 ms (MXFP8) and
   * NVFP4's from 51.7-54.3 to 40.7-43.0 ms (Zen 4 capped at avx2, 2 threads, bench_block_linear.py,
   * 2026-11-29). */
  const int bf16_path = isa >= TF_ISA_AVX512_BF16;
  const int want_fused = (isa == TF_ISA_AVX512_BF16 || isa == TF_ISA_AVX2 || isa == TF_ISA_AVX512) && jb.blocks > 0;
  if (bf16_path) {
    w.elem = sizeof(uint16_t);
    w.kstride = want_fused ? tf_block_kc_pad(block) : (block + 31) / 32 * 32;
    bf16_codes(a->format, w.codes_a);
    bf16_codes(b->format, w.codes_b);
  }
  if (bf16_path || want_fused) {
    const int64_t block_bytes = TF_GEMM_NB * w.kstride * (int64_t)w.elem;
    if (jb.blocks > 0 && jb.blocks <= PACKED_MAX_BYTES / block_bytes) {
      if (several_rows && tiles_n <= PACKED_MAX_BYTES / (jb.blocks * block_bytes))
        w.b_slots = tiles_n;
      else if (want_fused)
        w.b_slots = 1;
    }
    if (w.b_slots > 0) {
      w.b_all = malloc((size_t)(w.b_slots * jb.blocks * block_bytes));
      w.b_packed = calloc((size_t)w.b_slots, 1);
      w.b_col = -1;
    }
    if (want_fused && jb.blocks <= PACKED_MAX_BYTES / (TF_GEMM_NB * (int64_t)sizeof(float)))
      w.sb_all = malloc(sizeof(float) * (size_t)(jb.blocks * TF_GEMM_NB));
  }
  if ((several_cols || want_fused) && jb.blocks <= PACKED_MAX_BYTES / (TF_GEMM_MB * w.kstride * (int64_t)w.elem))
    w.a_row = malloc((size_t)(jb.blocks * TF_GEMM_MB * w.kstride) * w.elem);
  w.fused = want_fused && w.a_row && w.b_all && w.b_packed && w.sb_all;
  w.folded = w.fused && (nvfp4 ? e4m3_valued(a, m, jb.blocks) && e4m3_valued(b, n, jb.blocks)
                               : foldable(a, b, m, n, block, jb.blocks));
  if (want_fused && !w.fused) {
    w.b_slots = 0;
    if (bf16_path || !several_cols) { /* the per-block bf16 path packs 32-multiples: buffers sized per tile */
      free(w.a_row);
      w.a_row = NULL;
    }
    if (bf16_path) w.kstride = (block + 31) / 32 * 32;
  }
  if (!w.fused && (!bf16_path || w.b_slots != tiles_n || !w.b_all || !w.b_packed)) { /* none per tile */
    free(w.b_all);
    free(w.b_packed);
    w.b_all = NULL;
    w.b_packed = NULL;
  }
#else
  (void)several_rows;
  if (several_cols && jb.blocks <= PACKED_MAX_BYTES / (TF_GEMM_MB * w.kstride * (int64_t)w.elem))
    w.a_row = malloc((size_t)(jb.blocks * TF_GEMM_MB * w.kstride) * w.elem);
#endif
  tf_status result = TF_OK;
  if (!w.total || !w.partial || !w.sb || !w.a_pack || !w.b_pack) {
    result = TF_ERR_BAD_ARGUMENT;
  } else {
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      const int64_t row0 = (t / tiles_n) * TF_GEMM_MB, col0 = (t % tiles_n) * TF_GEMM_NB;
      const int64_t rows = m - row0 < TF_GEMM_MB ? m - row0 : TF_GEMM_MB;
      const int64_t cols = n - col0 < TF_GEMM_NB ? n - col0 : TF_GEMM_NB;
#if TF_X86
      if (w.fused)
        compute_tile_fused(&jb, row0, col0, rows, cols, &w);
      else
#endif
        compute_tile(&jb, row0, col0, rows, cols, &w);
#if TF_X86
      if (isa >= TF_ISA_AVX512 && out_dtype != TF_FLOAT16) {
        tf_gemm_epilogue_avx512(w.total, rows, cols, alpha, bias, bias_dtype, out, out_dtype, n, row0, col0);
        continue;
      }
#endif
      tf_gemm_epilogue_portable(w.total, rows, cols, alpha, bias, bias_dtype, out, out_dtype, n, row0, col0);
    }
  }
  free_scratch(&w);
  return result;
}

tf_status tf_block_scaled_gemm_nt(const tf_block_operand *a, const tf_block_operand *b, int64_t m,
                                  int64_t n, int64_t k, int64_t block, const void *bias,
                                  tf_dtype bias_dtype, void *out, tf_dtype out_dtype, tf_isa isa,
                                  int64_t tile_begin, int64_t tile_end) {
  /* alpha 1: total * 1 is total, so the epilogue adds the bias and rounds */
  return gemm(a, b, m, n, k, block, 1.0f, 0, bias, bias_dtype, out, out_dtype, isa, tile_begin, tile_end);
}

tf_status tf_nvfp4_gemm_nt(const tf_block_operand *a, const tf_block_operand *b, int64_t m, int64_t n, int64_t k,
                           float alpha, const void *bias, tf_dtype bias_dtype, void *out, tf_dtype out_dtype,
                           tf_isa isa, int64_t tile_begin, int64_t tile_end) {
  if (a && b && (a->format != TF_FP8_E4M3 || b->format != TF_FP8_E4M3)) return TF_ERR_BAD_DTYPE;
  return gemm(a, b, m, n, k, TF_NVFP4_GEMM_BLOCK, alpha, 1, bias, bias_dtype, out, out_dtype, isa, tile_begin,
              tile_end);
}
