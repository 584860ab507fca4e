"""Train a small MLP of te_fuser.Linear under fp8_autocast and watch what autograd keeps.

    python -m te_fuser.examples.mlp_demo [--steps 40] [--no-fp8] [--recipe delayed|current]

The MLP learns a fixed random teacher network. Each step prints the loss, the
memory autograd saved for backward during the forward ("saved"), and how much
of it is still alive once backward has returned while the output is still
referenced ("held after backward") -- 0 with te_fuser, which releases every
saved tensor, FP8 buffers included, at the end of backward. On CUDA it also
prints the allocator's peak.
"""

import argparse
import time
import weakref

import torch
import torch.nn.functional as F

import te_fuser
from te_fuser.recipe import DelayedScaling, Float8CurrentScaling


class MLP(torch.nn.Module):
    def __init__(self, width: int, hidden: int, layers: int, device):
        super().__init__()
        dims = [width] + [hidden] * (layers - 1) + [width]

        def init(w):  # unit-scale activations, so the loss is not tiny
            torch.nn.init.normal_(w, std=w.shape[1] ** -0.5)

        self.layers = torch.nn.ModuleList(te_fuser.Linear(a, b, init_method=init, device=device)
                                          for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x, approximate="tanh")
        return x


class SavedTensorMeter:
    """Bytes autograd saves during a forward, and how many of them are alive later."""

    def __init__(self, exclude):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._saved = {}

    def hooks(self):
        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self._exclude and ptr not in self._saved:
                self._saved[ptr] = (weakref.ref(t.untyped_storage()), t.untyped_storage().nbytes())
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def saved_bytes(self):
        return sum(n for _, n in self._saved.values())

    def alive_bytes(self):
        return sum(n for ref, n in self._saved.values() if ref() is not None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--no-fp8", action="store_true")
    parser.add_argument("--recipe", choices=("delayed", "current"), default="delayed")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = MLP(args.width, args.hidden, args.layers, device)
    teacher = MLP(args.width, args.hidden, args.layers, device).requires_grad_(False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    fp8_recipe = DelayedScaling(amax_history_len=16) if args.recipe == "delayed" else Float8CurrentScaling()
    print(f"te_fuser MLP {args.width}->{args.hidden}x{args.layers - 1}->{args.width} on {device}, "
          f"{'high precision' if args.no_fp8 else f'FP8 ({args.recipe} scaling)'}")

    for step in range(1, args.steps + 1):
        x = torch.randn(args.tokens, args.width, device=device)
        with torch.no_grad():
            target = teacher(x)
        meter = SavedTensorMeter(exclude=[x, *model.parameters()])
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with meter.hooks(), te_fuser.fp8_autocast(enabled=not args.no_fp8, fp8_recipe=fp8_recipe):
            out = model(x)
        loss = F.mse_loss(out, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        # `out` and `loss` are still alive here: their graph must hold nothing.
        line = (f"step {step:3d}  loss {loss.item():.5f}  saved {meter.saved_bytes() / 2**20:6.2f} MiB  "
                f"held after backward {meter.alive_bytes() / 2**20:5.2f} MiB  {elapsed * 1e3:7.1f} ms")
        if device.type == "cuda":
            line += f"  peak {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB"
        print(line, flush=True)
        del out, loss


if __name__ == "__main__":
    main()
