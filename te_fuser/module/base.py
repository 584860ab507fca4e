"""TransformerEngine's `pytorch.module.base` names that TE's tests and clients import: the cuBLAS workspace.

te_fuser's GEMMs (its C GEMM, torch's matmul and _scaled_mm) take no caller-provided workspace: the
buffer exists for code that passes it along (general_gemm's `workspace`), which te_fuser accepts and
leaves untouched.
"""

import torch

_WORKSPACE = {}


def get_cublas_workspace_size_bytes() -> int:
    """TE's cuBLAS workspace size: 32 MiB on compute capability 9.0 or later, else 4 MiB; 0 without CUDA."""
    if not torch.cuda.is_available():
        return 0
    major = torch.cuda.get_device_properties(torch.cuda.current_device()).major
    return 33_554_432 if major >= 9 else 4_194_304


def get_workspace() -> torch.Tensor:
    """The process's uint8 cuBLAS workspace of get_cublas_workspace_size_bytes() bytes on the current CUDA
    device (on the CPU without CUDA: an empty tensor), allocated on the first call and the same tensor after."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    workspace = _WORKSPACE.get(device)
    if workspace is None:
        workspace = torch.empty(get_cublas_workspace_size_bytes(), dtype=torch.uint8, device=device)
        _WORKSPACE[device] = workspace
    return workspace


NUM_CUBLAS_STREAMS = 4  # TE's default number of cuBLAS streams for grouped GEMMs


def get_multi_stream_cublas_workspace() -> list:
    """One get_workspace()-sized buffer per cuBLAS stream of TE's grouped GEMMs (the same list after the first
    call); te_fuser's grouped GEMMs take none either."""
    device = get_workspace().device
    key = ("multi", device)
    if key not in _WORKSPACE:
        _WORKSPACE[key] = [torch.empty(get_cublas_workspace_size_bytes(), dtype=torch.uint8, device=device)
                           for _ in range(NUM_CUBLAS_STREAMS)]
    return _WORKSPACE[key]


__all__ = ["get_cublas_workspace_size_bytes", "get_multi_stream_cublas_workspace", "get_workspace"]
