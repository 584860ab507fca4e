/* FP8 GEMM driver: checks, tile loop, packing (FP8 -> bf16/float32) and the epilogue. */
#include "fp8_gemm.h"

#include <stdlib.h>
#include <string.h>

#include "../common/tf_checks.h"
#include "gemm_kernels.h"

int64_t tf_fp8_gemm_tiles(int64_t m, int64_t n) {
  if (m < 0 || n < 0) return -1;
  return ((m + TF_GEMM_MB - 1) / TF_GEMM_MB) * ((n + TF_GEMM_NB - 1) / TF_GEMM_NB);
}

static int is_float_dtype(tf_dtype d) {
  return d == TF_FLOAT32 || d == TF_BFLOAT16 || d == TF_FLOAT16;
}

tf_status tf_fp8_gemm_check(int64_t m, int64_t n, int64_t k, tf_fp8_format format_a,
                            tf_fp8_format format_b, int has_bias, tf_dtype bias_dtype,
                            tf_dtype out_dtype, tf_isa isa) {
  if (m < 0 || n < 0 || k < 0) return TF_ERR_BAD_SIZE;
  if (!tf_mul_fits(m, k) || !tf_mul_fits(n, k) || !tf_mul_fits(m, n)) return TF_ERR_OVERFLOW;
  if ((format_a != TF_FP8_E4M3 && format_a != TF_FP8_E5M2) ||
      (format_b != TF_FP8_E4M3 && format_b != TF_FP8_E5M2))
    return TF_ERR_BAD_DTYPE;
  if (!is_float_dtype(out_dtype) || (has_bias && !is_float_dtype(bias_dtype))) return TF_ERR_BAD_DTYPE;
  if ((int)isa < 0 || (int)isa > (int)tf_cpu_isa_detected()) return TF_ERR_BAD_ARGUMENT;
  return TF_OK;
}

/* ---- packing ---------------------------------------------------------------------------- */

/* The rows (or columns) of a block that the kernels read for `valid` real ones: whole register
 * blocks of every path (96 = lcm of 6 and 32 rows; 32 columns), at most `limit`. */
static int64_t covered(int64_t valid, int64_t block, int64_t limit) {
  const int64_t c = tf_gemm_blocks(valid, block) * block;
  return c < limit ? c : limit;
}

#if TF_X86
/* The bf16 bits of every FP8 code of a format: FP8 values are bf16 values, so the table is exact
 * (what decoding to float32 and keeping the high half gives) and packing is one lookup an element
 * (gemm_pack_bf16.c). */
static void bf16_codes(tf_fp8_format f, uint16_t codes[256]) {
  for (int c = 0; c < 256; ++c) {
    const float v = f == TF_FP8_E4M3 ? tf_fp8_e4m3_decode((uint8_t)c) : tf_fp8_e5m2_decode((uint8_t)c);
    codes[c] = (uint16_t)(tf_f32_bits(v) >> 16);
  }
}
#endif

/* ---- epilogue --------------------------------------------------------------------------- */

static float load_as_f32(const void *p, tf_dtype d, int64_t i) {
  if (d == TF_FLOAT32) return ((const float *)p)[i];
  const uint16_t h = ((const uint16_t *)p)[i];
  return d == TF_BFLOAT16 ? tf_bf16_to_f32(h) : tf_f16_to_f32(h);
}

void tf_gemm_epilogue_portable(const float *acc, int64_t rows, int64_t cols, float scale,
                               const void *bias, tf_dtype bias_dtype, void *out, tf_dtype out_dtype,
                               int64_t ldo, int64_t row0, int64_t col0) {
  for (int64_t i = 0; i < rows; ++i) {
    const float *src = acc + i * TF_GEMM_NB;
    const int64_t o = (row0 + i) * ldo + col0;
    for (int64_t j = 0; j < cols; ++j) {
      float v = src[j] * scale;
      if (bias) v += load_as_f32(bias, bias_dtype, col0 + j);
      if (out_dtype == TF_FLOAT32)
        ((float *)out)[o + j] = v;
      else if (out_dtype == TF_BFLOAT16)
        ((uint16_t *)out)[o + j] = tf_f32_to_bf16(v);
      else
        ((uint16_t *)out)[o + j] = tf_f32_to_f16(v);
    }
  }
}

/* ---- driver ----------------------------------------------------------------------------- */

