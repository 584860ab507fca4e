"""Saving and resuming the example's training: model (FP8 recipe state included), optimizer, data RNG.

A corrupt file, or one written for another model, gets an error that names what differs.
"""

from pathlib import Path

import torch
import torch.distributed as dist

FORMAT = "te_fuser-train-checkpoint-v1"


def _rank_path(path: Path) -> Path:
    if dist.is_initialized() and dist.get_world_size() > 1:
        return path.with_name(f"{path.stem}.rank{dist.get_rank()}{path.suffix}")
    return path


def save_checkpoint(path: Path, model, optimizer, step: int, generator: torch.Generator) -> None:
    state = dict(format=FORMAT, step=step, model=model.state_dict(), optimizer=optimizer.state_dict(),
                 data_rng=generator.get_state(), config=repr(getattr(model, "cfg", None)))
    torch.save(state, _rank_path(path))


def load_checkpoint(path: Path, model, optimizer, generator: torch.Generator) -> int:
    """Restores everything in place and returns the step to continue from."""
    path = _rank_path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise
    except Exception as err:
        raise RuntimeError(f"{path} is not a readable te_fuser checkpoint (corrupt or truncated?): {err}") from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise RuntimeError(f"{path} is not a te_fuser training checkpoint (format {state.get('format') if isinstance(state, dict) else type(state).__name__!r}, expected {FORMAT!r})")
    expected_config = repr(getattr(model, "cfg", None))
    if state["config"] != expected_config:
        raise ValueError(f"{path} was written for model config {state['config']}, this run builds {expected_config}")
    _check_state_dict(path, model.state_dict(), state["model"])
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    generator.set_state(state["data_rng"])
    return int(state["step"])


def _check_state_dict(path, mine: dict, theirs: dict) -> None:
    missing = sorted(set(mine) - set(theirs))
    unexpected = sorted(set(theirs) - set(mine))
    if missing or unexpected:
        raise ValueError(f"{path} does not match the model: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}")
    for key, value in mine.items():
        if key.endswith("_extra_state"):
            continue  # serialized FP8 metadata (TE's uint8 format): its size depends on the state it holds
        other = theirs[key]
        if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor) and value.shape != other.shape:
            raise ValueError(f"{path}: '{key}' has shape {tuple(other.shape)} in the checkpoint, "
                             f"{tuple(value.shape)} in the model")
