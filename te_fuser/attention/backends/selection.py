"""Which attention backend runs a problem: the fastest one measured on the device that supports it.

Order of decision:
1. A backend named explicitly -- a module's `attention_backend`, else the environment variable
   TE_FUSER_ATTENTION_BACKEND -- is the only candidate; when it cannot run the problem, the call fails
   with its reason.
2. Otherwise TE's variables remove backends, each te_fuser backend standing in for one of TE's three
   (TE_FAMILIES): NVTE_FLASH_ATTN=0 removes TE's FlashAttention (torch's FlashAttention kernel on CUDA,
   torch's CPU flash kernel), NVTE_FUSED_ATTN=0 TE's FusedAttention (cuDNN, and te_fuser's own fused
   kernels, C on the CPU and CUDA C), NVTE_UNFUSED_ATTN=0 TE's UnfusedDotProductAttention (the unfused math
   path).
3. The first backend of the device's row in PREFERENCES that supports the problem runs it.

NVTE_DEBUG=1 with NVTE_DEBUG_LEVEL=1 logs each choice (logger "te_fuser.attention", to stderr), level 2
also why each other backend was passed over, as TE does.

A choice is made once per kind of problem (a Problem), named backend and value of these variables, and
kept (clear_cache() forgets the choices, so that the next ones are logged again).
"""

import logging
import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .base import Backend
from .cpu_flash import TorchCpuFlash
from .cudnn import CudnnAttention
from .flash import FlashAttention
from .problem import Problem
from .te_kernel import TeFuserKernels
from .unfused import Unfused

BACKENDS: Dict[str, Backend] = {b.name: b for b in (TeFuserKernels(), CudnnAttention(), FlashAttention(),
                                                    TorchCpuFlash(), Unfused())}
ENV_BACKEND = "TE_FUSER_ATTENTION_BACKEND"
TE_SWITCHES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
# TE's name of the backend family each switch turns off (TE's get_attention_backend answers per family).
TE_FAMILIES = {"NVTE_FLASH_ATTN": "FlashAttention", "NVTE_FUSED_ATTN": "FusedAttention",
               "NVTE_UNFUSED_ATTN": "UnfusedDotProductAttention"}
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Preference:
    """Backends fastest first for the problems of one kind of device, and the measurement behind it."""
    device: str                      # "cuda", "cpu" or "meta"
    match: Tuple                     # CUDA: compute capabilities (empty: any); CPU: te_fuser ISA tiers
    dtypes: Tuple                    # the q/k/v dtypes of the row (empty: any)
    order: Tuple[str, ...]
    source: str


# The first row whose device, match and dtypes fit a problem gives its order (TE_FUSER_ATTENTION_BACKEND
# and a module's attention_backend override it). Figures: same-run medians, ratios of times.
PREFERENCES = (
    Preference("cuda", ((9, 0),), (), ("cudnn", "flash", "te_fuser", "unfused"),
               "H100 80GB HBM3, torch 2.11.0+cu130, 2026-11-25, benchmarks/bench_attention_cuda.py --iters 20 "
               "(benchmarks/RESULTS.md, GPU): bf16, 16 Ki tokens, seq 16384, TFLOP/s cuDNN / flash / te_fuser: "
               "fwd d128 662 / 353 / 189, fwd d128 causal 602 / 319 / 182, fwd d64 causal 443 / 303 / 136, "
               "fwd+bwd d128 causal 520 / 316 / 146, fwd+bwd d64 causal 432 / 284 / 156. H200 is the same "
               "sm_90 chip. FP8 q/k/v run on te_fuser's kernels only."),
    Preference("cuda", (), (), ("flash", "cudnn", "te_fuser", "unfused"),
               "not measured on these GPUs: FlashAttention first as torch's SDPA orders its backends; te_fuser's "
               "CUDA kernels ran at 0.45-0.57x flash on the H100 (row above)."),
    Preference("cpu", ("portable",), (), ("cpu_flash", "te_fuser", "unfused"),
               "AMD EPYC Zen 1, 2 threads, 2026-11-24, benchmarks/bench_attention.py: te_fuser's baseline "
               "x86-64 build took 9x torch's CPU flash time forward, 7x forward+backward ([8, 256, 8, 64] "
               "causal fp32)."),
    Preference("cpu", ("amx",), SIXTEEN_BIT, ("cpu_flash", "te_fuser", "unfused"),
               "Sapphire Rapids (AMX), 2 threads: 2026-11-25 bench_attention.py --dtype bfloat16 "
               "[1, 2048, 8, 64] causal, te_fuser 27.5 / 102 ms, SDPA (torch's CPU flash) 15.7 / 95.2 ms "
               "fwd / fwd+bwd (0.57x / 0.94x); 2026-11-28: 0.49x forward, 0.89x forward+backward."),
    Preference("cpu", ("amx",), (), ("te_fuser", "cpu_flash", "unfused"),
               "Sapphire Rapids (AMX), 2 threads, float32 [1, 2048, 8, 64] causal: te_fuser 24.2 / 118 ms, "
               "SDPA 30.6 / 155 ms fwd / fwd+bwd on 2026-11-25 (1.27x / 1.32x); 1.17x on 2026-11-28."),
    Preference("cpu", ("avx512", "avx512_bf16"), (), ("te_fuser", "cpu_flash", "unfused"),
               "AMD EPYC Zen 4 (avx512_bf16), 2 threads, torch 2.13.0, benchmarks/bench_attention.py "
               "[1, 2048, 8, 64] causal: 2026-11-28 --backends te_fuser,cpu_flash --repeats 7 (a loaded "
               "machine: same-run ratios only), torch's CPU flash time / te_fuser's: bf16 2.96x fwd, 2.42x "
               "fwd+bwd; fp32 1.48x, 1.70x. 2026-11-25, quiet, against SDPA: bf16 15.5 / 37.2 ms fwd, "
               "61.3 / 104 ms fwd+bwd; fp32 25.6 / 35.1 and 97.9 / 141 ms."),
    Preference("cpu", ("avx2",), (), ("te_fuser", "cpu_flash", "unfused"),
               "AMD EPYC Zen 1, 2 threads, 2026-11-24, benchmarks/bench_attention.py --isa avx2: te_fuser / "
               "torch's CPU flash 1.23-1.26x fwd, 1.26-1.47x fwd+bwd in fp32, 1.17-1.34x and 4.6x in bf16 "
               "([1, 2048, 8, 64] causal)."),
    Preference("meta", (), (), ("te_fuser", "cudnn", "flash", "cpu_flash", "unfused"),
               "meta tensors carry shapes only: te_fuser's fake kernels, unless a backend is named."),
)

