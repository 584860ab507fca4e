"""Rewrites CUDA sources for the host emulation: `k<<<g, b, s, st>>>(args);` becomes
`emu_launch(g, b, s, st, [&] { k(args); });`. Usage: emulate_sources.py OUT_DIR FILE.cu..."""

import os
import re
import sys

LAUNCH = re.compile(r"([\w:]+(?:<[^<>;]*>)?)<<<(.*?)>>>\((.*?)\);", re.S)


def main(out_dir, sources):
    for src in sources:
        text = open(src).read()
        rewritten, launches = LAUNCH.subn(lambda m: f"emu_launch({m[2]}, [&] {{ {m[1]}({m[3]}); }});", text)
        if "<<<" in rewritten or launches == 0:
            sys.exit(f"{src}: a kernel launch was not rewritten")
        name = os.path.splitext(os.path.basename(src))[0] + ".cpp"
        with open(os.path.join(out_dir, name), "w") as out:
            out.write(f'#include <cuda_runtime.h>\n#line 1 "{os.path.abspath(src)}"\n{rewritten}')


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
