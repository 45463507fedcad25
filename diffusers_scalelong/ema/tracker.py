"""``PowerFunctionEMA``: track several power-function EMA profiles of a model during training."""

from __future__ import annotations

import copy
import json
import math
import numbers
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import extract_model_from_parallel
from torch import nn

from ..integrity import load_verified, save_safetensors
from ..validation import check_number_sequence
from .profiles import sigma_rel_to_gamma
from .snapshots import snapshot_filename

STATE_FORMAT = "diffusers_scalelong.PowerFunctionEMA"
STATE_VERSION = 1


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / DataParallel / DeepSpeed / ``torch.compile`` wrappers (no side effects)."""
    if not (hasattr(model, "_orig_mod") or isinstance(getattr(model, "module", None), nn.Module)):
        return model  # fast path: nothing wrapped
    model = extract_model_from_parallel(model, keep_fp32_wrapper=True, keep_torch_compile=False)
    while True:  # nested wrappers, e.g. torch.compile(DDP(model))
        inner = getattr(model, "_orig_mod", None)
        if inner is None and isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            inner = model.module
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def model_class_and_config(model: nn.Module) -> tuple[str | None, dict[str, Any] | None]:
    """``"module.ClassName"`` and the JSON config of a diffusers ``ConfigMixin`` model, else ``(None, None)``."""
    if not hasattr(model, "to_json_string") or not hasattr(model, "config"):
        return None, None
    cls = _unsharded_class(model)
    config = json.loads(model.to_json_string())
    config["_class_name"] = cls.__name__
    return f"{cls.__module__}.{cls.__qualname__}", config


def _unsharded_class(model: nn.Module) -> type:
    """The class of ``model`` before FSDP2's ``fully_shard`` swapped in its subclass ``FSDP<Class>``."""
    if not torch.distributed.is_available():
        return type(model)
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def check_sigma_rels(sigma_rels: Sequence[float]) -> tuple[float, ...]:
    """The profiles to track as floats; ``ValueError`` naming ``sigma_rels`` unless there is at least one, each is
    a valid width (``MIN_SIGMA_REL <= sigma_rel < sqrt(1/12)``) and no two share a snapshot file name (names keep
    at most 6 decimals, so e.g. 0.1234561 and 0.1234562 would overwrite each other's snapshots)."""
    values = check_number_sequence("sigma_rels", sigma_rels)
    if not values:
        raise ValueError("sigma_rels must name at least one profile")
    for index, value in enumerate(values):
        try:
            sigma_rel_to_gamma(value)
        except ValueError as error:
            raise ValueError(f"sigma_rels[{index}]: {error}") from None
    names: dict[str, float] = {}
    for value in values:
        name = snapshot_filename(1, value).removeprefix("phema-0000000001-").removesuffix(".safetensors")
        if name in names:
            same = "are equal" if names[name] == value else f"share the snapshot file name label {name!r}"
            raise ValueError(
                f"sigma_rels {names[name]!r} and {value!r} {same}: their snapshots would overwrite each other; "
                "give distinct values that differ within 6 decimals"
            )
        names[name] = value
    return values


