// Launch functions of the backward helper kernels, shared between the
// backward launcher (attention_bwd.cu) and their own files.
#pragma once

#include <cuda_runtime.h>

#include "attention_cuda.h"

namespace tf_attn {

// delta[row] = sum_d dout[row, d] * out[row, d] (float32, lse layout) for
// every valid query row (dout and out in p.out_dtype); the backward kernel
// reads nothing else of delta.
tf_status launch_bwd_preprocess(const tf_attn_cuda_problem& p, const tf_attn_cuda_tensor& dout,
                                const tf_attn_cuda_tensor& out, float* delta,
                                cudaStream_t stream);

}  // namespace tf_attn