/* Scratch of one call: the accumulator tile and the packed blocks. */
typedef struct {
  float *acc;     /* MB x NB */
  void *a_pack;   /* MB x KC floats (the larger of the two layouts) */
  void *b_pack;   /* NB x KC floats */
  size_t elem;    /* bytes of a packed element: float32 or bf16 */
  uint16_t codes_a[256], codes_b[256]; /* bf16 paths: the bf16 bits of a's and b's FP8 codes */
  /* a's packed blocks of one row of tiles, every k block ([k / KC][MB][KC] elements), so the tiles
   * of that row pack a once; NULL (pack per tile) when k makes them too large. */
  void *a_row;
  int64_t a_row0; /* the row of tiles a_row holds, -1 for none */
  /* bf16 paths: b's packed blocks of every column of tiles ([n / NB][k / KC][NB][KC] bf16), each
   * column packed by the first tile that needs it, so a call spanning several rows of tiles packs b
   * once; NULL (pack per tile) when the call has one row of tiles or b is too large. */
  uint16_t *b_all;
  uint8_t *b_packed; /* per column of tiles: whether b_all holds it yet */
} scratch;

/* The most bytes a_row, and b_all, may hold (16 MiB each): for a_row, k up to about 43000 in bf16
 * and 21000 in float32; for b_all, n * k up to 8 Mi. */
#define PACKED_MAX_BYTES ((int64_t)16 << 20)

static void compute_tile(const uint8_t *a, tf_fp8_format fa, const uint8_t *b, tf_fp8_format fb,
                         int64_t m, int64_t n, int64_t k, tf_isa isa, int64_t row0, int64_t col0,
                         scratch *w) {
  const int64_t rows = m - row0 < TF_GEMM_MB ? m - row0 : TF_GEMM_MB;
  const int64_t cols = n - col0 < TF_GEMM_NB ? n - col0 : TF_GEMM_NB;
  const int64_t a_rows = covered(rows, 96, TF_GEMM_MB), b_cols = covered(cols, 32, TF_GEMM_NB);
  const int pack_a = !w->a_row || w->a_row0 != row0;
  memset(w->acc, 0, sizeof(float) * TF_GEMM_MB * TF_GEMM_NB);
  for (int64_t k0 = 0; k0 < k; k0 += TF_GEMM_KC) {
    const int64_t kc = k - k0 < TF_GEMM_KC ? k - k0 : TF_GEMM_KC;
    void *a_block = w->a_row ? (char *)w->a_row + k0 / TF_GEMM_KC * TF_GEMM_MB * TF_GEMM_KC * w->elem : w->a_pack;
#if TF_X86
    if (isa >= TF_ISA_AVX512_BF16) {
      const int64_t kc_pad = (kc + 31) / 32 * 32; /* whole AMX tiles; TF_GEMM_KC is a multiple */
      if (pack_a) tf_gemm_pack_a_bf16(a, k, row0, rows, a_rows, k0, kc, kc_pad, w->codes_a, a_block);
      const int64_t col_tile = col0 / TF_GEMM_NB, k_blocks = (k + TF_GEMM_KC - 1) / TF_GEMM_KC;
      uint16_t *b_block =
          w->b_all ? w->b_all + (col_tile * k_blocks + k0 / TF_GEMM_KC) * TF_GEMM_NB * TF_GEMM_KC : w->b_pack;
      if (!w->b_all || !w->b_packed[col_tile])
        tf_gemm_pack_b_bf16(b, k, col0, cols, b_cols, k0, kc, kc_pad, w->codes_b, b_block);
      if (isa == TF_ISA_AMX)
        tf_gemm_block_bf16_amx(kc_pad, a_block, b_block, w->acc, rows, cols);
      else
        tf_gemm_block_bf16_avx512(kc_pad, a_block, b_block, w->acc, rows, cols);
      if (w->b_all && k0 + TF_GEMM_KC >= k) w->b_packed[col_tile] = 1; /* every k block is packed now */
      continue;
    }
    if (isa >= TF_ISA_AVX2) {
      if (pack_a) tf_gemm_pack_a_f32_avx2(a, k, row0, rows, a_rows, k0, kc, fa, a_block);
      tf_gemm_pack_b_f32_avx2(b, k, col0, cols, b_cols, k0, kc, fb, w->b_pack);
      tf_gemm_block_f32_avx2(kc, a_block, w->b_pack, w->acc, rows, cols);
      continue;
    }
#endif
    if (pack_a) tf_gemm_pack_a_f32_portable(a, k, row0, rows, a_rows, k0, kc, fa, a_block);
    tf_gemm_pack_b_f32_portable(b, k, col0, cols, b_cols, k0, kc, fb, w->b_pack);
    tf_gemm_block_f32_portable(kc, a_block, w->b_pack, w->acc, rows, cols);
  }
  w->a_row0 = row0;
}

