/* MoE token permutation on the CPU; see moe_permute.h. */
#include "moe_permute.h"

#include <string.h>

static float load_f32(const void *p, tf_dtype dtype, int64_t i) {
  if (dtype == TF_FLOAT32) return ((const float *)p)[i];
  const uint16_t h = ((const uint16_t *)p)[i];
  return dtype == TF_BFLOAT16 ? tf_bf16_to_f32(h) : tf_f16_to_f32(h);
}

static void store_f32(void *p, tf_dtype dtype, int64_t i, float v) {
  if (dtype == TF_FLOAT32) {
    ((float *)p)[i] = v;
  } else {
    ((uint16_t *)p)[i] = dtype == TF_BFLOAT16 ? tf_f32_to_bf16(v) : tf_f32_to_f16(v);
  }
}

static int valid_dtype(tf_dtype d) { return d == TF_FLOAT32 || d == TF_BFLOAT16 || d == TF_FLOAT16; }

/* A rows x cols matrix whose last element is addressable in int64 bytes. */
static tf_status check_rows(const tf_moe_rows *m) {
  if (m->rows < 0 || m->cols < 0 || m->row_stride < 0 || m->elem_size <= 0) return TF_ERR_BAD_SIZE;
  if (m->rows > 0 && m->cols > 0 && m->row_stride < m->cols) return TF_ERR_BAD_SIZE;
  if (m->rows == 0 || m->cols == 0) return TF_OK;
  if (m->data == NULL) return TF_ERR_NULL_POINTER;
  int64_t last, bytes;
  if (__builtin_mul_overflow(m->rows - 1, m->row_stride, &last) || __builtin_add_overflow(last, m->cols, &last) ||
      __builtin_mul_overflow(last, m->elem_size, &bytes))
    return TF_ERR_OVERFLOW;
  return TF_OK;
}

static char *row_ptr(const tf_moe_rows *m, int64_t r) {
  return (char *)m->data + r * m->row_stride * m->elem_size;
}

static tf_status check_map(const tf_moe_map *map) {
  if (map->tokens < 0 || map->width < 0) return TF_ERR_BAD_SIZE;
  int64_t n;
  if (__builtin_mul_overflow(map->tokens, 2 * map->width + 1, &n)) return TF_ERR_OVERFLOW;
  if (map->kind != TF_MOE_MAP_MASK && map->kind != TF_MOE_MAP_INDEX) return TF_ERR_BAD_ARGUMENT;
  if (map->tokens > 0 && map->data == NULL) return TF_ERR_NULL_POINTER;
  return TF_OK;
}

static tf_status check_range(const tf_moe_map *map, int64_t token_begin, int64_t token_end) {
  return token_begin < 0 || token_end < token_begin || token_end > map->tokens ? TF_ERR_BAD_SIZE : TF_OK;
}

/* Slot count of token t (index maps count dropped slots too; their destination is -1). */
static int64_t slot_count(const tf_moe_map *m, int64_t t) {
  return m->kind == TF_MOE_MAP_MASK ? m->data[t * (2 * m->width + 1) + 2 * m->width] : m->width;
}

/* Destination and weight column of slot i of token t; 0 for a dropped slot, -1 for a bad entry. */
static int slot(const tf_moe_map *m, int64_t t, int64_t i, int64_t dst_rows, int64_t *dst, int64_t *col) {
  if (m->kind == TF_MOE_MAP_MASK) {
    const int32_t *row = m->data + t * (2 * m->width + 1);
    *dst = row[i];
    *col = row[m->width + i];
  } else {
    *dst = m->data[i * m->tokens + t];
    *col = i;
    if (*dst == -1) return 0;
  }
  return *dst >= 0 && *dst < dst_rows && *col >= 0 && *col < m->width ? 1 : -1;
}

static int bad_count(const tf_moe_map *m, int64_t n) { return n < 0 || n > m->width; }