def _check_time(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step <= 0:
        raise ValueError(f"step must be a positive integer time stamp (steps or images), got {step!r}")
    return int(step)


def _live_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's ``state_dict`` entries (parameters and persistent buffers) without detaching copies."""
    return unwrap_model(model).state_dict(keep_vars=True)


class PowerFunctionEMA:
    """Power-function EMA of a model for several ``sigma_rel`` at once (EDM2, arXiv 2312.02696, Eq. 121-127).

    After the training step that ends at time ``t`` (an integer count of steps or images), call
    ``update(model, t)``. Every floating-point parameter ``theta`` is averaged in float32 as

        ema <- beta * ema + (1 - beta) * theta,    beta = (1 - dt / t) ** (gamma + 1),

    where ``dt`` is the time since the previous update, so updating every N steps tracks the same profile
    ``p_t(tau) ~ tau**gamma`` as updating every step (the first update has beta = 0). Buffers and non-float
    parameters are copied. The tracker holds plain tensors, never a module, so an average can never run a
    training-mode forward pass (weight-normalising layers such as EDM2's MPConv would overwrite it).

    Args:
        model: the trained module; Accelerate / DDP / ``torch.compile`` wrappers are unwrapped.
        sigma_rels: relative widths of the tracked profiles, each in [1e-4, sqrt(1/12)), distinct within 6 decimals
            (:func:`check_sigma_rels`).
        device: where the float32 averages live (default: next to each parameter), e.g. ``"cpu"``.
        time_unit: what ``step`` counts (``"steps"`` or ``"images"``), recorded in snapshots.
        run_id: the training run, recorded in every snapshot and in the state (default: a new random id);
            reconstruction refuses snapshots of different runs. Restored by ``load_state_dict``.

    Examples:
        >>> import tempfile
        >>> import torch
        >>> from diffusers_scalelong import PowerFunctionEMA
        >>> model = torch.nn.Linear(2, 1)
        >>> ema = PowerFunctionEMA(model, sigma_rels=(0.05, 0.10))
        >>> for step in range(1, 11):
        ...     with torch.no_grad():
        ...         _ = model.weight.fill_(float(step))  # stands for an optimiser step
        ...     ema.update(model, step)
        >>> averaged = ema.averaged_state_dict(0.10)["weight"]
        >>> bool(1 < averaged[0, 0] < 10)  # an average of the weights 1 ... 10, weighted towards the newest
        True
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     len(ema.save_snapshots(folder, step=10, is_main_process=True))  # one file per profile
        2
    """

    def __init__(
        self,
        model: nn.Module,
        sigma_rels: Sequence[float] = (0.05, 0.10),
        *,
        device: torch.device | str | None = None,
        time_unit: str = "steps",
        run_id: str | None = None,
    ) -> None:
        sigma_rels = check_sigma_rels(sigma_rels)
        self.gammas = tuple(sigma_rel_to_gamma(s) for s in sigma_rels)
        if time_unit not in ("steps", "images"):
            raise ValueError(f"time_unit must be 'steps' or 'images', got {time_unit!r}")
        self.sigma_rels = sigma_rels
        self.time_unit = time_unit
        self.run_id: str | None = run_id if run_id is not None else uuid.uuid4().hex
        self.last_step: int | None = None
        self.num_updates = 0
        self.model_class, self.model_config = model_class_and_config(unwrap_model(model))

        live = _live_tensors(model)
        self.averaged_keys = [k for k, v in live.items() if isinstance(v, nn.Parameter) and v.is_floating_point()]
        self.copied_keys = [k for k in live if k not in set(self.averaged_keys)]

        def new_like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            if _is_sharded(t):  # FSDP2: average the local shard, with the parameter's placement
                return torch.zeros_like(t, dtype=dtype)
            return torch.zeros(t.shape, dtype=dtype, device=device if device is not None else t.device)

        self.averages: list[dict[str, torch.Tensor]] = [
            {k: new_like(live[k], torch.float32) for k in self.averaged_keys} for _ in sigma_rels
        ]
        self.copies: dict[str, torch.Tensor] = {k: new_like(live[k], live[k].dtype) for k in self.copied_keys}

    # ----------------------------------------------------------------------------------------------- tracking
    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """Fold the current weights of ``model`` into every profile; ``step`` is the time after this step."""
        step = _check_time(step)
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"step must increase between updates: got {step} after {self.last_step}")
        live = _live_tensors(model)
        self._check_matches(live)  # validate everything first: a refused update leaves the averages untouched
        for averages, gamma in zip(self.averages, self.gammas, strict=True):
            beta = 0.0 if self.last_step is None else (self.last_step / step) ** (gamma + 1.0)
            targets = list(averages.values())
            sources = [live[k].detach().to(device=t.device, dtype=t.dtype) for k, t in averages.items()]
            if targets:
                torch._foreach_lerp_(targets, sources, 1.0 - beta)
        for k, t in self.copies.items():
            t.copy_(live[k].detach())
        self.last_step = step
        self.num_updates += 1

    def _check_matches(self, live: dict[str, torch.Tensor]) -> None:
        """Raise ``ValueError`` unless ``live`` has exactly the tracked names, each with the tracked shape."""
        tracked = {**self.averages[0], **self.copies} if self.averages else dict(self.copies)
        missing = [k for k in tracked if k not in live]
        extra = [k for k in live if k not in tracked]
        if missing or extra:
            raise ValueError(
                f"model does not match the tracked model (missing keys: {missing[:5]}, unexpected keys: {extra[:5]})"
            )
        wrong = [
            f"{k}: {tuple(live[k].shape)} != {tuple(t.shape)}" for k, t in tracked.items() if live[k].shape != t.shape
        ]
        if wrong:
            raise ValueError(f"model tensors have other shapes than the tracked ones: {'; '.join(wrong[:5])}")

    # -------------------------------------------------------------------------------------- reading averages
    def profile_index(self, sigma_rel: float) -> int:
        """Index of the tracked profile with this ``sigma_rel`` (ValueError if it is not tracked)."""
        for i, s in enumerate(self.sigma_rels):
            if math.isclose(s, float(sigma_rel), rel_tol=1e-9, abs_tol=0.0):
                return i
        raise ValueError(f"sigma_rel {sigma_rel!r} is not tracked; tracked: {list(self.sigma_rels)}")

    def averaged_state_dict(self, sigma_rel: float, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """A model ``state_dict`` with the averaged parameters (cast to ``dtype`` if given) and copied buffers.

        Without ``dtype`` the tensors are the tracker's own: read them, do not modify them in place.
        """
        if self.last_step is None:
            raise ValueError("no update yet: call update(model, step) before reading an average")
        averages = self.averages[self.profile_index(sigma_rel)]
        state = {k: (v.to(dtype) if dtype is not None else v) for k, v in averages.items()}
        state.update(self.copies)
        return state

    @torch.no_grad()
    def copy_to(self, model: nn.Module, sigma_rel: float) -> None:
        """Load the average for ``sigma_rel`` into ``model`` in place (cast to each parameter's dtype/device)."""
        target = unwrap_model(model)
        own = target.state_dict(keep_vars=True)
        self._check_matches(own)  # before the first copy, so a mismatched model is left as it was
        for k, v in self.averaged_state_dict(sigma_rel).items():
            own[k].data.copy_(v.to(device=own[k].device, dtype=own[k].dtype))

    def averaged_model(self, model: nn.Module, sigma_rel: float) -> nn.Module:
        """A deep copy of ``model`` holding the average, in eval mode, without gradients.

        The copy refuses to run a forward pass in training mode, which would let weight-normalising layers
        overwrite the averaged weights.
        """
        averaged = copy.deepcopy(unwrap_model(model))
        self.copy_to(averaged, sigma_rel)
        averaged.eval().requires_grad_(False)
        averaged.register_forward_pre_hook(_refuse_training_forward)
        return averaged

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed for an exact resume: plain tensors and JSON-able values only."""
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "sigma_rels": list(self.sigma_rels),
            "time_unit": self.time_unit,
            "run_id": self.run_id,
            "last_step": self.last_step,
            "num_updates": self.num_updates,
            "averages": [dict(a) for a in self.averages],
            "copies": dict(self.copies),
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; the profiles and the model's keys and shapes must match.

        The run id comes with it (a state written before run ids existed restores ``None``: one unnamed run).
        """
        if state_dict.get("format") != STATE_FORMAT:
            raise ValueError(f"not a {STATE_FORMAT} state dict (format={state_dict.get('format')!r})")
        if [float(s) for s in state_dict["sigma_rels"]] != list(self.sigma_rels):
            raise ValueError(
                f"state dict tracks sigma_rels {state_dict['sigma_rels']}, this tracker {list(self.sigma_rels)}"
            )
        _copy_matching(self.copies, state_dict["copies"], "copies")
        for mine, theirs in zip(self.averages, state_dict["averages"], strict=True):
            _copy_matching(mine, theirs, "averages")
        self.time_unit = state_dict["time_unit"]
        self.run_id = state_dict.get("run_id")
        self.last_step = None if state_dict["last_step"] is None else int(state_dict["last_step"])
        self.num_updates = int(state_dict["num_updates"])

    def save_state(self, path: str | os.PathLike, *, is_main_process: bool = True) -> None:
        """Write ``state_dict()`` as one safetensors file (JSON values in its metadata), atomically.

        A pickle-free alternative to ``accelerator.register_for_checkpointing`` (which loads with pickle); call it
        from ``accelerator.register_save_state_pre_hook`` or next to ``save_state``. The file carries the content
        checksum of its tensors, verified by :meth:`load_state`. Averages of sharded (FSDP2) parameters are
        gathered into full tensors, so every process must call this; only ``is_main_process`` writes. The file is
        the same as an unsharded run's, whatever the number of processes.
        """
        state = self.state_dict()
        tensors = {
            f"averages.{i}.{k}": _gathered(v).detach().cpu()
            for i, a in enumerate(state.pop("averages"))
            for k, v in a.items()
        }
        tensors.update({f"copies.{k}": _gathered(v).detach().cpu() for k, v in state.pop("copies").items()})
        if not is_main_process:
            return
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_safetensors(tensors, path, "state", state)

    def load_state(self, path: str | os.PathLike) -> None:
        """Restore a file written by ``save_state`` (safetensors only, no pickle), its checksum verified.

        With sharded (FSDP2) parameters every process reads the full tensors and keeps its own shards.
        """
        tensors, state = load_verified(path, "state")
        state["averages"] = [
            {k.removeprefix(f"averages.{i}."): v for k, v in tensors.items() if k.startswith(f"averages.{i}.")}
            for i in range(len(state["sigma_rels"]))
        ]
        state["copies"] = {k.removeprefix("copies."): v for k, v in tensors.items() if k.startswith("copies.")}
        self.load_state_dict(state)

    # --------------------------------------------------------------------------------------------- snapshots
    def save_snapshots(
        self,
        folder: str,
        step: int | None = None,
        *,
        dtype: torch.dtype | str | None = None,
        accelerator: Any = None,
        is_main_process: bool | None = None,
    ) -> list[str]:
        """Write every tracked profile at the last update time as a snapshot file (see ``snapshots``).

        ``step`` (optional) must equal the time of the last ``update``. Only the main process writes: pass
        ``accelerator`` or ``is_main_process``. Averages of sharded (FSDP2) parameters are tracked shard by shard
        and gathered here, once per snapshot, so every process must call this. ``dtype`` (``float32``/``float16``/``bfloat16``) sets the
        storage precision. Returns the paths written (empty on other processes).
        """
        from .snapshots import write_snapshot

        if self.last_step is None:
            raise ValueError("no update yet: call update(model, step) before save_snapshots")
        if step is not None and _check_time(step) != self.last_step:
            raise ValueError(
                f"step={step} but the averages are at time {self.last_step}; call update(model, {step}) first"
            )
        if is_main_process is None:
            is_main_process = True if accelerator is None else bool(accelerator.is_main_process)
        # every process gathers sharded averages, once per snapshot
        states = [
            {k: _gathered(t) for k, t in self.averaged_state_dict(sigma_rel).items()} for sigma_rel in self.sigma_rels
        ]
        if not is_main_process:
            return []
        return [
            write_snapshot(
                folder,
                state,
                time=self.last_step,
                sigma_rel=sigma_rel,
                gamma=gamma,
                time_unit=self.time_unit,
                copied_keys=self.copied_keys,
                model_class=self.model_class,
                model_config=self.model_config,
                dtype=dtype,
                run_id=self.run_id,
            )
            for state, sigma_rel, gamma in zip(states, self.sigma_rels, self.gammas, strict=True)
        ]


def _is_sharded(tensor: torch.Tensor) -> bool:
    """A ``DTensor`` (a parameter sharded by FSDP2 / tensor parallelism)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a sharded ``DTensor`` (a collective: every process must call it), else ``tensor``."""
    return tensor.full_tensor() if _is_sharded(tensor) else tensor


def _refuse_training_forward(module: nn.Module, args: Any) -> None:
    if module.training:
        raise RuntimeError(
            "this EMA copy is in training mode; call .eval() before using it (a training-mode forward pass "
            "can overwrite averaged weights in weight-normalising layers)"
        )


def _copy_matching(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], what: str) -> None:
    if set(mine) != set(theirs):
        raise ValueError(
            f"state dict {what} keys differ from the tracked model's: {sorted(set(mine) ^ set(theirs))[:5]}"
        )
    for k, t in mine.items():
        if tuple(theirs[k].shape) != tuple(t.shape):
            raise ValueError(f"state dict {what}[{k!r}] has shape {tuple(theirs[k].shape)}, expected {tuple(t.shape)}")
    for k, t in mine.items():
        source = theirs[k]
        if _is_sharded(t) and not _is_sharded(source):  # a full tensor: keep this process's shard, no communication
            from torch.distributed.tensor import distribute_tensor

            source = distribute_tensor(source.to(t.device), t.device_mesh, t.placements, src_data_rank=None)
        t.copy_(source)
