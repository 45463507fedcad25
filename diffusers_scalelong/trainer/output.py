"""A run's output folder: checked writable before any work, the final pipeline swapped in atomically, and an
optional upload to the Hub."""

import os
import shutil
import tempfile
from pathlib import Path


def ensure_writable_dir(path: str | os.PathLike, option: str = "--output_dir") -> Path:
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

    Each entry is swapped in with ``os.replace``; names in ``last`` (e.g. ``model_index.json``) are moved after all
    others so that a reader never sees an index that points at half-written components.
    """
    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    names = sorted(os.listdir(source), key=lambda name: (name in last, name))
    for name in names:
        destination = target / name
        old = None
        if destination.is_dir() and not destination.is_symlink():
            old = target / f".{name}.old-{os.getpid()}"
            os.replace(destination, old)
        os.replace(source / name, destination)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def save_pipeline_atomic(pipeline, output_dir: str | os.PathLike) -> Path:
    """``pipeline.save_pretrained`` into a temporary folder, then swap its entries into ``output_dir``.

    ``model_index.json`` is moved last, so a reader never finds an index whose components are half written.
    """
    output_dir = Path(output_dir)
    tmp = Path(tempfile.mkdtemp(dir=output_dir, prefix=".pipeline-"))
    try:
        pipeline.save_pretrained(tmp)
        replace_folder_contents(tmp, output_dir, last=("model_index.json",))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output_dir


def push_run_to_hub(pipeline, output_dir: str | os.PathLike, repo_id: str, private: bool = False) -> str:
    """Upload the final pipeline (Hub-native layout with model card) and the run's post-hoc EMA snapshots.

    Returns the pipeline commit URL. Credentials and endpoint come from the environment (``HF_TOKEN``,
    ``HF_ENDPOINT``), as for every ``huggingface_hub`` call.
    """
    from ..hub import push_snapshots
    from ..pipelines import push_pipeline_to_hub

    url = push_pipeline_to_hub(pipeline, repo_id, private=private or None)
    snapshots = Path(output_dir) / "ema_snapshots"
    if snapshots.is_dir() and any(snapshots.glob("*.safetensors")):
        push_snapshots(snapshots, repo_id)
    return url
