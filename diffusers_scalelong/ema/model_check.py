"""The model a snapshot header names, checked against the file's tensors before a real one is built.

A snapshot header records ``model_class`` and ``model_config``; the file holds the tensors. A header edited to a
larger config would make ``from_config`` allocate a model far larger than the file (hundreds of KB of snapshot,
GB of weights). So the class is first built on the ``meta`` device (shapes only, no memory for tensors) while the
number of parameters, buffers and submodules it registers is capped by the number of tensors in the file; every
entry of its ``state_dict`` must then be in the file with the same shape, and in the file's ``copied_keys``
exactly when it is not a floating-point parameter (the buffers the tracker copies). A real model built from the
config is then no larger than the file's tensors. The expected layout is cached per (class, config).
"""

from __future__ import annotations

import functools
import importlib
import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

#: Only classes from these packages are instantiated from snapshot metadata.
ALLOWED_MODEL_PACKAGES = ("diffusers", "diffusers_scalelong")
# Registrations allowed per tensor of the file while the meta model is built. A state_dict entry is one
# registered parameter or buffer (non-persistent buffers and re-assignments add a few); the diffusers UNets, EDM2
# UNet and U-ViT register 0.9 to 1.05 submodules per state_dict entry (activations, dropouts, containers).
_REGISTRATIONS_PER_TENSOR = 4
_MODULES_PER_TENSOR = 8
_SLACK = 256


def resolve_model_class(qualified_name: str) -> type:
    """Import a diffusers model class named ``"package.module.ClassName"`` from an allow-listed package."""
    from diffusers import ModelMixin

    if not isinstance(qualified_name, str):
        raise ValueError(f"model class must be a string 'package.module.ClassName', got {qualified_name!r}")
    module_name, _, class_name = qualified_name.rpartition(".")
    if module_name.split(".")[0] not in ALLOWED_MODEL_PACKAGES or not class_name.isidentifier():
        raise ValueError(f"model class {qualified_name!r} is not from an allowed package {ALLOWED_MODEL_PACKAGES}")
    try:
        cls = getattr(importlib.import_module(module_name), class_name, None)
    except ImportError as error:
        raise ValueError(f"cannot import model class {qualified_name!r}: {error}") from None
    if not (isinstance(cls, type) and issubclass(cls, ModelMixin)):
        raise ValueError(f"{qualified_name!r} is not a diffusers ModelMixin class")
    return cls


def check_model_matches(
    model_class: str,
    model_config: Mapping[str, Any] | None,
    shapes: Mapping[str, Sequence[int]],
    copied_keys: Sequence[str],
    where: str,
) -> tuple[str, ...]:
    """Raise ``ValueError`` naming ``where`` unless every tensor of ``model_class(**model_config)`` is in the file
    (``shapes``) with its shape, and is in ``copied_keys`` exactly when it is not a floating-point parameter;
    nothing is allocated for tensors. Returns the file's keys that the class does not build (e.g. LS gates added
    to a plain diffusers UNet with ``apply_lsc``): a model built from the config cannot load those."""
    if not isinstance(model_config, Mapping):
        raise ValueError(f"{where}: model_config must be a JSON object for model class {model_class!r}")
    try:
        config_json = json.dumps(model_config, sort_keys=True)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: model_config is not plain JSON ({error})") from None
    try:
        expected, averaged = _meta_layout(model_class, config_json, len(shapes))
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    file_shapes = {key: tuple(shape) for key, shape in shapes.items()}
    differing = sorted(key for key in expected if expected[key] != file_shapes.get(key))
    if differing:
        key = differing[0]
        raise ValueError(
            f"{where}: its model_config builds a {model_class.rpartition('.')[2]} whose tensors differ from the file's "
            f"({len(differing)} entries differ, e.g. {key!r}: config {expected[key]}, file {file_shapes.get(key)}); "
            "refusing to build it"
        )
    copied = set(copied_keys)
    wrong = sorted(key for key in expected if (key in copied) == (key in averaged))
    if wrong:
        raise ValueError(
            f"{where}: copied_keys do not match the buffers of {model_class.rpartition('.')[2]} "
            f"({len(wrong)} entries differ, e.g. {wrong[0]!r}); the header was edited or the file is damaged"
        )
    return tuple(key for key in file_shapes if key not in expected)


@functools.lru_cache(maxsize=16)
def _meta_layout(
    model_class: str, config_json: str, num_tensors: int
) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
    """State-dict shapes and floating-point parameter names of the class built from the config on ``meta``."""
    cls = resolve_model_class(model_class)
    limit = _REGISTRATIONS_PER_TENSOR * num_tensors + _SLACK
    try:
        with _registration_cap(limit, _MODULES_PER_TENSOR * num_tensors + _SLACK), torch.device("meta"):
            model = cls.from_config(json.loads(config_json))
        state = model.state_dict(keep_vars=True)
    except Exception as error:  # any constructor error: a config this class does not accept
        message = " ".join(str(error).split())
        raise ValueError(f"its model_config does not build a {cls.__name__}: {message}") from None
    shapes = {key: tuple(value.shape) for key, value in state.items()}
    averaged = frozenset(k for k, v in state.items() if isinstance(v, nn.Parameter) and v.is_floating_point())
    return shapes, averaged


class _TooLarge(Exception):
    pass


@contextmanager
def _registration_cap(max_tensors: int, max_modules: int) -> Iterator[None]:
    """Raise inside a constructor (this thread only) once it registers more tensors or submodules than allowed."""
    thread = threading.get_ident()
    counts = {"tensors": 0, "modules": 0}

    def counter(kind: str, limit: int) -> Callable[..., None]:
        def hook(module: nn.Module, name: str, value: Any) -> None:
            if value is None or threading.get_ident() != thread:
                return
            counts[kind] += 1
            if counts[kind] > limit:
                raise _TooLarge(f"it registers more than {limit} {kind}, far more than the file holds")

        return hook

    module_hooks = torch.nn.modules.module
    handles = [
        module_hooks.register_module_parameter_registration_hook(counter("tensors", max_tensors)),
        module_hooks.register_module_buffer_registration_hook(counter("tensors", max_tensors)),
        module_hooks.register_module_module_registration_hook(counter("modules", max_modules)),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
