"""A pytest plugin that runs TransformerEngine's CUDA-only PyTorch tests on the CPU, on te_fuser.

It installs te_fuser's `transformer_engine` alias, then makes the CUDA the tests ask for be the CPU:
- every torch call given a CUDA device (factories, `.to`, `.cuda()`, `Module.cuda()`) gets the CPU instead,
  through a TorchFunctionMode and two patched methods;
- `torch.cuda` answers the queries the tests make as one Hopper device would (available, one device,
  capability 9.0), and its RNG, stream, event and synchronization calls act on the CPU or do nothing;
  `torch.version.cuda` reads 12.8 (a CPU build has None, which the tests pass to float());
- `torch.autocast("cuda", ...)` is CPU autocast (a CPU build disables CUDA autocast with a warning). CPU
  autocast has no float32: a test autocasting to float32 sees autocast off, as on a CPU it would.

Nothing of TransformerEngine is provided here: a name the tests import either comes from te_fuser or
fails, as it would for a user. Load it with `-p cuda_shim` (tools/te_suite/run.py does).
"""

import contextlib

import torch

_CUDA_ATTRS = {}


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)  # an ordinal means a CUDA device


def _cpu_device(value):
    return torch.device("cpu") if _is_cuda(value) else value


class _CudaToCpu(torch.overrides.TorchFunctionMode):
    """Rewrites CUDA device arguments of torch functions and tensor methods to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func in (torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones,
                    torch.Tensor.new_full, torch.Tensor.new_tensor):
            args = tuple(_cpu_device(a) if isinstance(a, (str, torch.device)) else a for a in args)
        return func(*args, **kwargs)


class _Event:
    def __init__(self, enable_timing=False, **kwargs):
        del kwargs
        self._timing = enable_timing
        self._time = None

    def record(self, stream=None):
        import time

        del stream
        self._time = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, stream=None):
        del stream

    def query(self):
        return True

    def elapsed_time(self, end):
        return (end._time - self._time) * 1000.0


class _Stream:
    def __init__(self, *args, **kwargs):
        del args, kwargs

    def synchronize(self):
        pass

    def wait_stream(self, other):
        del other

    def wait_event(self, event):
        del event

    def record_event(self, event=None):
        event = event or _Event()
        event.record()
        return event


_CUDA_VERSION = "12.8"  # TE 2.6 runs all of its FP8 block-scaling tests from CUDA 12.8 on


class _Properties:
    name = "te_fuser CPU shim"
    major, minor = 9, 0
    total_memory = 80 * 2**30
    multi_processor_count = 132


class _CpuAutocast(torch.amp.autocast_mode.autocast):
    """torch.autocast whose device_type "cuda" is the CPU."""

    def __init__(self, device_type, *args, **kwargs):
        super().__init__("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


def _patch(name, value):
    _CUDA_ATTRS.setdefault(name, getattr(torch.cuda, name, None))
    setattr(torch.cuda, name, value)


def _install_cuda_answers():
    cpu_rng = torch.random
    # torch.manual_seed seeds CUDA too when CUDA looks available: seeding the CPU generator directly avoids
    # coming back here.
    seed = lambda seed: torch.default_generator.manual_seed(int(seed))  # noqa: E731
    answers = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "get_device_capability": lambda device=None: (9, 0),
        "get_device_name": lambda device=None: _Properties.name,
        "get_device_properties": lambda device=None: _Properties(),
        "is_bf16_supported": lambda including_emulation=True: True,
        "synchronize": lambda device=None: None,
        "manual_seed": seed,
        "manual_seed_all": seed,
        "seed": lambda: None,
        "seed_all": lambda: None,
        "default_generators": (torch.default_generator,),
        "get_rng_state": lambda device="cuda": cpu_rng.get_rng_state(),
        "set_rng_state": lambda state, device="cuda": cpu_rng.set_rng_state(state),
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
        "Event": _Event,
        "Stream": _Stream,
        "current_stream": lambda device=None: _Stream(),
        "default_stream": lambda device=None: _Stream(),
        "stream": lambda stream=None: contextlib.nullcontext(),
        "device": lambda device=None: contextlib.nullcontext(),
    }
    for name, value in answers.items():
        _patch(name, value)
    torch.version.cuda = _CUDA_VERSION
    torch.autocast = torch.amp.autocast = _CpuAutocast
    torch.Tensor.cuda = lambda self, device=None, non_blocking=False, **kwargs: self
    torch.nn.Module.cuda = lambda self, device=None: self


_MODE = _CudaToCpu()


def pytest_configure(config):
    del config
    _install_cuda_answers()  # before te_fuser binds torch.amp.autocast (utils.gpu_autocast_ctx)
    from te_fuser import compat

    compat.install_transformer_engine()
    _MODE.__enter__()


def pytest_unconfigure(config):
    del config
    _MODE.__exit__(None, None, None)
