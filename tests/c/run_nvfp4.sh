#!/bin/sh
# Builds the standalone NVFP4 C core test under AddressSanitizer and UBSan and runs it; the last
# line it prints is "N passed, M failed" (exit status 1 on failures).
set -eu
root="$(cd "$(dirname "$0")/../.." && pwd)"
exe="${TMPDIR:-/tmp}/te_fuser_test_nvfp4_core.$$"
trap 'rm -f "$exe"' EXIT
"${CC:-cc}" -std=c11 -O1 -g -Wall -Wextra -Werror -fsanitize=address,undefined \
  -fno-sanitize-recover=all -fno-omit-frame-pointer -I"$root/csrc" \
  "$root/tests/c/test_nvfp4_core.c" "$root/csrc/fp4/nvfp4.c" "$root/csrc/fp4/nvfp4_quantize_avx512.c" \
  "$root/csrc/fp4/nvfp4_quantize_avx2.c" \
  "$root"/csrc/common/*.c -lm -o "$exe"
"$exe"
