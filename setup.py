"""Build of te_fuser._C: C11 kernels, a thin stable-ABI C++ binding, and CUDA C kernels.

The C core (csrc/**/*.c) is compiled here with C flags and linked into the
extension as objects, because torch's BuildExtension would hand C++ flags to
.c files. CUDA sources (csrc/cuda/**/*.cu and csrc/binding/*_cuda.cpp) join
when the installed torch has CUDA and nvcc is found; TE_FUSER_CUDA=0/1 forces
either way.
"""

import glob
import os
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("csrc")

# The oldest torch whose stable ABI we target: one build serves 2.10 and newer.
TORCH_TARGET_VERSION = "0x020a000000000000"
CUDA_ARCHS = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a"]

# -Wno-psabi: GCC notes that 64-byte vector arguments changed ABI in GCC 4.6; ours are all internal.
C_FLAGS = ["-std=c11", "-O3", "-fPIC", "-fno-trapping-math", "-Wall", "-Wextra", "-Werror", "-Wno-psabi"]
# torch's headers are marked as system headers so -Wextra -Werror applies to our code only.
TORCH_SYSTEM_INCLUDES = [f"-isystem{d}" for d in cpp_extension.include_paths()]
CXX_FLAGS = [
    *TORCH_SYSTEM_INCLUDES,
    "-O3",
    "-Wall",
    "-Wextra",
    "-Werror",
    f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}",
]
NVCC_FLAGS = [
    "-O3",
    "-Werror=all-warnings",
    "--expt-relaxed-constexpr",
    f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}",
    *CUDA_ARCHS,
]


def want_cuda():
    forced = os.environ.get("TE_FUSER_CUDA")
    if forced is not None:
        return forced == "1"
    import torch

    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def c_core_sources():
    """Every C source outside csrc/cuda; the module init is among them."""
    return sorted(
        s for s in glob.glob(os.path.join(CSRC, "**", "*.c"), recursive=True)
        if not s.startswith(os.path.join(CSRC, "cuda"))
    )


def storage_poison_extension():
    """The one classic-API module (see csrc/README.md): tied to the torch it was built against."""
    return cpp_extension.CppExtension(
        name="te_fuser._storage_poison",
        sources=[os.path.join(CSRC, "binding_classic", "storage_poison.cpp")],
        extra_compile_args={"cxx": TORCH_SYSTEM_INCLUDES + ["-O2", "-Wall", "-Wextra", "-Werror"]},
        py_limited_api=True,
    )


class BuildExtension(cpp_extension.BuildExtension):
    """Compiles the C sources with a C compiler and C flags, then builds the rest."""

    def run(self):
        super().run()
        self._record_torch()

    def build_extension(self, ext):
        c_sources = [s for s in ext.sources if s.endswith(".c")]
        ext.sources = [s for s in ext.sources if not s.endswith(".c")]
        ext.extra_objects = list(ext.extra_objects or []) + self._compile_c(c_sources)
        super().build_extension(ext)

    def _record_torch(self):
        """The exact torch the classic-API module is built for; release_storage loads it only there."""
        import torch

        folders = [os.path.join(self.build_lib, "te_fuser")]
        if self.inplace:  # the modules were copied into the source tree
            folders.append(os.path.join(ROOT, "te_fuser"))
        for folder in folders:
            with open(os.path.join(folder, "_storage_poison_torch.txt"), "w") as handle:
                handle.write(f"{torch.__version__} {torch.version.git_version}\n")

    def _compile_c(self, sources):
        cc = os.environ.get("CC", "cc")
        limited_api = ["-DPy_LIMITED_API=0x030A0000", "-I" + sysconfig.get_paths()["include"]]
        out_dir = os.path.join(self.build_temp, "c_core")

        def compile_one(src):
            obj = os.path.join(out_dir, os.path.splitext(src)[0] + ".o")
            os.makedirs(os.path.dirname(obj), exist_ok=True)
            cmd = [cc, *C_FLAGS, *limited_api, "-c", src, "-o", obj]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            return obj

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            return list(pool.map(compile_one, sources))


def extension():
    cpp_sources = sorted(glob.glob(os.path.join(CSRC, "binding", "*.cpp")))
    host_sources = [s for s in cpp_sources if not s.endswith("_cuda.cpp")]
    sources = c_core_sources() + host_sources
    common = dict(name="te_fuser._C", py_limited_api=True, include_dirs=[os.path.join(ROOT, CSRC)])
    if not want_cuda():
        return cpp_extension.CppExtension(sources=sources, extra_compile_args={"cxx": CXX_FLAGS}, **common)
    cuda_sources = sorted(glob.glob(os.path.join(CSRC, "cuda", "**", "*.cu"), recursive=True))
    cuda_binding = [s for s in cpp_sources if s.endswith("_cuda.cpp")]
    return cpp_extension.CUDAExtension(
        sources=sources + cuda_binding + cuda_sources,
        extra_compile_args={"cxx": CXX_FLAGS + ["-DTE_FUSER_WITH_CUDA"], "nvcc": NVCC_FLAGS},
        **common,
    )


setup(
    ext_modules=[extension(), storage_poison_extension()],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
