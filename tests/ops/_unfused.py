"""What the fusion tests compare with: the same ops run one at a time, and the names in a fuser's plan."""


def run_unfused(model, x, *extra):
    """The same ops, each in a fuser of its own (no fusion can apply)."""
    y, extras = x, list(extra)
    outs = []
    for op in model:
        for basic in getattr(op, "basic_ops", (op,)):
            taken = [extras.pop(0) for _ in range(basic.num_extra_inputs)]
            y = basic(y, *taken)
            if isinstance(y, tuple):
                y, *more = y
                outs.extend(more)
    return (y, *outs) if outs else y


def forward_plan(model):
    """The names of the ops the forward ran (fused ones as one), for a Sequential of one fuser."""
    return [type(op).__name__ for op, _ in model._module_groups[0]._forward_ops]


def backward_plan(model):
    """The same for the backward, last op first (TE's order)."""
    return [type(op).__name__ for op, _ in model._module_groups[0]._backward_ops]
