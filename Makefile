# The two set-up commands of the README: `make demo` (the main job) and `make test`.
# Each installs what it needs: the pinned CPU torch when no torch is present, then te_fuser.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
NVCC ?= nvcc
CUDA_ARCH_FLAGS = -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a
CUDA_CHECK_DIR ?= build/cuda-check
TORCH_INCLUDES = $(shell $(PYTHON) -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-isystem' + p for p in include_paths()))")

# tests/clients: accelerate's and Lightning's TE precision, and what they import beyond torch, numpy,
# packaging, fsspec and typing-extensions (there already); --no-deps keeps torch pinned.
CLIENT_PACKAGES = accelerate==1.15.0 safetensors==0.8.0 pyyaml==6.0.3 \
	lightning==2.6.0 lightning-utilities==0.15.3 torchmetrics==1.9.0
# tests/test_onnx_export.py: torch.onnx's exporter (onnxscript) and ONNX Runtime with its extensions.
ONNX_PACKAGES = onnx==1.23.2 onnxscript==0.7.2 onnx-ir==1.1.0 ml-dtypes==0.6.0 protobuf==7.36.2 \
	onnxruntime==1.32.0 onnxruntime-extensions==0.15.2 flatbuffers==25.12.19

.PHONY: install demo test c-check cuda-check bench

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==$(TORCH_VERSION)
	$(PYTHON) -m pip install -q pytest numpy tqdm matplotlib
	$(PYTHON) -m pip install -q --no-deps megatron-core==0.16.1  # tests/clients; --no-deps keeps torch pinned
	$(PYTHON) -m pip install -q --no-deps $(CLIENT_PACKAGES) $(ONNX_PACKAGES)
	$(PYTHON) -m pip install -q --no-build-isolation -e .

demo: install
	$(PYTHON) -m te_fuser.examples.train

test: install c-check
	$(PYTHON) -m pytest -q tests

# The C core on its own under AddressSanitizer and UndefinedBehaviorSanitizer, then the CUDA
# FP8, block-scaled quantizer, fused-op and attention kernel sources run on the CPU (one fiber
# per CUDA thread, the attention PTX replaced by a lane-exact model) and compared with the C core. The parts are
# independent builds and runs, so they go JOBS at a time; -Otarget prints each part's output
# whole, when it ends.
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
EMULATED_PARTS = c-check/emulated-attention c-check/emulated-fp8 c-check/emulated-ops c-check/emulated-block
C_CHECK_PARTS = c-check/attention-native c-check/attention-amx-model c-check/emulated-attention \
	c-check/fp8 c-check/emulated-fp8 c-check/emulated-block c-check/ops c-check/emulated-ops c-check/gemm \
	c-check/fp8-block c-check/nvfp4 c-check/cross-entropy c-check/rope c-check/moe-permute  # longest first
.PHONY: $(C_CHECK_PARTS)

c-check:
	@$(MAKE) --no-print-directory -j$(JOBS) -Otarget $(C_CHECK_PARTS)

c-check/fp8:
	sh tests/c/run.sh
c-check/fp8-block:
	sh tests/c/run_fp8_block.sh
c-check/cross-entropy:
	sh tests/c/run_cross_entropy.sh
c-check/nvfp4:
	sh tests/c/run_nvfp4.sh
c-check/ops:
	sh tests/c/run_ops.sh
c-check/rope:
	sh tests/c/run_rope.sh
c-check/moe-permute:
	sh tests/c/run_moe_permute.sh
c-check/attention-native:
	sh tests/c/run_attention.sh native
c-check/attention-amx-model:
	sh tests/c/run_attention.sh amx-model
c-check/gemm:
	sh tests/c/run_gemm.sh
$(EMULATED_PARTS): c-check/emulated-%:
	sh tests/c/cuda_emulation/run.sh $*

# Every CUDA source compiles for sm_80 and sm_90a, and the CUDA binding files
# compile against the stable ABI headers, although no GPU is here. One part per file, JOBS at a time.
NVCC_PARTS = $(addprefix nvcc/,$(sort $(shell find csrc/cuda -name '*.cu')))
SYNTAX_PARTS = $(addprefix syntax/,$(sort $(shell find csrc/binding -name '*_cuda.cpp')))
CUDA_CHECK_PARTS = $(NVCC_PARTS) $(SYNTAX_PARTS)
.PHONY: $(CUDA_CHECK_PARTS)

cuda-check:
	@mkdir -p $(CUDA_CHECK_DIR)
	@$(MAKE) --no-print-directory -j$(JOBS) -Otarget $(CUDA_CHECK_PARTS)

$(NVCC_PARTS): nvcc/%:
	$(NVCC) -std=c++17 -O3 -Werror=all-warnings $(CUDA_ARCH_FLAGS) -Icsrc -c $* \
	  -o $(CUDA_CHECK_DIR)/$(subst /,_,$*).o

$(SYNTAX_PARTS): syntax/%:
	c++ -std=c++20 -fsyntax-only -Wall -Wextra -Werror -Icsrc $(TORCH_INCLUDES) \
	  -DTORCH_TARGET_VERSION=0x020a000000000000 -DTE_FUSER_WITH_CUDA $*

bench: install
	$(PYTHON) benchmarks/bench_quantize.py
	$(PYTHON) benchmarks/bench_linear.py
	$(PYTHON) benchmarks/bench_attention.py
	$(PYTHON) benchmarks/memory_timeline.py
