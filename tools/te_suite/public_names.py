"""List TransformerEngine's public PyTorch names at a tag, from a TE git clone (facts only: module and name).

    python tools/te_suite/public_names.py --te PATH/TO/TransformerEngine --tag v2.6 > tools/te_suite/te_v2.6_names.txt

A module's public names are its `__all__` when it has one, else what it imports at top level from its own
API (transformer_engine.pytorch or .common) or defines (functions, classes), without a leading underscore.
compat_names.py checks them against te_fuser's alias.
"""

import argparse
import ast
import subprocess
import sys

# TE module -> its file in the repository.
MODULES = {
    "transformer_engine.pytorch": "transformer_engine/pytorch/__init__.py",
    "transformer_engine.pytorch.attention": "transformer_engine/pytorch/attention/__init__.py",
    "transformer_engine.pytorch.module": "transformer_engine/pytorch/module/__init__.py",
    "transformer_engine.pytorch.ops": "transformer_engine/pytorch/ops/__init__.py",
    "transformer_engine.pytorch.tensor": "transformer_engine/pytorch/tensor/__init__.py",
    "transformer_engine.pytorch.distributed": "transformer_engine/pytorch/distributed.py",
    "transformer_engine.pytorch.fp8": "transformer_engine/pytorch/fp8.py",
    "transformer_engine.pytorch.optimizers": "transformer_engine/pytorch/optimizers/__init__.py",
    "transformer_engine.common.recipe": "transformer_engine/common/recipe/__init__.py",
}


def read(te: str, tag: str, path: str) -> str:
    return subprocess.run(["git", "-C", te, "show", f"{tag}:{path}"], check=True, capture_output=True,
                          text=True).stdout


def module_file(te: str, tag: str, module: str) -> str:
    """The file of a transformer_engine module at tag (a package's __init__.py or a module's .py)."""
    base = module.replace(".", "/")
    listed = subprocess.run(["git", "-C", te, "ls-tree", "--name-only", tag, f"{base}.py", f"{base}/__init__.py"],
                            check=True, capture_output=True, text=True).stdout.split()
    return listed[0]


def public_names(te: str, tag: str, module: str, path: str) -> list:
    tree = ast.parse(read(te, tag, path))
    names = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return sorted(ast.literal_eval(node.value))
        if isinstance(node, ast.ImportFrom):
            package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
            for _ in range(max(node.level - 1, 0)):
                package = package.rsplit(".", 1)[0]
            origin = (package + "." + node.module if node.module else package) if node.level else node.module
            if not origin.startswith(".".join(module.split(".")[:2])):  # re-exports of the API's own names only
                continue
            for alias in node.names:
                if alias.name == "*":  # the star-imported module's own public names
                    names += public_names(te, tag, origin, module_file(te, tag, origin))
                else:
                    names.append(alias.asname or alias.name)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
    return sorted({n for n in names if not n.startswith("_")})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--te", required=True, help="a git clone of NVIDIA/TransformerEngine")
    parser.add_argument("--tag", default="v2.6")
    args = parser.parse_args(argv)
    print(f"# TransformerEngine {args.tag}: public names of its PyTorch API (tools/te_suite/public_names.py)")
    for module, path in MODULES.items():
        for name in public_names(args.te, args.tag, module, path):
            print(f"{module} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
