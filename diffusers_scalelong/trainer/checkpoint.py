"""Resumable checkpoint folders ``<output_dir>/checkpoint-<step>``: one type that owns their layout.

A checkpoint folder holds what ``accelerate.Accelerator.save_state`` writes (optimiser, lr scheduler, data
sampler states), the trained models as diffusers folders (``unet/``, and for EDM2 the preconditioner's layout:
``unet/``, ``uncertainty/``, ``preconditioner_config.json``), each process's private RNG state, the EMA state and,
written last, ``training_state.json``: a folder without it is incomplete. The record holds ``global_step``,
``num_processes``, ``distributed_type`` (``ddp`` or ``fsdp``: how the optimiser state is keyed), ``run_id`` (the
training run that wrote it) and ``files``, the SHA-256 of every other file in the folder; :meth:`Checkpoint.verify`
checks all of them before a resume (records written before ``run_id`` and ``files`` existed are read unverified).
"""

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ..atomic import atomic_write_text, replace_path
from ..edm2.precond import EDMPreconditioner
from ..integrity import folder_manifest, verify_manifest

logger = logging.getLogger(__name__)

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "training_state.json"
# Config keys that describe where or with what a model was saved, not its architecture.
_NON_ARCHITECTURE_KEYS = {"_class_name", "_diffusers_version", "_name_or_path", "_use_default_values", "auto_map"}


def checkpoint_step(path: str | os.PathLike) -> int:
    """The optimisation step encoded in a checkpoint folder's name."""
    match = CHECKPOINT_PATTERN.match(Path(path).name)
    if match is None:
        raise ValueError(f"{str(path)!r} is not a checkpoint folder (expected a name like checkpoint-500)")
    return int(match.group(1))


