"""A run's output folder: checked writable before any work, the final pipeline swapped in atomically, and an
optional upload to the Hub."""

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..atomic import clean_stale_temporaries, replace_path, staging_folder
from ..sources import is_hub_repo
from .run_identity import SAMPLES_FOLDER, SNAPSHOT_FOLDER

PIPELINE_TEMPORARIES = ("pipeline", "*.old")  # the staging folder and the components moved aside


def ensure_writable_dir(path: str | os.PathLike, option: str = "output_dir") -> Path:
    """Create ``path`` if needed and prove it is writable by writing and removing a temporary file.

    Raises ``ValueError`` naming ``option`` when the folder cannot be created or written.
    """
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as error:
        raise ValueError(f"{option} {str(folder)!r} is not a writable folder: {error.strerror or error}") from error
    return folder


def replace_folder_contents(source: str | os.PathLike, target: str | os.PathLike, last: tuple[str, ...] = ()) -> None:
    """Move every entry of ``source`` into ``target``, replacing entries of the same name.

    Each entry is swapped in with ``atomic.replace_path`` (a kill leaves the old entry or the new one, never
    neither); names in ``last`` (e.g. ``model_index.json``) are moved after all others so that a reader never sees
    an index that points at half-written components.
    """
    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for name in sorted(os.listdir(source), key=lambda name: (name in last, name)):
        replace_path(source / name, target / name)


def save_pipeline_atomic(
    pipeline, output_dir: str | os.PathLike, write_extras: Callable[[Path], None] | None = None
) -> Path:
    """``pipeline.save_pretrained`` (and ``write_extras(folder)``) into a temporary folder, then swap its entries into
    ``output_dir``.

    ``model_index.json`` is moved last, so a reader never finds an index whose components are half written. The
    leftovers of an earlier save that was killed are put right first (see ``atomic.clean_stale_temporaries``).
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    clean_stale_temporaries(output_dir, PIPELINE_TEMPORARIES)
    tmp = staging_folder(output_dir, "pipeline")
    try:
        pipeline.save_pretrained(tmp)
        if write_extras is not None:
            write_extras(tmp)
        replace_folder_contents(tmp, output_dir, last=("model_index.json",))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output_dir


def clean_interrupted_writes(output_dir: str | os.PathLike) -> list[Path]:
    """Put right what a killed run left in its output folder: the final pipeline's temporaries, and half-written
    snapshot files and sample grids; each is named in a warning. Returns the entries handled."""
    output_dir = Path(output_dir)
    handled = clean_stale_temporaries(output_dir, (*PIPELINE_TEMPORARIES, "checkpoint-*"))
    handled += clean_stale_temporaries(output_dir / SNAPSHOT_FOLDER, ("phema-*.safetensors",))
    handled += clean_stale_temporaries(output_dir / SAMPLES_FOLDER, ("*.png",))
    return handled


def push_run_to_hub(
    pipeline,
    output_dir: str | os.PathLike,
    repo_id: str,
    private: bool = False,
    *,
    ema: bool = False,
    base_model: str | None = None,
    dataset: str | None = None,
) -> str:
    """Upload the final pipeline (Hub-native layout with model card) and the run's post-hoc EMA snapshots.

    The card says whether the weights are an EMA (``ema``: the classic EMA of ``use_ema``) or the raw trained ones,
    and names ``base_model`` and ``dataset`` where they are Hub repos. Returns the pipeline commit URL. Credentials
    and endpoint come from the environment (``HF_TOKEN``, ``HF_ENDPOINT``), as for every ``huggingface_hub`` call.
    """
    from ..ema.hub_transfer import push_snapshots
    from ..hub import push_pipeline_to_hub

    url = push_pipeline_to_hub(
        pipeline,
        repo_id,
        private=private or None,
        ema=ema,
        base_model=base_model if base_model and is_hub_repo(base_model) else None,
        dataset=dataset if dataset and is_hub_repo(dataset) else None,
    )
    snapshots = Path(output_dir) / SNAPSHOT_FOLDER
    if snapshots.is_dir() and any(snapshots.glob("*.safetensors")):
        push_snapshots(snapshots, repo_id)
    return url
