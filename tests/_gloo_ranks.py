"""Run test cases on gloo ranks in spawned processes; the test fails with every rank's traceback.

A case is a tuple (function, *args); function(rank, *args) runs on every rank, in the order given,
with the process group initialized (gloo, one thread per rank). A case that raises is reported and
the others still run; a crashed rank (its collectives left the others waiting) fails the test too.
"""

import os
import queue
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _cpu_default import build_modules_on_cpu


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, cases, errors):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    build_modules_on_cpu()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for function, *args in cases:
            try:
                function(rank, *args)
            except Exception:  # reported to the parent, which fails the test
                errors.put((rank, function.__name__, tuple(args), traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _drain(errors, failures) -> None:
    while True:
        try:
            failures.append(errors.get_nowait())
        except queue.Empty:
            return


def run_cases(cases, world: int = 2) -> None:
    errors = mp.get_context("spawn").Queue()
    crash = None
    failures = []
    ranks = mp.start_processes(_worker, args=(world, free_port(), list(cases), errors), nprocs=world, join=False,
                               start_method="spawn")
    try:
        # Read the failures while the ranks run: a rank does not exit before the pipe took all it put.
        while not ranks.join(timeout=0.5):
            _drain(errors, failures)
    except mp.ProcessExitedException as exc:
        crash = exc
    _drain(errors, failures)
    assert not failures and crash is None, (f"{crash}\n" if crash else "") + "\n".join(
        f"rank {rank} {name}{args}:\n{tb}" for rank, name, args, tb in failures)
