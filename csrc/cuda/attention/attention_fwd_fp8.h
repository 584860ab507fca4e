// Launcher of the FP8 tensor-core forward (attention_fwd_fp8.cu), called by
// the forward launcher (attention_fwd.cu) for float8_e4m3fn inputs.
#pragma once

#include <cuda_runtime.h>

#include "attention_fwd_tile.cuh"

namespace tf_attn {

// Enqueues the FP8 tensor-core forward and sets *launched = 1 when the kernel
// binary the current device runs has wgmma (sm_90a); otherwise enqueues
// nothing, sets *launched = 0 and returns TF_OK (the caller falls back to
// decoding the FP8 tiles to 16 bits).
tf_status launch_fwd_fp8(const FwdArgs& a, cudaStream_t stream, int* launched);

}  // namespace tf_attn
