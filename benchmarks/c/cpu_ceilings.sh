#!/bin/sh
# Builds benchmarks/c/cpu_ceilings.c against the C core with the extension's C flags (setup.py) and runs it.
set -eu
root="$(cd "$(dirname "$0")/../.." && pwd)"
exe="${TMPDIR:-/tmp}/te_fuser_cpu_ceilings.$$"
trap 'rm -f "$exe"' EXIT
"${CC:-cc}" -std=c11 -O3 -fno-trapping-math -Wall -Wextra -Werror -I"$root/csrc" "$root/benchmarks/c/cpu_ceilings.c" \
  "$root"/csrc/fp8/*.c "$root"/csrc/common/*.c -lm -o "$exe"
"$exe"