logger = logging.getLogger("te_fuser.attention")
_cache: Dict[Tuple, "Choice"] = {}


@dataclass(frozen=True)
class Choice:
    """The backend that runs a problem, and why each other one does not."""
    backend: str
    passed_over: Dict[str, str]
    problem: Problem
    source: str
    runnable: Tuple[str, ...] = ()   # the backends that could run it (the chosen one first)

    def __str__(self):
        lines = [f"{self.backend} runs it ({self.source})"]
        lines += [f"  {name}: {reason}" for name, reason in self.passed_over.items()]
        return "\n".join(lines)


def preference_for(problem: Problem) -> Preference:
    for row in PREFERENCES:
        if row.device != problem.device or (row.dtypes and problem.dtype not in row.dtypes):
            continue
        key = problem.capability if problem.device == "cuda" else problem.isa
        if not row.match or key in row.match:
            return row
    raise ValueError(f"no attention backend runs {problem.device} tensors")


def check_backend_name(name: Optional[str], what: str) -> Optional[str]:
    """name when it names a backend (None: automatic), else a ValueError naming `what`."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"{what}={name!r} is not an attention backend; use one of {', '.join(BACKENDS)} "
                         "(or None for the automatic choice)")
    return name


def _environment():
    return (os.environ.get(ENV_BACKEND) or None,) + tuple(os.environ.get(v) for v in TE_SWITCHES)


def choose(problem: Problem, backend: Optional[str] = None) -> Choice:
    """The Choice for problem; backend names one explicitly (a module's attention_backend)."""
    environment = _environment()
    key = (problem, backend, environment)
    compiling = torch.compiler.is_compiling()
    choice = None if compiling else _cache.get(key)
    if choice is None:
        choice = _choose(problem, backend, environment)
        if not compiling:
            _cache[key] = choice
            _log(choice)
    return choice


def _choose(problem, backend, environment) -> Choice:
    named, switches = environment[0], dict(zip(TE_SWITCHES, environment[1:]))
    if backend is not None:
        named = check_backend_name(backend, "attention_backend")
        why_named = f"the module's attention_backend={backend!r}"
    elif named is not None:
        check_backend_name(named, ENV_BACKEND)
        why_named = f"{ENV_BACKEND}={named}"
    row = preference_for(problem)
    passed_over = {}
    chosen = None
    runnable = []
    for name in row.order + tuple(n for n in BACKENDS if n not in row.order):
        impl = BACKENDS[name]
        if named is not None and name != named:
            passed_over[name] = f"not named ({why_named})"
            continue
        if named is None and impl.te_switch is not None and switches[impl.te_switch] == "0":
            passed_over[name] = f"{impl.te_switch}=0"
            continue
        ok, reason = impl.supports(problem)
        if ok:
            runnable.append(name)
        if ok and chosen is None:
            chosen = name
        elif ok:
            passed_over[name] = f"supported, after {chosen} in this device's order"
        elif named is not None:
            raise ValueError(f"attention backend {name!r} ({why_named}) cannot run this problem: {reason}")
        else:
            passed_over[name] = reason
    if chosen is None:
        details = "; ".join(f"{n}: {r}" for n, r in passed_over.items())
        raise RuntimeError(f"no attention backend can run this problem ({details})")
    source = why_named if named is not None else row.source
    return Choice(chosen, passed_over, problem, source, tuple(runnable))


def _debug_level() -> int:
    try:
        return int(os.environ.get("NVTE_DEBUG", "0")) * int(os.environ.get("NVTE_DEBUG_LEVEL", "0"))
    except ValueError:
        return 0


def _log(choice: Choice) -> None:
    level = _debug_level()
    if level <= 0:
        return
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(levelname)-8s | %(name)-19s]: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if level >= 2 else logging.INFO)
    logger.info("Selected backend = %s for %s", choice.backend, choice.problem)
    for name, reason in choice.passed_over.items():
        logger.debug("Disabling %s: %s", name, reason)


def te_family(backend: str) -> str:
    """TE's name of the backend family a te_fuser backend stands for (FlashAttention, FusedAttention or
    UnfusedDotProductAttention): the one whose NVTE_* switch turns it off."""
    return TE_FAMILIES[BACKENDS[backend].te_switch]


def clear_cache() -> None:
    """Forget the choices made (they are kept per problem, named backend and environment): the next ones are
    made, and logged, again."""
    _cache.clear()
