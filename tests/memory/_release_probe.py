"""Child process of test_release.py: releases a padded buffer, then tries one use of it per child.

usage: python _release_probe.py DEVICE [USE]
Without USE (CPU only) every use runs in a process forked from this one after the release, so
a crash kills that child only. With USE (CUDA, which cannot run in a forked child) this process
runs that one use. Prints one line per use: "<use>\t<outcome>\t<message>", where the outcome
is RAISED <exception type>, RETURNED, or (for forked children) DIED <signal or status>.
"""

import os
import sys

import torch

from te_fuser.kernels import fp8
from te_fuser.memory import release_storage

# Every one touches the released bytes: each must raise RuntimeError naming release_storage.
USES = {
    "sum": "view.sum()",
    "add": "view + 1",
    "clone": "view.clone()",
    "abs": "view.abs()",
    "index": "view[3, 4].item()",
    "index-row": "view[3].tolist()",
    "index-gather": "view[[0, 2]]",
    "index-mask": "view[view > 0]",
    "transpose-copy": "view.t().contiguous()",
    "matmul": "view @ view.t()",
    "tolist": "view.tolist()",
    "item": "view[1, 2].item()",
    "float()": "float(view[0, 0])",
    "cast-fp16": "view.to(torch.float16)",
    "cast-double": "view.double()",
    "numpy": "view.cpu().numpy()",
    "repr": "repr(view)",
    "copy-out": "torch.empty(12, 10, device=view.device).copy_(view)",
    "base-sum": "base.sum()",
    "te_fuser-amax": "fp8.compute_amax(view)",
    "te_fuser-quantize": "fp8.quantize(view, one, torch.zeros(1, device=view.device), torch.float8_e4m3fn)",
    "write-mul_": "view.mul_(2)",
    "write-fill_": "base.fill_(0)",
    "write-setitem": "view.__setitem__(0, 1.0)",
    "write-copy_": "view.copy_(torch.ones(12, 10, device=view.device))",
    "storage-data_ptr": "view.untyped_storage().data_ptr()",
    "storage-resize_": "view.untyped_storage().resize_(520)",
    "storage-tolist": "view.untyped_storage().tolist()",
    "save": "torch.save(view, os.devnull)",
}


def released(device):
    base = torch.randn(130, device=device)
    view = base[:120].view(12, 10)
    release_storage(base)
    return base, view


def run(use, base, view):
    env = {"torch": torch, "fp8": fp8, "os": os, "base": base, "view": view,
           "one": torch.ones(1, device=view.device)}
    try:
        eval(USES[use], env)
        if view.is_cuda:
            torch.cuda.synchronize()
    except Exception as err:  # reported to the test, which checks the type and the message
        return f"RAISED {type(err).__name__}", str(err).splitlines()[0] if str(err) else ""
    return "RETURNED", ""


def report(use, outcome, message):
    print(f"{use}\t{outcome}\t{message}", flush=True)


def forked(use, base, view):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        torch.set_num_threads(1)  # no thread pool inherited from before the fork
        outcome, message = run(use, base, view)
        os.write(write, f"{outcome}\t{message}".encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"DIED signal {os.WTERMSIG(status)}", ""
    if not text:
        return f"DIED status {os.waitstatus_to_exitcode(status)}", ""
    return tuple(text.split("\t", 1))


def main():
    device = sys.argv[1]
    base, view = released(device)
    if len(sys.argv) > 2:
        report(sys.argv[2], *run(sys.argv[2], base, view))
        return
    for use in USES:
        report(use, *forked(use, base, view))


if __name__ == "__main__":
    main()
