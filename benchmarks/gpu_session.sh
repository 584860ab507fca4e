#!/usr/bin/env bash
# One run on a GPU machine: machine facts, then the stages named on the
# command line, each under its own time limit, each logged in full to $OUT/<stage>.log with its
# tail printed. te_fuser comes either prebuilt (te_fuser/_C.abi3.so carried in .devbuild/, built
# here with TE_FUSER_CUDA=1 against the CUDA build of torch; the stable ABI lets it load in the
# machine's torch) or, failing that, built there.
#
#   bash benchmarks/gpu_session.sh facts cuda_tests bench_attention bench_gpu  # GPU kernels
#   bash benchmarks/gpu_session.sh facts cpu_tests c_core bench_cpu  # the CPU tiers the host has
#   bash benchmarks/gpu_session.sh tests demo                        # the whole suite; the demo on the GPU
#   bash benchmarks/gpu_session.sh facts bench_layer                  # a Llama-3-8B layer's training step
#   bash benchmarks/gpu_session.sh facts cuda_graphs                  # make_graphed_callables: tests, graphed step
#   bash benchmarks/gpu_session.sh facts cpu_offload                  # get_cpu_offload_context: device memory drop
#   bash benchmarks/gpu_session.sh facts block_cuda bench_block_gpu   # block-scaled recipes: kernels, Linear speed
# Other stages: c_attention, bench_fp8_linear. bench_attention is te_fuser.DotProductAttention on each
# attention backend against SDPA's flash and cuDNN (benchmarks/bench_attention_cuda.py). The test stages
# need pytest-xdist and pytest-timeout.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
PY=python3
# Tests run several workers at once: two torch threads each, as on the 2-core development machine.
export OMP_NUM_THREADS=2

run_stage() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  local start=$SECONDS
  timeout "$limit" bash -c "$*" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "-- $name: rc=$rc, $((SECONDS - start)) s"
  tail -n "${TAIL:-30}" "$OUT/$name.log"
}

prepare() {
  if [ -f .devbuild/_C.abi3.so ]; then cp .devbuild/_C.abi3.so te_fuser/; fi
  if ! $PY -c "import te_fuser, sys; sys.exit(0 if te_fuser._extension.has_cuda_kernels() else 1)"; then
    echo "prebuilt extension unusable here: building"
    TE_FUSER_CUDA=1 MAX_JOBS=16 $PY setup.py -q build_ext --inplace || exit 1
  fi
}

facts() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-2000
  $PY -c "import torch, te_fuser; from te_fuser.kernels import cpu
print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
print('te_fuser cuda kernels:', te_fuser._extension.has_cuda_kernels())
print('cpu tier:', cpu.detected_isa(), cpu.available_isa())"
}

PYTEST_FLAGS="-q -p te_fuser.testing.pytest_plugin -p no:cacheprovider --timeout=300"
PYTEST="$PYTEST_FLAGS tests --ignore=tests/c"
export PYTEST PYTEST_FLAGS

cuda_tests() { $PY -m pytest $PYTEST -n 8 -k cuda; }
cpu_tests() { $PY -m pytest $PYTEST -n 7 -k "not cuda"; }
tests() { $PY -m pytest $PYTEST -n 8; }
demo() { $PY -m te_fuser.examples.train --device cuda --steps 40 --plot "" && $PY -m te_fuser.examples.train --device cuda --steps 40 --plot "" --dtype bfloat16; }
c_core() { sh tests/c/run_gemm.sh && sh tests/c/run_attention.sh && sh tests/c/run.sh; }
c_attention() { sh tests/c/run_attention.sh; }

