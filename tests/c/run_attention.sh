#!/bin/sh
# Builds the standalone attention C core test under AddressSanitizer and UBSan
# and runs it twice: as built for the machine, and with the AMX kernels on the
# software tile model (TF_ATTN_AMX_EMULATE, attention_amx_tile.h), which the
# test then compares with the double reference and the vector path. Each run
# prints "N passed, M failed" last (exit 1 on failures).
set -eu
root="$(cd "$(dirname "$0")/../.." && pwd)"
exe="${TMPDIR:-/tmp}/te_fuser_test_attention_core.$$"
trap 'rm -f "$exe" "$exe.emu"' EXIT
build() {
  "${CC:-cc}" -std=c11 -O1 -g -Wall -Wextra -Werror -Wno-psabi -fsanitize=address,undefined \
    -fno-sanitize-recover=all -fno-omit-frame-pointer -I"$root/csrc" "$@" \
    "$root/tests/c/test_attention_core.c" "$root"/csrc/attention/*.c "$root"/csrc/common/*.c -lm
}
build -o "$exe"
build -DTF_ATTN_AMX_EMULATE -o "$exe.emu"
"$exe"
"$exe.emu"
