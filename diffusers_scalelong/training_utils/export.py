"""The end of a run: the pipeline folder written atomically, and an optional upload to the Hub."""

import os
import shutil
import tempfile
from pathlib import Path

from .io import replace_folder_contents


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
