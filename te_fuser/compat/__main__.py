"""python -m te_fuser.compat [--force] script.py [args...]   (or: -m package.module [args...])

Installs the `transformer_engine` alias (te_fuser.compat.install_transformer_engine),
then runs the script (or module) as __main__ with the remaining arguments, so a
TransformerEngine script runs on te_fuser unchanged. With torchrun:
`torchrun --nproc-per-node 2 -m te_fuser.compat script.py args...`.
"""

import runpy
import sys

from . import install_transformer_engine


def main(argv) -> dict:
    """Install the alias and run the script / module; returns the globals it ran with."""
    args = list(argv)
    force = False
    if args and args[0] == "--force":
        force, args = True, args[1:]
    if not args or args[0] in ("-h", "--help") or (args[0] == "-m" and len(args) < 2):
        raise SystemExit(__doc__)
    install_transformer_engine(force=force)
    if args[0] == "-m":
        sys.argv = args[1:]
        return runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    sys.argv = args
    return runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
