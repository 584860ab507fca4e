"""The README's table of TransformerEngine's public names that te_fuser provides, generated so it cannot drift.

    python tools/te_suite/compat_names.py           # print the table
    python tools/te_suite/compat_names.py --write   # put it into README.md between its markers

It reads te_v2.6_names.txt (TE 2.6's public PyTorch names, listed from TE's sources by public_names.py) and
resolves each name through te_fuser's `transformer_engine` alias. tests/compat/test_readme_te_names.py fails
when README.md's table differs from this output.
"""

import argparse
import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAMES = HERE / "te_v2.6_names.txt"
README = HERE.parent.parent / "README.md"
START = "<!-- te-names:start: tools/te_suite/compat_names.py --write -->"
END = "<!-- te-names:end -->"


def te_names(path: Path = NAMES) -> dict:
    modules: dict = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            module, name = line.split()
            modules.setdefault(module, []).append(name)
    return modules


def provided(module: str, name: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def table() -> str:
    from te_fuser import compat

    installed = compat.is_installed()
    compat.install_transformer_engine()
    try:
        lines = [START, "", "| TE 2.6 module | names provided | not provided |", "| --- | --- | --- |"]
        for module, names in te_names().items():
            missing = [n for n in names if not provided(module, n)]
            lines.append(f"| `{module}` | {len(names) - len(missing)} of {len(names)} | "
                         f"{', '.join(f'`{n}`' for n in missing) or '—'} |")
        return "\n".join(lines + ["", END])
    finally:
        if not installed:
            compat.uninstall_transformer_engine()


def readme_section(text: str) -> str:
    start, end = text.index(START), text.index(END) + len(END)
    return text[start:end]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in README.md")
    args = parser.parse_args(argv)
    generated = table()
    if args.write:
        text = README.read_text()
        README.write_text(text.replace(readme_section(text), generated))
    else:
        print(generated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