tf_status tf_moe_mask_row_id_map(const uint8_t *routing_mask, int64_t tokens, int64_t experts,
                                 int64_t token_stride, int64_t expert_stride, int64_t num_out_tokens,
                                 int64_t *counts, int32_t *map, int64_t *kept) {
  if (tokens < 0 || experts < 0 || token_stride < 0 || expert_stride < 0 || num_out_tokens < 0)
    return TF_ERR_BAD_SIZE;
  if (kept == NULL) return TF_ERR_NULL_POINTER;
  *kept = 0;
  if (tokens == 0) return TF_OK;
  const int64_t width = 2 * experts + 1;
  int64_t last;
  if (experts > INT32_MAX || __builtin_mul_overflow(tokens, width, &last) ||
      __builtin_mul_overflow(tokens - 1, token_stride, &last) ||
      (experts > 0 && __builtin_mul_overflow(experts - 1, expert_stride, &last)))
    return TF_ERR_OVERFLOW;
  if (map == NULL || (experts > 0 && (routing_mask == NULL || counts == NULL))) return TF_ERR_NULL_POINTER;
  for (int64_t e = 0; e < experts; ++e) counts[e] = 0;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t e = 0; e < experts; ++e) counts[e] += routing_mask[t * token_stride + e * expert_stride] != 0;
  /* counts[e] becomes the next destination row of expert e. */
  int64_t total = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t c = counts[e];
    counts[e] = total;
    total += c;
  }
  if (total > (int64_t)INT32_MAX + 1) return TF_ERR_OVERFLOW;
  for (int64_t t = 0; t < tokens; ++t) {
    int32_t *row = map + t * width;
    int64_t n = 0;
    for (int64_t e = 0; e < experts; ++e) {
      if (!routing_mask[t * token_stride + e * expert_stride]) continue;
      const int64_t dst = counts[e]++;
      if (dst < num_out_tokens) {
        row[n] = (int32_t)dst;
        row[experts + n] = (int32_t)e;
        ++n;
      }
    }
    for (int64_t i = 0; i < n / 2; ++i) { /* ascending -> descending destination */
      int32_t d = row[i], x = row[experts + i];
      row[i] = row[n - 1 - i];
      row[experts + i] = row[experts + n - 1 - i];
      row[n - 1 - i] = d;
      row[experts + n - 1 - i] = x;
    }
    for (int64_t i = n; i < experts; ++i) row[i] = row[experts + i] = -1;
    row[2 * experts] = (int32_t)n;
  }
  *kept = total < num_out_tokens ? total : num_out_tokens;
  return TF_OK;
}

tf_status tf_moe_index_row_id_map(const int32_t *indices, int64_t tokens, int64_t topk, int64_t experts,
                                  int64_t num_out_tokens, int64_t *counts, int32_t *map) {
  if (tokens < 0 || topk < 0 || experts < 0 || num_out_tokens < 0) return TF_ERR_BAD_SIZE;
  int64_t n;
  if (__builtin_mul_overflow(tokens, topk, &n)) return TF_ERR_OVERFLOW;
  if (n == 0) return TF_OK;
  if (n > (int64_t)INT32_MAX + 1) return TF_ERR_OVERFLOW;
  if (indices == NULL || map == NULL || counts == NULL) return TF_ERR_NULL_POINTER;
  for (int64_t e = 0; e < experts; ++e) counts[e] = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (indices[i] < 0 || indices[i] >= experts) return TF_ERR_BAD_ARGUMENT;
    ++counts[indices[i]];
  }
  int64_t total = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t c = counts[e];
    counts[e] = total;
    total += c;
  }
  for (int64_t i = 0; i < n; ++i) { /* flattened choice i = t * topk + k, in order: a stable sort */
    const int64_t dst = counts[indices[i]]++;
    map[(i % topk) * tokens + i / topk] = dst < num_out_tokens ? (int32_t)dst : -1;
  }
  return TF_OK;
}

