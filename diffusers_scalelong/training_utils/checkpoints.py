"""Checkpoint folders ``checkpoint-<step>``: discovery, rotation and a compatibility check before resuming."""

import json
import os
import re
import shutil
from pathlib import Path

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
# Config keys that describe where or with what a model was saved, not its architecture.
_NON_ARCHITECTURE_KEYS = {"_class_name", "_diffusers_version", "_name_or_path", "_use_default_values"}


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoint folders in ``output_dir``, oldest (lowest step) first."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), folder / name) for name in os.listdir(folder) if (m := CHECKPOINT_PATTERN.match(name))]
    return [path for _, path in sorted(found) if (path / "training_state.json").is_file()]


def checkpoint_step(path: str | os.PathLike) -> int:
    """The optimisation step encoded in a checkpoint folder's name."""
    match = CHECKPOINT_PATTERN.match(Path(path).name)
    if match is None:
        raise ValueError(f"{str(path)!r} is not a checkpoint folder (expected a name like checkpoint-500)")
    return int(match.group(1))


def resolve_resume_checkpoint(resume: str | None, output_dir: str | os.PathLike) -> Path | None:
    """Turn ``--resume_from_checkpoint`` (``latest``, a folder name or a path) into a checkpoint folder.

    ``latest`` with no checkpoint yet returns ``None`` (start fresh); an explicit folder that does not exist raises.
    """
    if resume is None:
        return None
    if resume == "latest":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_absolute() and not path.exists():
        path = Path(output_dir) / resume
    if not (path / "training_state.json").is_file():
        raise ValueError(f"--resume_from_checkpoint {resume!r}: {str(path)!r} is not a complete checkpoint folder")
    checkpoint_step(path)
    return path


def architecture_config(config: dict) -> dict:
    """A model config without bookkeeping keys, for comparing architectures."""
    return {key: value for key, value in dict(config).items() if key not in _NON_ARCHITECTURE_KEYS}


def check_checkpoint_matches(checkpoint: str | os.PathLike, model_folder: str, model) -> None:
    """Raise ``ValueError`` unless ``checkpoint/model_folder/config.json`` describes the same architecture as ``model``."""
    config_path = Path(checkpoint) / model_folder / "config.json"
    if not config_path.is_file():
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} has no {model_folder}/config.json; it was not written by this script"
        )
    try:
        saved = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(config_path)!r} is not valid JSON: {error}") from error
    expected_class = type(model).__name__
    if saved.get("_class_name") != expected_class:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} holds a {saved.get('_class_name')} model but this run builds a "
            f"{expected_class}; resume with the same model options or use another --output_dir"
        )
    saved, current = architecture_config(saved), architecture_config(json.loads(json.dumps(dict(model.config))))
    differing = sorted(key for key in set(saved) | set(current) if saved.get(key) != current.get(key))
    if differing:
        details = ", ".join(
            f"{key}: checkpoint {saved.get(key)!r} vs now {current.get(key)!r}" for key in differing[:5]
        )
        raise ValueError(f"checkpoint {str(checkpoint)!r} was trained with a different model ({details})")


def rotate_checkpoints(output_dir: str | os.PathLike, total_limit: int | None) -> list[Path]:
    """Delete the oldest complete checkpoints so that at most ``total_limit`` remain; return the deleted folders."""
    if total_limit is None:
        return []
    found = list_checkpoints(output_dir)
    doomed = found[: max(len(found) - total_limit, 0)]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def model_components(module) -> dict:
    """The diffusers models inside a trained module: ``{"unet": ...}`` plus ``"uncertainty"`` for EDM2."""
    if hasattr(module, "unet") and hasattr(module, "uncertainty"):
        components = {"unet": module.unet}
        if module.uncertainty is not None:
            components["uncertainty"] = module.uncertainty
        return components
    return {"unet": module}


def save_components(module, folder: str | os.PathLike) -> None:
    """``save_pretrained`` every component into ``folder/<name>`` (safetensors + config.json)."""
    for name, component in model_components(module).items():
        component.save_pretrained(os.path.join(folder, name))


def load_components(module, folder: str | os.PathLike) -> None:
    """Load every component's weights from ``folder/<name>`` in place (safetensors only)."""
    for name, component in model_components(module).items():
        path = os.path.join(folder, name)
        if not os.path.isdir(path):
            raise ValueError(f"checkpoint {str(folder)!r} has no {name}/ folder")
        loaded = type(component).from_pretrained(path, low_cpu_mem_usage=False)
        component.load_state_dict(loaded.state_dict())


def write_json_atomic(data: dict, path: str | os.PathLike) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def save_checkpoint(accelerator, output_dir: str | os.PathLike, step: int, total_limit: int | None) -> Path:
    """``accelerator.save_state`` into ``checkpoint-<step>`` atomically, then rotate old checkpoints.

    Every process writes its own RNG state into a temporary folder; the main process adds ``training_state.json``,
    swaps the folder into place (replacing one of the same step) and only then deletes the oldest checkpoints.
    """
    output_dir = Path(output_dir)
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".checkpoint-{step}.tmp"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_json_atomic(
            {"global_step": step, "num_processes": accelerator.num_processes}, tmp / "training_state.json"
        )
        old = None
        if final.exists():
            old = output_dir / f".checkpoint-{step}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old)
        rotate_checkpoints(output_dir, total_limit)
    accelerator.wait_for_everyone()
    return final
