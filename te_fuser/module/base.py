"""TransformerEngine's `pytorch.module.base` names that TE's tests and clients import: the cuBLAS workspace
and TransformerEngineBaseModule.

te_fuser's GEMMs (its C GEMM, torch's matmul and _scaled_mm) take no caller-provided workspace: the
buffer exists for code that passes it along (general_gemm's `workspace`), which te_fuser accepts and
leaves untouched.
"""

import contextlib
import warnings

import torch

from ..quantization import FP8GlobalStateManager, DelayedScalingState, make_recipe_state
from ..recipe import DelayedScaling
from ..tensor import QuantizedTensor
from ._extra_state import _decode, read_te_state, te_state_payload

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


# TE's recipe-state slots per GEMM: input, weight, output forward; grad_output, grad_input backward.
_SLOTS = {True: 3, False: 2}


def state_quantizers(state) -> list:
    """The quantizers of a recipe state, one per slot, without marking it for a scale update."""
    if isinstance(state, DelayedScalingState):
        count = state.amax.numel()
    else:
        count = state.num_quantizers
    return [state.quantizer(i) for i in range(count)]


def _recipe_kind_changed(previous, recipe) -> bool:
    return not (isinstance(previous, type(recipe)) or isinstance(recipe, type(previous)))


def warn_on_recipe_change(module) -> None:
    """TE's warnings when a module's FP8 state is about to follow another recipe: of another kind ("Recipe
    type changed"), or, for FP8 weights, a delayed-scaling history of another length ("Quantizer is being
    updated"). te_fuser's ops then remake their state, as TE's modules do. Called by te_fuser's linear
    modules at the start of their forward."""
    if torch.compiler.is_compiling() or not FP8GlobalStateManager.is_fp8_enabled():
        return  # (a diagnostic: not traced)
    recipe = FP8GlobalStateManager.get_fp8_recipe()
    for op in module.__dict__.get("_ops", ()):
        previous = getattr(op, "_fp8_recipe", None)
        if previous is None or previous is recipe:
            continue
        if _recipe_kind_changed(previous, recipe):
            warnings.warn(f"Recipe type changed from {type(previous).__name__} to {type(recipe).__name__}. "
                          "This may affect model behavior.")
            return
        if (isinstance(recipe, DelayedScaling) and previous.amax_history_len != recipe.amax_history_len
                and any(isinstance(p, QuantizedTensor) for p in module.parameters())):
            warnings.warn("Quantizer is being updated, this may affect model behavior "
                          f"(amax_history_len {previous.amax_history_len} -> {recipe.amax_history_len})")
            return


def check_weight_recipes(module) -> None:
    """TE's check at the start of a module's forward inside fp8_autocast (or calibration): a quantized weight
    (quantized_model_init) runs only under the recipe class of the quantizer that made it
    (`_get_compatible_recipe()`: a Float8Tensor's delayed- or current-scaling quantizer tells which); any
    other recipe, a CustomRecipe included (as in TE), is a RuntimeError naming the weight, raised before
    anything is computed. A weight without a quantizer is not checked. Outside fp8_autocast a quantized
    weight is used dequantized, unchecked, as in TE."""
    if not (FP8GlobalStateManager.is_fp8_enabled() or FP8GlobalStateManager.is_fp8_calibration()):
        return
    recipe = FP8GlobalStateManager.get_fp8_recipe()
    for name, param in module._parameters.items():
        quantizer = getattr(param, "_quantizer", None) if isinstance(param, QuantizedTensor) else None
        compatible = quantizer._get_compatible_recipe() if quantizer is not None else None
        if compatible is not None and not isinstance(recipe, compatible):
            raise RuntimeError(
                f"Recipe mismatch for '{name}': this {type(param).__name__} weight of te_fuser."
                f"{type(module).__name__} was quantized for {compatible.__name__}, but fp8_autocast runs "
                f"{type(recipe).__name__}; build the module under quantized_model_init with the recipe it runs "
                "under, or run it under the weight's")