/* The prob's bits without the sign are zero: +0 or -0 in any of the floating formats. */
static int is_zero(const char *p, int64_t size) {
  uint8_t acc = 0;
  for (int64_t b = 0; b < size; ++b) acc |= (uint8_t)(b == size - 1 ? p[b] & 0x7F : p[b]);
  return acc == 0; /* little-endian: the sign is in the last byte */
}

tf_status tf_moe_permute(tf_moe_map map, tf_moe_rows in, const tf_moe_rows *probs, tf_moe_rows out,
                         void *out_probs, int64_t token_begin, int64_t token_end) {
  tf_status s;
  if ((s = check_map(&map)) != TF_OK || (s = check_rows(&in)) != TF_OK || (s = check_rows(&out)) != TF_OK ||
      (s = check_range(&map, token_begin, token_end)) != TF_OK)
    return s;
  if (in.rows != map.tokens || in.cols != out.cols || in.elem_size != out.elem_size) return TF_ERR_BAD_SIZE;
  if (probs != NULL) {
    if ((s = check_rows(probs)) != TF_OK) return s;
    if (probs->rows != map.tokens || probs->cols != map.width) return TF_ERR_BAD_SIZE;
    if (out_probs == NULL && out.rows > 0) return TF_ERR_NULL_POINTER;
  }
  const int64_t row_bytes = in.cols * in.elem_size;
  for (int64_t t = token_begin; t < token_end; ++t) {
    const int64_t n = slot_count(&map, t);
    if (bad_count(&map, n)) return TF_ERR_BAD_ARGUMENT;
    for (int64_t i = 0; i < n; ++i) {
      int64_t dst, col;
      const int ok = slot(&map, t, i, out.rows, &dst, &col);
      if (ok < 0) return TF_ERR_BAD_ARGUMENT;
      if (ok == 0) continue;
      int zero = 0;
      if (probs != NULL) {
        const char *p = row_ptr(probs, t) + col * probs->elem_size;
        memcpy((char *)out_probs + dst * probs->elem_size, p, (size_t)probs->elem_size);
        zero = is_zero(p, probs->elem_size);
      }
      if (row_bytes == 0) continue;
      if (zero)
        memset(row_ptr(&out, dst), 0, (size_t)row_bytes);
      else
        memcpy(row_ptr(&out, dst), row_ptr(&in, t), (size_t)row_bytes);
    }
  }
  return TF_OK;
}

static tf_status check_weights(const tf_moe_map *map, const tf_moe_rows *w, tf_dtype w_dtype) {
  tf_status s = check_rows(w);
  if (s != TF_OK) return s;
  if (!valid_dtype(w_dtype) || w->elem_size != tf_dtype_size(w_dtype)) return TF_ERR_BAD_DTYPE;
  return w->rows != map->tokens || w->cols != map->width ? TF_ERR_BAD_SIZE : TF_OK;
}

static tf_status check_typed(const tf_moe_rows *m, tf_dtype dtype) {
  tf_status s = check_rows(m);
  if (s != TF_OK) return s;
  return valid_dtype(dtype) && m->elem_size == tf_dtype_size(dtype) ? TF_OK : TF_ERR_BAD_DTYPE;
}

enum { TILE = 256 };

