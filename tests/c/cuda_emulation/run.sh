#!/bin/sh
# Usage: run.sh AREA   (AREA = fp8, ops, attention or block)
# Runs the CUDA kernels of csrc/cuda/AREA on the host (cuda_runtime.h here stands
# in for the GPU) against the C core of csrc/AREA (of csrc/fp8 and csrc/fp4 for
# block, the block-scaled quantizers), with test_AREA_cuda_emulated.cpp,
# under AddressSanitizer (every kernel access to global and shared memory is
# bounds-checked) and UBSan (which also checks the alignment of every vector
# access); no GPU or nvcc needed. The kernels are built from a copy of csrc in
# which each header of csrc/cuda/AREA that has a namesake here (the inline-PTX
# header) is replaced by its host model. The last line printed is
# "N passed, M failed" (exit status 1 on failures). JOBS (default 2)
# compilations run at once.
set -eu
area="${1:?usage: run.sh fp8|ops|attention|block}"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
[ -f "$here/test_${area}_cuda_emulated.cpp" ] || { echo "run.sh: no emulation test for '$area'" >&2; exit 2; }
work="$(mktemp -d "${TMPDIR:-/tmp}/te_fuser_${area}_cuda_emulation.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cp -R "$root/csrc" "$work/csrc"
for f in "$here"/*.cuh; do
  if [ -f "$work/csrc/cuda/$area/$(basename "$f")" ]; then cp "$f" "$work/csrc/cuda/$area/"; fi
done
python3 "$here/emulate_sources.py" "$work/csrc/cuda/$area" "$root"/csrc/cuda/"$area"/*.cu
export CC="${CC:-cc}" CXX="${CXX:-c++}" here work area
export flags="-Og -g1 -ffp-contract=off -fno-strict-aliasing -fsanitize=address,undefined -fno-sanitize-recover=all"
compile='case "$1" in
  *.c) $CC -std=c11 $flags -Wall -Wextra -Werror -Wno-psabi -I"$work/csrc" -c "$1" -o "$work/obj_${1##*/}.o" ;;
  *) $CXX -std=c++20 $flags -Wall -Wextra -Werror -Wno-unknown-pragmas -I"$here" -I"$work/csrc" \
       -I"$work/csrc/cuda/$area" -c "$1" -o "$work/obj_${1##*/}.o" ;;
esac'
case "$area" in block) c_areas="fp8 fp4" ;; *) c_areas="$area" ;; esac
{
  for c_area in $c_areas; do ls "$work/csrc/$c_area"/*.c; done
  ls "$work"/csrc/common/*.c "$here/test_${area}_cuda_emulated.cpp" "$work"/csrc/cuda/"$area"/*.cpp
} | xargs -I{} -P "${JOBS:-2}" sh -c "$compile" compile {}
"$CXX" -fsanitize=address,undefined "$work"/obj_*.o -o "$work/test"
"$work/test"