class TransformerEngineBaseModule(torch.nn.Module):
    """TE's base class of modules with FP8 GEMMs: te_fuser's Linear, LayerNormLinear, LayerNormMLP and
    GroupedLinear derive from it, and so can a user's module that runs its own GEMMs.

    A user's subclass gets TE's FP8 bookkeeping: `with self.prepare_forward(inp, num_gemms=n) as inp:` in
    forward reads the fp8_autocast state (`fp8`, `fp8_calibration`, `fp8_meta["recipe"]`), makes the recipe
    states `fp8_meta["scaling_fwd"]` / `["scaling_bwd"]` with TE's slots (3 per GEMM forward, 2 backward) and
    their quantizers `quantizers["scaling_fwd"]` / `["scaling_bwd"]`, and marks delayed-scaling states for
    the update at the outermost fp8_autocast exit. get_extra_state / set_extra_state use TE's format.

    te_fuser's own modules keep their FP8 state on their ops: their `fp8_meta` and `quantizers` (those of
    every FP8 op, in op order) are views of it (the same state objects), made on each access
    (`_fp8_state_is_a_view`).
    """

    _fp8_state_is_a_view = False

    def __init__(self) -> None:
        super().__init__()
        self.name = None
        self.tp_group = None
        self.tp_size = 1
        self.sequence_parallel = False
        if self._fp8_state_is_a_view:
            return
        # A user's subclass: the state prepare_forward keeps (te_fuser's modules keep theirs on their ops).
        self.fp8 = False
        self.fp8_calibration = False
        self.fp8_parameters = False
        self.fp8_initialized = False
        self.fp8_meta_tensors_initialized = False
        self.activation_dtype = None
        self.fp8_meta = {"fp8_checkpoint": False, "fp8_group": None}
        self.quantizers = {"scaling_fwd": [], "scaling_bwd": []}

    def __getattr__(self, name: str):
        if name == "quantizers" and self._fp8_state_is_a_view:  # every FP8 op's, in op order
            quantizers = {"scaling_fwd": [], "scaling_bwd": []}
            for op in self.__dict__["_ops"]:
                states = getattr(op, "_fp8_states", None)
                if states is not None:
                    quantizers["scaling_fwd"] += state_quantizers(states[0])
                    quantizers["scaling_bwd"] += state_quantizers(states[1])
            return quantizers
        return super().__getattr__(name)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must define forward")

    def _check_own_state(self, method: str) -> None:
        if self._fp8_state_is_a_view:
            raise TypeError(f"te_fuser.{type(self).__name__}.{method}: te_fuser's modules make their FP8 state "
                            "from the fp8_autocast recipe in their forward; this is for modules that run their "
                            "own GEMMs")

    # -- recipe states ----------------------------------------------------------------------------
    def _state_device(self) -> torch.device:
        for tensor in self.parameters():
            if tensor.device.type != "meta":
                return tensor.device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def set_meta_tensor(self, fwd: bool, recipe) -> None:
        """Make the forward (fwd=True) or backward recipe state of `recipe` and its quantizers, unless one of
        the recipe's kind is there already (a delayed-scaling one then takes the recipe's history length)."""
        self._check_own_state("set_meta_tensor")
        key = FP8GlobalStateManager.get_meta_tensor_key(forward=fwd)
        current = self.fp8_meta.get(key)
        count = self.fp8_meta.get("num_gemms", 1) * _SLOTS[bool(fwd)]
        if (self.fp8_meta_tensors_initialized and current is not None and type(current.recipe) is type(recipe)
                and current.recipe.fp8_format == recipe.fp8_format and len(state_quantizers(current)) == count):
            if isinstance(recipe, DelayedScaling):
                current.recipe = recipe  # the scale update follows the recipe in use, as in TE
                self.adjust_amax_history_length(recipe.amax_history_len, fwd=fwd)
            return
        state = make_recipe_state(recipe, count, forward=bool(fwd), device=self._state_device())
        self.fp8_meta[key] = state
        self.quantizers[key] = state_quantizers(state)

    def init_fp8_meta_tensors(self, recipe) -> None:
        self.set_meta_tensor(True, recipe)
        self.set_meta_tensor(False, recipe)
        self.fp8_meta_tensors_initialized = True

    def _delayed_states(self, fwd=None):
        keys = ("scaling_fwd", "scaling_bwd") if fwd is None else (FP8GlobalStateManager.get_meta_tensor_key(fwd),)
        return [(key, self.fp8_meta[key]) for key in keys
                if isinstance(self.fp8_meta.get(key), DelayedScalingState)]

    def adjust_amax_history_length(self, length: int, fwd=None) -> None:
        """Delayed scaling: give the state(s) a history of `length` rows, keeping the first rows and the
        scales (new tensors, as in TE: the old ones are no longer the state's)."""
        self._check_own_state("adjust_amax_history_length")
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"length must be a positive int, got {length!r}")
        for key, state in self._delayed_states(fwd):
            old = state.amax_history
            if old.shape[0] == length:
                continue
            recipe = DelayedScaling(**{**{f: getattr(state.recipe, f) for f in state.recipe.__dataclass_fields__},
                                       "amax_history_len": length})
            new = make_recipe_state(recipe, old.shape[1], forward=state.forward, device=old.device)
            rows = min(length, old.shape[0])
            with torch.no_grad():
                new.amax_history[:rows].copy_(old[:rows])
                new.scale.copy_(state.scale)
                new.scale_inv.copy_(state.scale_inv)
            self.fp8_meta[key] = new
            self.quantizers[key] = state_quantizers(new)

    def get_fp8_meta_tensors(self):
        """Copies of the delayed-scaling scales and histories, {"scaling_fwd": [scale, amax_history], ...};
        None before both states exist."""
        states = dict(self._delayed_states())
        if len(states) != 2:
            return None
        with torch.no_grad():
            return {key: [state.scale.clone(), state.amax_history.clone()] for key, state in states.items()}

    def reset_fp8_meta_tensors(self, fp8_meta_tensors=None) -> None:
        """Scales back to 1 and histories to 0 in place, or to get_fp8_meta_tensors()'s copies."""
        with torch.no_grad():
            for key, state in self._delayed_states():
                if fp8_meta_tensors is None:
                    state.scale.fill_(1.0)
                    state.amax_history.zero_()
                else:
                    if key not in fp8_meta_tensors:
                        raise KeyError(f"fp8_meta_tensors has no {key!r}")
                    state.scale.copy_(fp8_meta_tensors[key][0])
                    state.amax_history.copy_(fp8_meta_tensors[key][1])
                state.scale_inv.copy_(torch.reciprocal(state.scale))

    # -- forward --------------------------------------------------------------------------------
    def set_activation_dtype(self, inp: torch.Tensor) -> None:
        """The dtype GEMMs run in: torch.autocast's when it is on, else the input's (which the
        parameters must share)."""
        if torch.is_autocast_enabled(inp.device.type):
            self.activation_dtype = torch.get_autocast_dtype(inp.device.type)
            return
        for name, param in self.named_parameters():
            if param.dtype != inp.dtype:
                raise TypeError(f"{type(self).__name__}: input dtype {inp.dtype} differs from parameter "
                                f"{name!r}'s {param.dtype} outside torch.autocast")
        self.activation_dtype = inp.dtype

    def set_tensor_parallel_group(self, tp_group) -> None:
        self.tp_group = tp_group
        self.tp_group_initialized = True

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """Read the fp8_autocast state; inside an enabled (or calibrating) one, make the recipe states for
        `num_gemms` GEMMs with its recipe. A recipe of another kind than before warns and replaces them."""
        self._check_own_state("init_fp8_metadata")
        previous = self.fp8_meta.get("recipe")
        self.fp8_parameters = FP8GlobalStateManager.with_fp8_parameters()
        self.fp8 = FP8GlobalStateManager.is_fp8_enabled()
        self.fp8_calibration = FP8GlobalStateManager.is_fp8_calibration()
        enabled = self.fp8 or self.fp8_calibration
        self.fp8_meta["fp8_checkpoint"] = enabled
        if not (enabled or self.fp8_parameters):
            self.fp8_initialized = False
            return
        recipe = FP8GlobalStateManager.get_fp8_recipe()
        if self.fp8_initialized and recipe == previous and self.fp8_meta.get("num_gemms") == num_gemms:
            return
        self.fp8_meta["recipe"] = recipe
        self.fp8_meta["num_gemms"] = num_gemms
        if previous is not None and _recipe_kind_changed(previous, recipe):
            warnings.warn(f"Recipe type changed from {type(previous).__name__} to {type(recipe).__name__}. "
                          "This may affect model behavior.")
            self.fp8_meta_tensors_initialized = False
        if enabled:
            self.fp8_meta["fp8_group"] = FP8GlobalStateManager.get_fp8_group()
            self.fp8_meta["fp8_max_fwd"] = recipe.fp8_format.max_fwd
            self.fp8_meta["fp8_max_bwd"] = recipe.fp8_format.max_bwd
        self.init_fp8_meta_tensors(recipe)
        self.fp8_initialized = enabled

    @contextlib.contextmanager
    def prepare_forward(self, inp: torch.Tensor, num_gemms: int = 1, allow_non_contiguous: bool = False):
        """Around a subclass's forward: sets activation_dtype, the FP8 state (init_fp8_metadata), marks
        delayed-scaling states for their update, and yields the input made contiguous unless allowed not."""
        self._check_own_state("prepare_forward")
        self.set_activation_dtype(inp)
        self.init_fp8_metadata(num_gemms=num_gemms)
        if self.fp8:
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(self.fp8_meta)
        yield inp if allow_non_contiguous else inp.contiguous()

    # -- state_dict -------------------------------------------------------------------------------
    def get_extra_state(self) -> torch.Tensor:
        """TE's format: a uint8 tensor of the delayed-scaling state in TE's slots, empty without one."""
        states = dict(self._delayed_states())
        if len(states) != 2 or not (self.fp8_meta["fp8_checkpoint"] or self.fp8 or self.fp8_calibration):
            return torch.empty(0, dtype=torch.uint8)
        fwd, bwd = states["scaling_fwd"], states["scaling_bwd"]
        return te_state_payload(fwd.recipe, self.fp8_meta["num_gemms"], fwd.scale.cpu(), fwd.amax_history.cpu(),
                                bwd.scale.cpu(), bwd.amax_history.cpu())

    def set_extra_state(self, state) -> None:
        """Load TE's `_extra_state` (any of TE's formats; read without unpickling code)."""
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        num_gemms = self.fp8_meta.get("num_gemms")
        if num_gemms is None:  # not run yet: TE's payload says how many GEMMs it holds
            num_gemms = self._num_gemms_in(state)
        slots = read_te_state(state, num_gemms)
        if slots is None:
            return
        self.fp8_meta.update(num_gemms=num_gemms, recipe=slots.recipe, fp8_checkpoint=True)
        self.init_fp8_meta_tensors(slots.recipe)
        with torch.no_grad():
            for key, scale, history in (("scaling_fwd", slots.scale_fwd, slots.amax_history_fwd),
                                        ("scaling_bwd", slots.scale_bwd, slots.amax_history_bwd)):
                target = self.fp8_meta[key]
                target.scale.copy_(scale)
                target.amax_history.copy_(history)
                target.scale_inv.copy_(torch.reciprocal(target.scale))

    @staticmethod
    def _num_gemms_in(state) -> int:
        payload = _decode(state) if isinstance(state, torch.Tensor) else None
        scale = payload.get("scale_fwd") if isinstance(payload, dict) else None
        if not isinstance(scale, torch.Tensor) or scale.numel() % _SLOTS[True]:
            raise ValueError("_extra_state: cannot tell how many GEMMs it holds (no scale_fwd of 3 per GEMM)")
        return scale.numel() // _SLOTS[True]


__all__ = ["TransformerEngineBaseModule", "get_cublas_workspace_size_bytes", "get_multi_stream_cublas_workspace",
           "get_workspace"]