tf_status tf_moe_unpermute(tf_moe_map map, tf_moe_rows in, tf_dtype dtype, const tf_moe_rows *w,
                           tf_dtype w_dtype, tf_moe_rows out, int64_t token_begin, int64_t token_end) {
  tf_status s;
  if ((s = check_map(&map)) != TF_OK || (s = check_typed(&in, dtype)) != TF_OK ||
      (s = check_typed(&out, dtype)) != TF_OK || (s = check_range(&map, token_begin, token_end)) != TF_OK ||
      (w != NULL && (s = check_weights(&map, w, w_dtype)) != TF_OK))
    return s;
  if (out.rows != map.tokens || out.cols != in.cols) return TF_ERR_BAD_SIZE;
  float acc[TILE];
  for (int64_t t = token_begin; t < token_end; ++t) {
    const int64_t n = slot_count(&map, t);
    if (bad_count(&map, n)) return TF_ERR_BAD_ARGUMENT;
    for (int64_t h0 = 0; h0 < in.cols; h0 += TILE) {
      const int64_t len = in.cols - h0 < TILE ? in.cols - h0 : TILE;
      for (int64_t h = 0; h < len; ++h) acc[h] = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        int64_t src, col;
        const int ok = slot(&map, t, i, in.rows, &src, &col);
        if (ok < 0) return TF_ERR_BAD_ARGUMENT;
        if (ok == 0) continue;
        const float weight = w != NULL ? load_f32(row_ptr(w, t), w_dtype, col) : 1.0f;
        const void *x = row_ptr(&in, src);
        for (int64_t h = 0; h < len; ++h) acc[h] += load_f32(x, dtype, h0 + h) * weight;
      }
      void *y = row_ptr(&out, t);
      for (int64_t h = 0; h < len; ++h) store_f32(y, dtype, h0 + h, acc[h]);
    }
  }
  return TF_OK;
}

tf_status tf_moe_unpermute_backward(tf_moe_map map, tf_moe_rows grad, tf_moe_rows fwd_in, tf_dtype dtype,
                                    tf_moe_rows w, tf_dtype w_dtype, tf_moe_rows act_grad, tf_moe_rows w_grad,
                                    int64_t token_begin, int64_t token_end) {
  tf_status s;
  if ((s = check_map(&map)) != TF_OK || (s = check_typed(&grad, dtype)) != TF_OK ||
      (s = check_typed(&fwd_in, dtype)) != TF_OK || (s = check_typed(&act_grad, dtype)) != TF_OK ||
      (s = check_weights(&map, &w, w_dtype)) != TF_OK || (s = check_weights(&map, &w_grad, w_dtype)) != TF_OK ||
      (s = check_range(&map, token_begin, token_end)) != TF_OK)
    return s;
  if (grad.rows != map.tokens || fwd_in.cols != grad.cols || act_grad.cols != grad.cols ||
      act_grad.rows != fwd_in.rows)
    return TF_ERR_BAD_SIZE;
  for (int64_t t = token_begin; t < token_end; ++t) {
    const int64_t n = slot_count(&map, t);
    if (bad_count(&map, n)) return TF_ERR_BAD_ARGUMENT;
    void *wg = row_ptr(&w_grad, t);
    for (int64_t c = 0; c < map.width; ++c) store_f32(wg, w_dtype, c, 0.0f);
    const void *g = row_ptr(&grad, t);
    for (int64_t i = 0; i < n; ++i) {
      int64_t dst, col;
      const int ok = slot(&map, t, i, act_grad.rows, &dst, &col);
      if (ok < 0) return TF_ERR_BAD_ARGUMENT;
      if (ok == 0) continue;
      const float weight = load_f32(row_ptr(&w, t), w_dtype, col);
      const void *x = row_ptr(&fwd_in, dst);
      void *dx = row_ptr(&act_grad, dst);
      double dot = 0.0;
      for (int64_t h = 0; h < grad.cols; ++h) {
        const float gh = load_f32(g, dtype, h);
        store_f32(dx, dtype, h, gh * weight);
        dot += (double)load_f32(x, dtype, h) * gh;
      }
      store_f32(wg, w_dtype, col, (float)dot);
    }
  }
  return TF_OK;
}

