#!/bin/sh
# Usage: run_attention.sh [native|amx-model]   (no argument: both, one after the other)
# Builds the standalone attention C core test under AddressSanitizer and UBSan
# and runs it: "native" as built for the machine, "amx-model" with the AMX
# kernels on the software tile model (TF_ATTN_AMX_EMULATE, attention_amx_tile.h),
# which the test then compares with the double reference and the vector path.
# The two builds are independent, so `make c-check` runs them side by side.
# Each run prints "N passed, M failed" last (exit 1 on failures).
set -eu
root="$(cd "$(dirname "$0")/../.." && pwd)"
run() {
  exe="${TMPDIR:-/tmp}/te_fuser_test_attention_core_$1.$$"
  shift
  trap 'rm -f "$exe"' EXIT
  "${CC:-cc}" -std=c11 -O1 -g -Wall -Wextra -Werror -Wno-psabi -fsanitize=address,undefined \
    -fno-sanitize-recover=all -fno-omit-frame-pointer -I"$root/csrc" "$@" \
    "$root/tests/c/test_attention_core.c" "$root"/csrc/attention/*.c "$root"/csrc/common/*.c -lm -o "$exe"
  "$exe"
  rm -f "$exe"
}
case "${1:-both}" in
  native) run native ;;
  amx-model) run amx_model -DTF_ATTN_AMX_EMULATE ;;
  both) run native; run amx_model -DTF_ATTN_AMX_EMULATE ;;
  *) echo "run_attention.sh: unknown mode '$1' (native, amx-model or nothing for both)" >&2; exit 2 ;;
esac
