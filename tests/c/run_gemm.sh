#!/bin/sh
# Builds the standalone FP8 GEMM and CPU-feature test, then the block-scaled GEMM's test, under
# AddressSanitizer and UBSan, with the library's own flags for the per-ISA kernels (function
# attributes), and runs each on every path this CPU has; each prints "N passed, M failed" last
# (exit status 1 on failures).
set -eu
root="$(cd "$(dirname "$0")/../.." && pwd)"
exe="${TMPDIR:-/tmp}/te_fuser_test_gemm_core.$$"
trap 'rm -f "$exe"' EXIT
for test in test_gemm_core test_block_scaled_gemm_core; do
  "${CC:-cc}" -std=c11 -O1 -g -fno-trapping-math -Wall -Wextra -Werror -Wno-psabi \
    -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -I"$root/csrc" \
    "$root/tests/c/$test.c" "$root"/csrc/gemm/*.c "$root"/csrc/common/*.c -lm -o "$exe"
  echo "$test:"
  "$exe"
done