def architecture_config(config: dict) -> dict:
    """A model config without bookkeeping keys, for comparing architectures."""
    return {key: value for key, value in dict(config).items() if key not in _NON_ARCHITECTURE_KEYS}


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, quota); nothing half-written is left."""


# torch.save reports a failed write of its zip container as a RuntimeError of its C++ stream, with these words
_TORCH_WRITE_FAILURES = ("iostream error", "PytorchStreamWriter failed", "unexpected pos")


def _is_write_failure(error: BaseException) -> bool:
    """Whether ``error`` (or one it arose from) is a failed file write rather than a bug."""
    while error is not None:
        if isinstance(error, OSError) or any(words in str(error) for words in _TORCH_WRITE_FAILURES):
            return True
        error = error.__context__
    return False


@dataclass(frozen=True)
class Checkpoint:
    """The checkpoint folder ``path`` (named ``checkpoint-<step>``)."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        checkpoint_step(self.path)

    @classmethod
    def at(cls, output_dir: str | os.PathLike, step: int) -> "Checkpoint":
        return cls(Path(output_dir) / f"checkpoint-{step}")

    @property
    def step(self) -> int:
        return checkpoint_step(self.path)

    @property
    def is_complete(self) -> bool:
        return (self.path / STATE_FILE).is_file()

    def __str__(self) -> str:
        return str(self.path)

    # ------------------------------------------------------------------------------------------ discovery
    @staticmethod
    def find_all(output_dir: str | os.PathLike) -> list["Checkpoint"]:
        """Complete checkpoints in ``output_dir``, oldest (lowest step) first."""
        folder = Path(output_dir)
        if not folder.is_dir():
            return []
        found = [Checkpoint(folder / name) for name in os.listdir(folder) if CHECKPOINT_PATTERN.match(name)]
        return sorted((c for c in found if c.is_complete), key=lambda checkpoint: checkpoint.step)

    @classmethod
    def resolve(cls, resume: str | None, output_dir: str | os.PathLike) -> "Checkpoint | None":
        """Turn ``resume_from_checkpoint`` (``latest``, a folder name or a path) into a checkpoint.

        ``latest`` with no checkpoint yet returns ``None`` (start fresh); an explicit folder that does not exist or is
        incomplete raises ``ValueError``.
        """
        if resume is None:
            return None
        if resume == "latest":
            return cls.newest_intact(output_dir)
        path = Path(resume)
        if not path.is_absolute() and not path.exists():
            path = Path(output_dir) / resume
        if not (path / STATE_FILE).is_file():
            raise ValueError(f"resume_from_checkpoint {resume!r}: {str(path)!r} is not a complete checkpoint folder")
        checkpoint = cls(path)
        try:
            checkpoint.verify()
        except ValueError as error:
            raise ValueError(f"resume_from_checkpoint {resume!r}: {error}") from None
        return checkpoint

    @classmethod
    def newest_intact(cls, output_dir: str | os.PathLike) -> "Checkpoint | None":
        """The newest complete checkpoint that passes :meth:`verify`, logging each newer damaged one and why.

        ``None`` when there is no checkpoint; raises ``ValueError`` naming the damage when every one is damaged.
        """
        found = cls.find_all(output_dir)
        damage = []
        for checkpoint in reversed(found):
            try:
                checkpoint.verify()
            except ValueError as error:
                damage.append(str(error))
                logger.warning("skipping damaged checkpoint %s: %s", checkpoint, error)
                continue
            if damage:
                logger.warning("resuming from %s, the newest intact checkpoint", checkpoint)
            return checkpoint
        if damage:
            raise ValueError(f"every checkpoint in {str(output_dir)!r} is damaged: " + "; ".join(damage))
        return None

    @classmethod
    def rotate(cls, output_dir: str | os.PathLike, total_limit: int | None) -> list["Checkpoint"]:
        """Delete the oldest complete checkpoints so that at most ``total_limit`` remain; return the deleted ones."""
        if total_limit is None:
            return []
        found = cls.find_all(output_dir)
        doomed = found[: max(len(found) - total_limit, 0)]
        for checkpoint in doomed:
            shutil.rmtree(checkpoint.path)
        return doomed

    # ------------------------------------------------------------------------------------------ contents
    def read_state(self) -> dict:
        """``training_state.json``, cross-checked against the folder name.

        Returns ``{"global_step", "num_processes", "distributed_type", "run_id", "files"}``; ``run_id`` and
        ``files`` are ``None`` in records written before they existed, ``distributed_type`` is then ``ddp``. The file
        is read once per ``Checkpoint`` (a resume asks several times: run identity, verification, the trainer).
        """
        if "_state" not in self.__dict__:
            object.__setattr__(self, "_state", self._read_state())
        return dict(self.__dict__["_state"])

    def _read_state(self) -> dict:
        path = self.path / STATE_FILE
        try:
            state = json.loads(path.read_text())
            step, processes = int(state["global_step"]), int(state["num_processes"])
            run_id, files = state.get("run_id"), state.get("files")
            distributed_type = state.get("distributed_type", "ddp")
            if distributed_type not in ("ddp", "fsdp"):
                raise ValueError(f"distributed_type must be 'ddp' or 'fsdp', got {distributed_type!r}")
            if not (run_id is None or isinstance(run_id, str)):
                raise TypeError(f"run_id must be a string, got {run_id!r}")
            if not (files is None or (isinstance(files, dict) and all(isinstance(v, str) for v in files.values()))):
                raise TypeError("files must map file names to SHA-256 strings")
        except (OSError, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{str(path)!r} is not a valid training state: {error!r}") from None
        if step != self.step:
            raise ValueError(f"{str(path)!r} records step {step}, but the folder is named for step {self.step}")
        return {
            "global_step": step,
            "num_processes": processes,
            "distributed_type": distributed_type,
            "run_id": run_id,
            "files": files,
        }

    def verify(self) -> dict:
        """:meth:`read_state`, then check every file against the recorded SHA-256; returns the state.

        Raises ``ValueError`` (:class:`~diffusers_scalelong.integrity.IntegrityError` for damaged content) naming
        the file.
        """
        state = self.read_state()
        if state["files"] is not None:
            verify_manifest(self.path, state["files"], exclude=(STATE_FILE,))
        return state

    def check_matches(self, model_folder: str, model: nn.Module) -> None:
        """Raise ``ValueError`` unless ``<model_folder>/config.json`` describes the same architecture as ``model``."""
        config_path = self.path / model_folder / "config.json"
        if not config_path.is_file():
            raise ValueError(
                f"checkpoint {str(self)!r} has no {model_folder}/config.json; it was not written by this script"
            )
        try:
            saved = json.loads(config_path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{str(config_path)!r} is not valid JSON: {error}") from error
        expected_class = type(model).__name__
        if saved.get("_class_name") != expected_class:
            raise ValueError(
                f"checkpoint {str(self)!r} holds a {saved.get('_class_name')} model but this run builds a "
                f"{expected_class}; resume with the same model options or use another output_dir"
            )
        saved, current = architecture_config(saved), architecture_config(json.loads(json.dumps(dict(model.config))))
        differing = sorted(key for key in set(saved) | set(current) if saved.get(key) != current.get(key))
        if differing:
            details = ", ".join(
                f"{key}: checkpoint {saved.get(key)!r} vs now {current.get(key)!r}" for key in differing[:5]
            )
            raise ValueError(f"checkpoint {str(self)!r} was trained with a different model ({details})")

    @staticmethod
    def save_models(module: nn.Module, folder: str | os.PathLike) -> None:
        """Write the trained module's diffusers models into ``folder`` (an EDM2 preconditioner in its own layout)."""
        if isinstance(module, EDMPreconditioner):
            module.save_pretrained(folder)
        else:
            module.save_pretrained(os.path.join(folder, "unet"))

    @staticmethod
    def load_models(module: nn.Module, folder: str | os.PathLike) -> None:
        """Load the weights :meth:`save_models` wrote back into ``module`` in place (safetensors only)."""
        if isinstance(module, EDMPreconditioner):
            module.load_weights(folder)
            return
        path = os.path.join(folder, "unet")
        if not os.path.isdir(path):
            raise ValueError(f"checkpoint {str(folder)!r} has no unet/ folder")
        module.load_state_dict(type(module).from_pretrained(path, low_cpu_mem_usage=False).state_dict())

    @classmethod
    def save(
        cls,
        accelerator,
        output_dir: str | os.PathLike,
        step: int,
        total_limit: int | None,
        run_id: str | None = None,
        distributed_type: str = "ddp",
    ) -> "Checkpoint":
        """``accelerator.save_state`` into ``checkpoint-<step>`` atomically, then rotate old checkpoints.

        Every process writes its own state into one temporary folder (a fixed name all processes agree on; the
        output folder's lock keeps other runs out); the main process adds ``training_state.json`` (with ``run_id``
        and the SHA-256 of every file), swaps the folder into place (``atomic.replace_path``: one of the same step is
        replaced whole) and only then deletes the oldest checkpoints.
        """
        output_dir = Path(output_dir)
        final = cls.at(output_dir, step)
        tmp = output_dir / f".checkpoint-{step}.tmp"
        if accelerator.is_main_process and tmp.exists():
            shutil.rmtree(tmp)
        accelerator.wait_for_everyone()
        try:
            accelerator.save_state(str(tmp))
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                state = {
                    "global_step": step,
                    "num_processes": accelerator.num_processes,
                    "distributed_type": distributed_type,
                    "run_id": run_id,
                    "files": folder_manifest(tmp, exclude=(STATE_FILE,)),
                }
                atomic_write_text(tmp / STATE_FILE, json.dumps(state, indent=1))
                replace_path(tmp, final.path)  # a checkpoint of the same step (a re-run step) is replaced, never lost
        except (OSError, RuntimeError) as error:  # a full disk, a quota: the half-written folder goes
            shutil.rmtree(tmp, ignore_errors=True)
            if not _is_write_failure(error):
                raise
            reason = error.strerror if isinstance(error, OSError) and error.strerror else "the disk refused the write"
            raise CheckpointWriteError(
                f"{final.path.name} could not be written ({reason}); the earlier checkpoints are intact: free space "
                "and resume with --resume_from_checkpoint latest"
            ) from error
        if accelerator.is_main_process:
            cls.rotate(output_dir, total_limit)
        accelerator.wait_for_everyone()
        return final
