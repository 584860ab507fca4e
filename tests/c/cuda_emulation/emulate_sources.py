"""Rewrites CUDA sources for the host emulation (cuda_runtime.h here):
`k<<<g, b, s, st>>>(args);` becomes `emu_launch(emu_kernel_id(k), g, b, s, st, [&] { k(args); });`
and `extern __shared__ __align__(A) T name[];` becomes `T *const name = emu_dynamic_shared<T>(A);`.
Line numbers are kept, and #line names the original file, so diagnostics point into it.
Usage: emulate_sources.py OUT_DIR FILE.cu...  (OUT_DIR/FILE.cpp for each; includes resolve from OUT_DIR)"""

import os
import re
import sys

LAUNCH = re.compile(r"([\w:]+(?:<[^<>;]*>)?)<<<(.*?)>>>\((.*?)\);", re.S)
DYNAMIC_SHARED = re.compile(r"extern\s+__shared__\s+__align__\((\d+)\)\s+(\w+)\s+(\w+)\[\];")


def launch(m):
    call = f"emu_launch(emu_kernel_id({m[1]}), {m[2]}, [&] {{ {m[1]}({m[3]}); }});"
    return call.replace("\n", " ") + "\n" * m[0].count("\n")


def main(out_dir, sources):
    for src in sources:
        text = open(src).read()
        text = DYNAMIC_SHARED.sub(lambda m: f"{m[2]} *const {m[3]} = emu_dynamic_shared<{m[2]}>({m[1]});", text)
        text, launches = LAUNCH.subn(launch, text)
        if "<<<" in text or "__shared__ __align__" in text or launches == 0:
            sys.exit(f"{src}: a kernel launch or dynamic shared array was not rewritten")
        name = os.path.splitext(os.path.basename(src))[0] + ".cpp"
        with open(os.path.join(out_dir, name), "w") as out:
            out.write(f'#include <cuda_runtime.h>\n#line 1 "{os.path.abspath(src)}"\n{text}')


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
