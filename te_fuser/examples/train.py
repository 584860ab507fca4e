"""Train the example GPT on te_fuser's byte corpus: the main job.

    python -m te_fuser.examples.train                       # one process, CPU or CUDA, FP8 on
    python -m te_fuser.examples.train --no-fp8              # the same in high precision
    python -m te_fuser.examples.train --fp8-weights         # FP8 weights, float32 masters in AdamW
    torchrun --nproc-per-node 2 -m te_fuser.examples.train --tp 2 --sequence-parallel
    torchrun --nproc-per-node 2 -m te_fuser.examples.train --fsdp

Each step accumulates gradients over microbatches, logs losses through
te_fuser.memory.LossLog (detached: no microbatch's graph outlives its
backward), and reports loss, tokens/s and memory (current, peak, retained).
The run ends by writing a PNG of loss and memory over the steps.
"""

import argparse
import contextlib
import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import te_fuser as te
from te_fuser.examples.checkpointing import load_checkpoint, save_checkpoint
from te_fuser.examples.corpus import load_tokens, sample_batch
from te_fuser.examples.gpt import GPT, GPTConfig, Parallel
from te_fuser.examples.master_weights import MasterWeights
from te_fuser.examples.plot import plot_history
from te_fuser.memory import LossLog, MemoryTracker
from te_fuser.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling,
                             NVFP4BlockScaling)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train a small GPT with te_fuser (FP8, fused attention, op fuser).")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--microbatches", type=int, default=2, help="gradient accumulation steps per optimizer step")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per microbatch")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-fp8", action="store_true", help="train in high precision")
    p.add_argument("--recipe", choices=list(RECIPES), default="delayed",
                   help="delayed / current: FP8 per-tensor scaling; mxfp8, block (Float8BlockScaling), nvfp4: "
                        "TE's block-scaled recipes")
    p.add_argument("--fp8-weights", action="store_true",
                   help="build the model under te_fuser.quantized_model_init (FP8 linear weights); AdamW "
                        "steps float32 master copies, cast back to FP8 after each step")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the parameters' dtype")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (launch with torchrun)")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--fsdp", action="store_true", help="shard blocks with FSDP2 fully_shard (data parallel)")
    p.add_argument("--checkpoint-activations", action="store_true")
    p.add_argument("--save", type=Path, help="write a checkpoint here at the end")
    p.add_argument("--resume", type=Path, help="resume from this checkpoint")
    p.add_argument("--plot", default="train_loss_memory.png", help="PNG of loss and memory ('' for none)")
    p.add_argument("--history", type=Path, help="also write the per-step records as JSON here")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may wait for another rank")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def init_distributed(args, device):
    """Joins the torchrun job, if any. Returns (rank, world_size)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        if args.tp > 1 or args.fsdp:
            raise SystemExit("--tp > 1 and --fsdp need several processes: launch with torchrun --nproc-per-node N")
        return 0, 1
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    if args.tp > 1 and world != args.tp:
        raise SystemExit(f"--tp {args.tp} needs exactly {args.tp} processes, got {world}")
    return dist.get_rank(), world


RECIPES = {
    "delayed": lambda: DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max"),
    "current": lambda: Float8CurrentScaling(fp8_format=Format.HYBRID),
    # E4M3 everywhere: HYBRID's E5M2 gradients in 32-element blocks diverge (TE's users found it).
    "mxfp8": lambda: MXFP8BlockScaling(fp8_format=Format.E4M3),
    "block": lambda: Float8BlockScaling(),
    "nvfp4": lambda: NVFP4BlockScaling(),
}


def make_recipe(args):
    return RECIPES[args.recipe]()


def shard_from_full(model, full, rank, tp_size):
    """Copy this rank's slice of every parameter of `full` (a model built without tensor parallelism)."""
    full_params = dict(full.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            src = full_params[name]
            if getattr(p, "tensor_model_parallel", False):
                src = src.chunk(tp_size, dim=p.partition_dim)[rank]
            p.copy_(src)


def sync_replicated_grads(model, group):
    """Sequence parallelism leaves each rank a partial gradient of the replicated parameters: sum them."""
    for p in model.parameters():
        if p.grad is not None and not getattr(p, "tensor_model_parallel", False):
            dist.all_reduce(p.grad, group=group)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device if args.device != "cuda" else f"cuda:{os.environ.get('LOCAL_RANK', '0')}")
    rank, world = init_distributed(args, device)
    try:
        history = train(args, device, rank, world)
        if world > 1:
            # No rank tears its process group down while another still talks to it: gloo's threads
            # can abort the process at exit when a peer leaves mid-teardown.
            dist.barrier()
        return history
    except (RuntimeError, dist.DistError) as err:
        if world == 1:
            raise
        # A dead or failing rank surfaces here as a broken connection or a collective timeout.
        raise RuntimeError(f"rank {rank} of {world}: training stopped because a collective with the other ranks "
                           f"failed (a rank died, raised, or did not answer within --timeout {args.timeout:g} s): "
                           f"{err}") from err
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def gc_frozen():
    """Collects garbage, then moves every object alive into the collector's permanent generation
    (gc.freeze) until the block ends, so collections inside it look only at objects made since.
    At the end, what setup made and the block dropped is collected there and then, before the caller
    tears down its process group, not at some later allocation."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.collect()


def train(args, device, rank, world):
    torch.manual_seed(args.seed)  # same initial weights on every rank
    tp_group = dist.group.WORLD if args.tp > 1 else None
    par = Parallel(tp_group=tp_group, tp_size=args.tp, sequence_parallel=args.sequence_parallel and args.tp > 1)
    cfg = GPTConfig(seq_len=args.seq_len, hidden_size=args.hidden, num_heads=args.heads, num_layers=args.layers,
                    ffn_hidden_size=4 * args.hidden)
    dtype = getattr(torch, args.dtype)
    if args.fp8_weights and (par.tp_size > 1 or args.fsdp or args.save or args.resume):
        raise SystemExit("--fp8-weights runs on one process without --save/--resume in this example")
    # Tensor parallel: the same initial weights as one process would draw, sharded.
    full = GPT(cfg, device=device, dtype=dtype) if par.tp_size > 1 else None
    recipe = make_recipe(args)
    with te.quantized_model_init(enabled=args.fp8_weights, recipe=recipe if args.fp8_weights else None,
                                 preserve_high_precision_init_val=True):
        model = GPT(cfg, par, device=device, dtype=dtype, checkpoint_blocks=args.checkpoint_activations)
    if full is not None:
        shard_from_full(model, full, rank, par.tp_size)
        del full
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # The mesh on the training device: FSDP's default mesh is CUDA's wherever a GPU exists.
        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    masters = MasterWeights(model) if args.fp8_weights else None
    optimizer = torch.optim.AdamW(masters.masters if masters else model.parameters(), lr=args.lr, weight_decay=0.0)
    tokens = load_tokens()
    # Data: tensor-parallel ranks read the same batch; data-parallel (FSDP) ranks read their own.
    gen = torch.Generator().manual_seed(args.seed + 1000 * (rank if args.fsdp else 0))
    start_step = load_checkpoint(args.resume, model, optimizer, gen) if args.resume else 0
    fp8 = not args.no_fp8
    history = []
    progress = None
    if rank == 0 and not args.quiet:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, initial=0, desc="train", unit="step", file=sys.stdout)
    # The trackers collect garbage twice a step; a full collection walks every Python object, about
    # 0.1 s once torch's compiler stack is imported, which was most of this demo's time. Setup's objects
    # stay alive through the run, so they are frozen out of the collections.
    with gc_frozen():
        # Memory is counted from here: "current" is what the run holds beyond the model it started with,
        # "peak" the highest level within a step, "retained" what a step left behind (flat means no leak).
        run_memory = MemoryTracker(device=device).__enter__()
        for step in range(start_step, start_step + args.steps):
            losses = LossLog()
            held_before = run_memory.sample()
            t0 = time.perf_counter()
            with MemoryTracker(device=device) as mem:
                for _ in range(args.microbatches):
                    x, y = sample_batch(tokens, args.batch_size, args.seq_len, gen)
                    x, y = x.to(device), y.to(device)
                    if par.sequence_parallel:
                        y = y.chunk(args.tp, dim=0)[rank]
                    with te.fp8_autocast(enabled=fp8, fp8_recipe=recipe, fp8_group=tp_group):
                        logits = model(x)
                    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                    losses.append(loss)
                    (loss / (args.microbatches * (args.tp if par.sequence_parallel else 1))).backward()
                if par.sequence_parallel:
                    sync_replicated_grads(model, tp_group)
                if masters is not None:
                    masters.grads_from_model()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if masters is not None:
                    masters.cast_back()
            step_loss = losses.mean()
            if par.sequence_parallel:  # each rank saw a slice of the sequence: average the slices
                t = torch.tensor([step_loss])
                dist.all_reduce(t, group=tp_group)
                step_loss = t.item() / args.tp
            seconds = time.perf_counter() - t0
            record = dict(step=step, loss=step_loss, tokens_per_s=args.microbatches * args.batch_size * args.seq_len / seconds,
                          current=run_memory.sample(), peak=held_before + mem.peak_bytes)
            record["retained"] = record["current"] - held_before
            history.append(record)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{step_loss:.3f}")
            if rank == 0:
                (progress.write if progress is not None else print)(f"step {step:4d}  loss {step_loss:.4f}  {record['tokens_per_s']:8.0f} tok/s  "
                               f"mem current {record['current'] / 2**20:7.2f} MiB  peak {record['peak'] / 2**20:7.2f} MiB  "
                               f"retained {record['retained'] / 2**20:+.2f} MiB")
        run_memory.__exit__(None, None, None)
    if progress is not None:
        progress.close()
    if args.save:
        save_checkpoint(args.save, model, optimizer, start_step + args.steps, gen)
    if rank == 0 and args.plot:
        plot_history(history, Path(args.plot), title=f"te_fuser GPT ({'FP8' if fp8 else 'high precision'}, {device.type})")
        print(f"wrote {args.plot}")
    if rank == 0 and args.history:
        args.history.write_text(json.dumps(history))
    return history


if __name__ == "__main__":
    main()
