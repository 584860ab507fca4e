"""The extension binds to torch only through the stable C ABI, and is built for the limited Python API."""

import shutil
import subprocess

import pytest

import te_fuser._C as ext

# Mangled C++ names from torch's unstable API: c10::, at::, torch:: (the stable API is C functions).
UNSTABLE_PREFIXES = ("_ZN3c10", "_ZNK3c10", "_ZN2at", "_ZNK2at", "_ZN5torch", "_ZNK5torch")


def test_built_as_abi3():
    assert ext.__file__.endswith(".abi3.so"), ext.__file__


@pytest.mark.skipif(shutil.which("nm") is None, reason="binutils' nm is not installed")
def test_only_stable_abi_symbols_are_imported():
    out = subprocess.run(["nm", "-D", "--undefined-only", ext.__file__], check=True, capture_output=True, text=True)
    names = [line.split()[-1] for line in out.stdout.splitlines() if line.strip()]
    unstable = [n for n in names if n.startswith(UNSTABLE_PREFIXES)]
    assert not unstable, f"te_fuser._C imports torch's unstable C++ API: {unstable[:10]}"
    assert any(n.startswith("aoti_torch_") for n in names)
    python_api = [n for n in names if n.startswith("Py")]
    assert python_api == ["PyModule_Create2"], python_api
