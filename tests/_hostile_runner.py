"""Child process of ``test_hostile_pickles``: feed hostile files to the converters, then check the process.

Usage: ``python _hostile_runner.py JOB.json``. The job names the benign references (an EDM2 network pickle and a
U-ViT checkpoint with its head count), a scratch folder and the hostile files (``name -> path``). Once its
imports are done the runner limits its address space to what it has mapped plus ``headroom`` bytes, and converts
both references: the result of a fresh process. Then for each hostile file it calls the command-line converter
in this process and records its exit status and stderr, whether anything was written, whether any allow-listed
class, function, module attribute or numpy dtype changed, and the digest of converting the reference of the same
kind (network pickle or checkpoint) again; both references are converted once more at the end. It prints one JSON
object.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import resource
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch._utils
import torch.storage

from diffusers_scalelong.convert import pickle_vm, safe_pickle
from diffusers_scalelong.convert.cli import edm2_main, uvit_main
from diffusers_scalelong.convert.edm2_official import networks_from_pickle, read_edm2_pickle
from diffusers_scalelong.convert.uvit_official import uvit_from_official

_MODULES = [torch, torch._utils, torch.storage, torch.nn, collections, np, np._core.multiarray, safe_pickle, pickle_vm]
_TARGETS = [
    torch._utils._rebuild_tensor_v2, torch._utils._rebuild_parameter, torch.storage._load_from_bytes,
    torch.Tensor, torch.storage.UntypedStorage, torch.storage.TypedStorage, torch.nn.ModuleDict, torch.nn.ModuleList,
    torch.nn.Sequential, torch.nn.Module, torch.nn.Parameter, collections.OrderedDict, np.ndarray, np.dtype,
    np._core.multiarray._reconstruct, np._core.multiarray.scalar, bytearray, object, dict, list,
]  # fmt: skip


def _fingerprint(obj: Any) -> Any:
    """Identity of ``obj`` and of everything in its ``__dict__`` (and a function's defaults and code)."""
    entries = {name: id(value) for name, value in vars(obj).items()} if hasattr(obj, "__dict__") else None
    if isinstance(obj, types.FunctionType):
        return id(obj), entries, id(obj.__code__), repr(obj.__defaults__), repr(obj.__kwdefaults__)
    return id(obj), entries


def process_state() -> str:
    """A digest of what a hostile file could try to change: module namespaces, classes, functions, dtypes."""
    state = [sorted((name, id(value)) for name, value in vars(module).items()) for module in _MODULES]
    targets = _TARGETS + [value for module in (safe_pickle, pickle_vm) for value in vars(module).values()]
    state += [_fingerprint(target) for target in targets if isinstance(target, type | types.FunctionType)]
    state += [repr(token) for token in (*safe_pickle._STORAGE_TYPES.values(), safe_pickle._NDARRAY)]
    state += [(code, np.dtype(code).str, np.dtype(code).byteorder) for code in safe_pickle.NUMPY_CODES]
    return hashlib.sha256(repr(state).encode()).hexdigest()


def _tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().reshape(-1)
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def benign_digest(job: dict[str, Any], kind: str) -> str:
    """Digest of the converted tensors of the benign reference of ``kind`` ("edm2" or "uvit")."""
    if kind == "uvit":
        return _tensor_digest(uvit_from_official(job["uvit"], job["uvit_heads"]).state_dict())
    unet, uncertainty, sigma_data = networks_from_pickle(read_edm2_pickle(job["edm2"]).network)
    edm2 = {**unet.state_dict(), **{f"u.{k}": v for k, v in uncertainty.state_dict().items()}}
    edm2["sigma_data"] = torch.tensor(sigma_data, dtype=torch.float64)
    return _tensor_digest(edm2)


def limit_address_space(headroom: int) -> int:
    """Cap this process's address space (``RLIMIT_AS``) at its current size plus ``headroom``; returns the cap."""
    mapped = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + headroom, mapped + headroom))
    return mapped + headroom


def run_command(name: str, path: Path, job: dict[str, Any]) -> dict[str, Any]:
    out = Path(job["scratch"]) / name
    argv = [str(path), "--output_dir", str(out)]
    main = edm2_main if path.suffix == ".pkl" else uvit_main
    argv += [] if path.suffix == ".pkl" else ["--num_heads", str(job["uvit_heads"])]
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            status = main(argv)
        except SystemExit as error:
            status = error.code
        except BaseException as error:  # recorded, not raised: the test reports it with the file's name
            status = f"{type(error).__name__}: {error}"
    leftovers = sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{name}"))
    return {"status": status, "stderr": stderr.getvalue(), "written": out.exists() or bool(leftovers)}


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    Path(job["scratch"]).mkdir(parents=True, exist_ok=True)
    cap = limit_address_space(job["headroom"])
    state = process_state()
    reference = {kind: benign_digest(job, kind) for kind in ("edm2", "uvit")}
    results = {}
    for name, path in job["hostile"].items():
        result = run_command(name, Path(path), job)
        result["process_unchanged"] = process_state() == state
        kind = "edm2" if Path(path).suffix == ".pkl" else "uvit"
        result["benign_unchanged"] = benign_digest(job, kind) == reference[kind]
        results[name] = result
    final = {kind: benign_digest(job, kind) for kind in ("edm2", "uvit")}
    print(json.dumps({"reference": reference, "final": final, "results": results, "address_space_cap": cap}))


if __name__ == "__main__":
    main()
