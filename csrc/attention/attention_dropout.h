/*
 * Attention dropout mask: a counter-based RNG (Philox-4x32 with 10 rounds)
 * evaluated per attention-probability element, so any kernel -- CPU tile
 * loops or a CUDA thread -- gets the same keep/drop decision for the same
 * (seed, offset, batch, head, row, col) without sharing any state.
 *
 * Coordinates: batch is the batch index (the sequence index for packed thd
 * layouts), head the query head, row and col the query and key positions
 * inside their sequence.
 *
 * Usage: derive the key of one call once with tf_attn_dropout_key(seed,
 * offset), then keep element (b, h, i, j) iff
 *   tf_attn_dropout_bits(key, b, h, i, j) >= tf_attn_dropout_threshold(p),
 * and scale kept elements by 1 / (1 - p).
 */
#ifndef TF_ATTENTION_DROPOUT_H
#define TF_ATTENTION_DROPOUT_H

#include "../common/tf_dtype.h"

typedef struct tf_attn_dropout_key_t {
  uint32_t k0, k1;
} tf_attn_dropout_key_t;

/* The 32x32 -> 64-bit product, split in halves. */
TF_HD void tf_attn_philox_mul(uint32_t a, uint32_t b, uint32_t *hi, uint32_t *lo) {
  const uint64_t p = (uint64_t)a * (uint64_t)b;
  *hi = (uint32_t)(p >> 32);
  *lo = (uint32_t)p;
}

/* Replaces the counter c by its Philox-4x32-10 output under the key (k0, k1). */
TF_HD void tf_attn_philox(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    tf_attn_philox_mul(0xD2511F53u, c[0], &hi0, &lo0);
    tf_attn_philox_mul(0xCD9E8D57u, c[2], &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c[1] ^ k0;
    const uint32_t n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

/* Per-call key: Philox of the 64-bit offset under the 64-bit seed, so calls with different offsets get unrelated streams. */
TF_HD tf_attn_dropout_key_t tf_attn_dropout_key(uint64_t seed, uint64_t offset) {
  uint32_t c[4] = {(uint32_t)offset, (uint32_t)(offset >> 32), 0x5EEDu, 0xA77Eu};
  tf_attn_philox(c, (uint32_t)seed, (uint32_t)(seed >> 32));
  tf_attn_dropout_key_t key = {c[0], c[1]};
  return key;
}

/* 32 random bits for the probability element (batch, head, row, col). */
TF_HD uint32_t tf_attn_dropout_bits(tf_attn_dropout_key_t key, uint32_t batch, uint32_t head,
                                    uint32_t row, uint32_t col) {
  uint32_t c[4] = {col, row, head, batch};
  tf_attn_philox(c, key.k0, key.k1);
  return c[0];
}

/* Elements whose bits are below this are dropped: round(p * 2^32), p in [0, 1). */
TF_HD uint32_t tf_attn_dropout_threshold(float p) {
  const double t = (double)p * 4294967296.0 + 0.5;
  return t <= 0.0 ? 0u : t >= 4294967295.0 ? 4294967295u : (uint32_t)t;
}

#endif /* TF_ATTENTION_DROPOUT_H */