bench_fp8_linear() { taskset -c 2,3 $PY benchmarks/bench_fp8_linear.py --threads 2 --all-isa; }
# issue 29's layer step: b=1 and b=2 at s=4096, eager and compiled, torchao where it imports.
bench_layer() {
  $PY benchmarks/bench_layer_step.py --batch 1 --iters 10 --compile --torchao
  $PY benchmarks/bench_layer_step.py --batch 2 --iters 10
}
bench_attention() { $PY benchmarks/bench_attention_cuda.py --iters 20; }
# issue 29's CUDA graphs: capture/replay against eager, then the layer step graphed at b=1, s=2048 beside eager.
cuda_graphs() {
  $PY -m pytest -q -p te_fuser.testing.pytest_plugin -p no:cacheprovider --timeout=300 tests/test_graph_cuda.py \
    tests/modules/test_graph.py tests/compat/test_graph_state_manager.py
  $PY benchmarks/bench_layer_step.py --batch 1 --seq 2048 --iters 10 --graphed
}
# CPU offload: the device bytes held between forward and backward drop by what moved to pinned host memory.
cpu_offload() {
  $PY -m pytest -q -p te_fuser.testing.pytest_plugin -p no:cacheprovider --timeout=300 -rs \
    tests/test_cpu_offload_cuda.py tests/test_cpu_offload.py
  $PY benchmarks/bench_cpu_offload.py --module linear
  $PY benchmarks/bench_cpu_offload.py --module layer --layers 4 --hidden 2048
}
# Issue 31's block-scaled recipes: the CUDA quantizers bit for bit against the CPU's, the block GEMM's engines,
# the modules against the CPU; then each recipe's Linear step against bf16 at an LLM shape and a small one.
block_cuda() {
  $PY -m pytest $PYTEST_FLAGS -n 8 -rs tests/test_block_quantize_cuda.py tests/test_block_gemm_cuda.py \
    tests/test_block_recipes_cuda.py
}
bench_block_gpu() {
  $PY benchmarks/bench_block_linear.py --device cuda --tokens 8192 --features 4096 --repeats 10
  $PY benchmarks/bench_block_linear.py --device cuda --tokens 2048 --features 1024 --repeats 10
}
bench_gpu() {
  $PY benchmarks/bench_quantize.py --device cuda
  $PY benchmarks/bench_linear.py --device cuda
  # issue 29's LLM shapes at 8192 tokens: Llama-3-8B's q/o, up, down and GQA k/v projections.
  local shape
  for shape in 4096:4096 4096:14336 14336:4096 4096:1024; do
    $PY benchmarks/bench_linear.py --device cuda --tokens 8192 --in-features "${shape%%:*}" --out-features "${shape##*:}"
  done
}

# The issue's shapes on two cores of this host, pinned, so the figures compare with the 2-core machine.
bench_cpu() {
  local pin="taskset -c 2,3"
  $pin $PY benchmarks/bench_attention.py --device cpu --dtype bfloat16 --backends auto,te_fuser,cpu_flash
  $pin $PY benchmarks/bench_attention.py --device cpu --dtype float32 --backends auto,te_fuser,cpu_flash
  $pin $PY benchmarks/bench_attention.py --device cpu --dtype bfloat16 --fp8-dpa
  $pin $PY benchmarks/bench_fp8_linear.py --threads 2
  $pin $PY benchmarks/bench_quantize.py --device cpu --heap
  $pin $PY benchmarks/bench_gpt.py --threads 2
}

export PY
export -f bench_fp8_linear bench_layer cuda_graphs cpu_offload block_cuda bench_block_gpu facts cuda_tests cpu_tests tests demo c_core c_attention bench_attention bench_gpu bench_cpu
prepare
for stage in "$@"; do
  case $stage in
    facts) run_stage facts 60 facts ;;
    cuda_tests) run_stage cuda_tests 300 cuda_tests ;;
    cpu_tests) run_stage cpu_tests 330 cpu_tests ;;
    tests) run_stage tests 330 tests ;;
    demo) run_stage demo 120 demo ;;
    c_core) run_stage c_core 240 c_core ;;
    c_attention) run_stage c_attention 150 c_attention ;;
    bench_attention) TAIL=80 run_stage bench_attention 420 bench_attention ;;
    bench_gpu) run_stage bench_gpu 120 bench_gpu ;;
    bench_fp8_linear) run_stage bench_fp8_linear 120 bench_fp8_linear ;;
    bench_layer) run_stage bench_layer 240 bench_layer ;;
    cuda_graphs) TAIL=40 run_stage cuda_graphs 240 cuda_graphs ;;
    cpu_offload) TAIL=40 run_stage cpu_offload 150 cpu_offload ;;
    block_cuda) run_stage block_cuda 150 block_cuda ;;
    bench_block_gpu) run_stage bench_block_gpu 150 bench_block_gpu ;;
    bench_cpu) run_stage bench_cpu 450 bench_cpu ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