tf_status tf_fp8_gemm_nt(const uint8_t *a, tf_fp8_format format_a, const uint8_t *b,
                         tf_fp8_format format_b, int64_t m, int64_t n, int64_t k,
                         float scale_inv_a, float scale_inv_b, const void *bias,
                         tf_dtype bias_dtype, void *out, tf_dtype out_dtype, tf_isa isa,
                         int64_t tile_begin, int64_t tile_end) {
  const tf_status s =
      tf_fp8_gemm_check(m, n, k, format_a, format_b, bias != 0, bias_dtype, out_dtype, isa);
  if (s != TF_OK) return s;
  const int64_t tiles = tf_fp8_gemm_tiles(m, n);
  if (!tf_range_ok(tile_begin, tile_end, tiles)) return TF_ERR_BAD_SIZE;
  if (tile_begin == tile_end) return TF_OK;
  if (!out || (k > 0 && (!a || !b))) return TF_ERR_NULL_POINTER;

  scratch w;
  w.acc = malloc(sizeof(float) * TF_GEMM_MB * TF_GEMM_NB);
  w.a_pack = malloc(sizeof(float) * TF_GEMM_MB * TF_GEMM_KC);
  w.b_pack = malloc(sizeof(float) * TF_GEMM_NB * TF_GEMM_KC);
  w.elem = sizeof(float);
  w.a_row = NULL;
  w.a_row0 = -1;
  w.b_all = NULL;
  w.b_packed = NULL;
  const int64_t tiles_n = (n + TF_GEMM_NB - 1) / TF_GEMM_NB, k_blocks = (k + TF_GEMM_KC - 1) / TF_GEMM_KC;
#if TF_X86
  if (isa >= TF_ISA_AVX512_BF16) {
    w.elem = sizeof(uint16_t);
    bf16_codes(format_a, w.codes_a);
    bf16_codes(format_b, w.codes_b);
    /* k_blocks <= PACKED_MAX_BYTES / (NB * KC * elem) before the product, so it cannot overflow */
    const int64_t block_bytes = TF_GEMM_NB * TF_GEMM_KC * (int64_t)w.elem;
    const int several_rows = (tile_end - 1) / tiles_n > tile_begin / tiles_n;
    if (several_rows && k_blocks > 0 && k_blocks <= PACKED_MAX_BYTES / block_bytes &&
        tiles_n <= PACKED_MAX_BYTES / (k_blocks * block_bytes)) {
      w.b_all = malloc((size_t)(tiles_n * k_blocks * block_bytes));
      w.b_packed = calloc((size_t)tiles_n, 1);
      if (!w.b_all || !w.b_packed) { /* packing per tile needs neither */
        free(w.b_all);
        free(w.b_packed);
        w.b_all = NULL;
        w.b_packed = NULL;
      }
    }
  }
#endif
  /* compared by division, so nothing overflows; a call packs a once per row of tiles only when a
   * row holds several of its tiles */
  const int several_cols = tile_end - tile_begin > 1 && tiles_n > 1;
  if (several_cols && k_blocks <= PACKED_MAX_BYTES / (TF_GEMM_MB * TF_GEMM_KC * (int64_t)w.elem))
    w.a_row = malloc((size_t)k_blocks * TF_GEMM_MB * TF_GEMM_KC * w.elem);
  tf_status result = TF_OK;
  if (!w.acc || !w.a_pack || !w.b_pack) {
    result = TF_ERR_BAD_ARGUMENT;
  } else {
    const float scale = scale_inv_a * scale_inv_b;
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      const int64_t row0 = (t / tiles_n) * TF_GEMM_MB, col0 = (t % tiles_n) * TF_GEMM_NB;
      compute_tile(a, format_a, b, format_b, m, n, k, isa, row0, col0, &w);
      const int64_t rows = m - row0 < TF_GEMM_MB ? m - row0 : TF_GEMM_MB;
      const int64_t cols = n - col0 < TF_GEMM_NB ? n - col0 : TF_GEMM_NB;
#if TF_X86
      if (isa >= TF_ISA_AVX512 && out_dtype != TF_FLOAT16) {
        tf_gemm_epilogue_avx512(w.acc, rows, cols, scale, bias, bias_dtype, out, out_dtype, n, row0, col0);
        continue;
      }
#endif
      tf_gemm_epilogue_portable(w.acc, rows, cols, scale, bias, bias_dtype, out, out_dtype, n, row0, col0);
    }
  }
  free(w.acc);
  free(w.a_pack);
  free(w.b_pack);
  free(w.a_row);
  free(w.b_all);
  free(w.b_packed);
  return result;
}
