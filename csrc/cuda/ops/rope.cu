// Rotary position embedding, forward and backward, on CUDA. See rope_cuda.h and csrc/ops/rope.h.
#include "ops_cuda_common.cuh"

#include "rope_cuda.h"

namespace {

using tf_ops_cuda::kMaxBlocks;
using tf_ops_cuda::kThreads;
using tf_ops_cuda::load;
using tf_ops_cuda::store;

struct View {
  int64_t s, b, h, d;  // element strides, (s or t, b, h, d)
};

// The channel copied bit for bit.
__device__ __forceinline__ void copy(const void *x, int64_t xi, void *y, int64_t yi, tf_dtype dtype) {
  if (dtype == TF_FLOAT32) {
    static_cast<uint32_t *>(y)[yi] = static_cast<const uint32_t *>(x)[xi];
  } else {
    static_cast<uint16_t *>(y)[yi] = static_cast<const uint16_t *>(x)[xi];
  }
}

// thd: the last sequence starting at or before token t (as the C core).
__device__ int64_t thd_sequence_of(const tf_rope_problem &p, int64_t t) {
  int64_t lo = 0, hi = p.batch - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (static_cast<int64_t>(p.cu_seqlens[mid]) / p.cp_size <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// One item per (token, head, j): j < rot_dim / 2 rotates a channel pair, the others copy a channel.
__global__ void __launch_bounds__(kThreads)
    rope_kernel(tf_rope_problem p, tf_dtype dtype, const void *__restrict__ x, View xs, void *__restrict__ y, View ys,
                int backward, int64_t tokens) {
  const int64_t pairs = p.rot_dim / 2;
  const int64_t per_head = pairs + (p.dim - p.rot_dim);
  const int64_t n = tokens * p.heads * per_head;
  const int64_t step = p.interleaved ? 2 : 1, partner = p.interleaved ? 1 : pairs;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const int64_t j = i % per_head, h = (i / per_head) % p.heads, k = i / per_head / p.heads;
    int64_t seqid, s, len, row;
    if (p.format == TF_ROPE_THD) {
      seqid = thd_sequence_of(p, k);
      const int64_t begin = static_cast<int64_t>(p.cu_seqlens[seqid]) / p.cp_size;
      len = static_cast<int64_t>(p.cu_seqlens[seqid + 1]) / p.cp_size - begin;
      s = k - begin;
      row = k;
    } else {
      seqid = k / p.seq;
      s = k % p.seq;
      len = p.seq;
      row = s;
    }
    const int64_t b = p.format == TF_ROPE_THD ? 0 : seqid;
    const int64_t xo = row * xs.s + b * xs.b + h * xs.h, yo = row * ys.s + b * ys.b + h * ys.h;
    int64_t pos;
    bool placed = s >= 0 && s < len;
    if (p.cp_size > 1) {
      const int64_t half = len / 2;
      placed = placed && len % 2 == 0;
      pos = s < half ? s + p.cp_rank * half : (2 * p.cp_size - p.cp_rank - 1) * half + (s - half);
    } else {
      pos = s + (p.start_positions ? p.start_positions[seqid] : 0);
    }
    placed = placed && pos >= 0 && pos < p.freq_rows;
    if (j >= pairs) {
      const int64_t c = p.rot_dim + (j - pairs);
      if (placed) {
        copy(x, xo + c * xs.d, y, yo + c * ys.d, dtype);
      } else {
        store(y, dtype, yo + c * ys.d, NAN);
      }
      continue;
    }
    const int64_t a = j * step, bb = a + partner;
    if (!placed) {
      store(y, dtype, yo + a * ys.d, NAN);
      store(y, dtype, yo + bb * ys.d, NAN);
      continue;
    }
    const float *f = p.freqs + (pos * p.freq_batch + (p.freq_batch > 1 ? seqid : 0)) * p.rot_dim;
    const float fa = f[a], fb = f[bb];
    const float c_aa = cosf(fa), c_bb = cosf(fb);
    const float c_ab = backward ? sinf(fb) : -sinf(fa);
    const float c_ba = backward ? -sinf(fa) : sinf(fb);
    const float xa = load(x, dtype, xo + a * xs.d), xb = load(x, dtype, xo + bb * xs.d);
    store(y, dtype, yo + a * ys.d, __fadd_rn(__fmul_rn(xa, c_aa), __fmul_rn(xb, c_ab)));
    store(y, dtype, yo + bb * ys.d, __fadd_rn(__fmul_rn(xb, c_bb), __fmul_rn(xa, c_ba)));
  }
}

tf_status launch(const tf_rope_problem *p, int backward, tf_dtype dtype, const void *x, const int64_t xs[4], void *y,
                 const int64_t ys[4], void *stream) {
  tf_status s = tf_rope_check_shape(p);
  if (s == TF_OK) s = tf_rope_check_view(p, dtype, xs);
  if (s == TF_OK) s = tf_rope_check_view(p, dtype, ys);
  if (s != TF_OK) return s;
  const int64_t tokens = tf_rope_tokens(p);
  const int64_t per_head = p->rot_dim / 2 + (p->dim - p->rot_dim);
  if (tokens * p->heads * per_head == 0) return TF_OK;  // fits: at most tokens * heads * dim
  if (!x || !y) return TF_ERR_NULL_POINTER;
  const int64_t n = tokens * p->heads * per_head;
  const int64_t blocks = n / kThreads + (n % kThreads != 0);
  const unsigned int grid = static_cast<unsigned int>(blocks > kMaxBlocks ? kMaxBlocks : blocks);
  rope_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      *p, dtype, x, View{xs[0], xs[1], xs[2], xs[3]}, y, View{ys[0], ys[1], ys[2], ys[3]}, backward, tokens);
  return cudaGetLastError() == cudaSuccess ? TF_OK : TF_ERR_CUDA;
}

}  // namespace

extern "C" tf_status tf_rope_forward_cuda(const tf_rope_problem *p, tf_dtype dtype, const void *x,
                                          const int64_t x_strides[4], void *y, const int64_t y_strides[4],
                                          void *stream) {
  return launch(p, 0, dtype, x, x_strides, y, y_strides, stream);
}

extern "C" tf_status tf_rope_backward_cuda(const tf_rope_problem *p, tf_dtype dtype, const void *dy,
                                           const int64_t dy_strides[4], void *dx, const int64_t dx_strides[4],
                                           void *stream) {
  return launch(p, 1, dtype, dy, dy_strides, dx, dx_strides, stream);
}
