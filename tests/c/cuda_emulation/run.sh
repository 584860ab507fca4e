#!/bin/sh
# Usage: run.sh AREA   (AREA = fp8 or ops)
# Runs the CUDA kernels of csrc/cuda/AREA on the host (cuda_runtime.h here stands
# in for the GPU) against the C core of csrc/AREA, with test_AREA_cuda_emulated.cpp,
# under UBSan (which also checks the alignment of every vector access); no GPU or
# nvcc needed. The last line printed is "N passed, M failed" (exit status 1 on failures).
set -eu
area="${1:?usage: run.sh fp8|ops}"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
[ -f "$here/test_${area}_cuda_emulated.cpp" ] || { echo "run.sh: no emulation test for '$area'" >&2; exit 2; }
work="$(mktemp -d "${TMPDIR:-/tmp}/te_fuser_${area}_cuda_emulation.XXXXXX")"
trap 'rm -rf "$work"' EXIT
python3 "$here/emulate_sources.py" "$work" "$root"/csrc/cuda/"$area"/*.cu
flags="-O1 -g -ffp-contract=off -fno-strict-aliasing -fsanitize=undefined -fno-sanitize-recover=all"
for f in "$root"/csrc/"$area"/*.c "$root"/csrc/common/*.c; do
  "${CC:-cc}" -std=c11 $flags -Wall -Wextra -Werror -I"$root/csrc" -c "$f" -o "$work/$(basename "$f").o"
done
for f in "$here/test_${area}_cuda_emulated.cpp" "$work"/*.cpp; do
  "${CXX:-c++}" -std=c++20 $flags -Wall -Wextra -Werror -Wno-unknown-pragmas -I"$here" -I"$root/csrc" \
    -I"$root/csrc/cuda/$area" -c "$f" -o "$work/$(basename "$f").cxx.o"
done
"${CXX:-c++}" -fsanitize=undefined "$work"/*.o -lpthread -o "$work/test"
"$work/test"