tf_status tf_moe_unpermute_probs(tf_moe_map map, tf_moe_rows permuted, tf_moe_rows out, int64_t token_begin,
                                 int64_t token_end) {
  tf_status s;
  if ((s = check_map(&map)) != TF_OK || (s = check_rows(&permuted)) != TF_OK || (s = check_rows(&out)) != TF_OK ||
      (s = check_range(&map, token_begin, token_end)) != TF_OK)
    return s;
  if (permuted.cols != 1 || out.rows != map.tokens || out.cols != map.width || out.elem_size != permuted.elem_size)
    return TF_ERR_BAD_SIZE;
  for (int64_t t = token_begin; t < token_end; ++t) {
    const int64_t n = slot_count(&map, t);
    if (bad_count(&map, n)) return TF_ERR_BAD_ARGUMENT;
    char *y = row_ptr(&out, t);
    if (map.width > 0) memset(y, 0, (size_t)(map.width * out.elem_size));
    for (int64_t i = 0; i < n; ++i) {
      int64_t src, col;
      const int ok = slot(&map, t, i, permuted.rows, &src, &col);
      if (ok < 0) return TF_ERR_BAD_ARGUMENT;
      if (ok > 0) memcpy(y + col * out.elem_size, row_ptr(&permuted, src), (size_t)out.elem_size);
    }
  }
  return TF_OK;
}

tf_status tf_moe_chunk_sort_map(const int64_t *split_sizes, const int64_t *sorted_index, int64_t splits,
                                int64_t tokens, int64_t *scratch, int32_t *map) {
  if (splits < 0 || tokens < 0) return TF_ERR_BAD_SIZE;
  if (tokens > (int64_t)INT32_MAX + 1) return TF_ERR_OVERFLOW;
  if (splits == 0) return tokens == 0 ? TF_OK : TF_ERR_BAD_SIZE;
  if (split_sizes == NULL || sorted_index == NULL || scratch == NULL || (tokens > 0 && map == NULL))
    return TF_ERR_NULL_POINTER;
  /* scratch[c]: where chunk c starts in the output; -1 until the sorted order places it. */
  for (int64_t c = 0; c < splits; ++c) scratch[c] = -1;
  int64_t at = 0;
  for (int64_t j = 0; j < splits; ++j) {
    const int64_t c = sorted_index[j];
    if (c < 0 || c >= splits || scratch[c] != -1) return TF_ERR_BAD_ARGUMENT;
    if (split_sizes[c] < 0 || split_sizes[c] > tokens - at) return TF_ERR_BAD_SIZE;
    scratch[c] = at;
    at += split_sizes[c];
  }
  if (at != tokens) return TF_ERR_BAD_SIZE;
  int64_t t = 0;
  for (int64_t c = 0; c < splits; ++c)
    for (int64_t r = 0; r < split_sizes[c]; ++r, ++t) map[t] = (int32_t)(scratch[c] + r);
  return TF_OK;
}

tf_status tf_moe_sort_rows(const int32_t *map, int forward, tf_moe_rows in, tf_moe_rows out, int64_t token_begin,
                           int64_t token_end) {
  tf_status s;
  if ((s = check_rows(&in)) != TF_OK || (s = check_rows(&out)) != TF_OK) return s;
  if (in.rows != out.rows || in.cols != out.cols || in.elem_size != out.elem_size) return TF_ERR_BAD_SIZE;
  if (token_begin < 0 || token_end < token_begin || token_end > in.rows) return TF_ERR_BAD_SIZE;
  if (token_end > token_begin && map == NULL) return TF_ERR_NULL_POINTER;
  const size_t row_bytes = (size_t)(in.cols * in.elem_size);
  for (int64_t t = token_begin; t < token_end; ++t) {
    const int64_t m = map[t];
    if (m < 0 || m >= in.rows) return TF_ERR_BAD_ARGUMENT;
    if (row_bytes == 0) continue;
    if (forward)
      memcpy(row_ptr(&out, m), row_ptr(&in, t), row_bytes);
    else
      memcpy(row_ptr(&out, t), row_ptr(&in, m), row_bytes);
  }
  return TF_OK;
}
