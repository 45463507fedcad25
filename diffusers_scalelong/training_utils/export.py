"""The end of a run: the pipeline folder written atomically, and an optional upload to the Hub."""

import os
import shutil
import tempfile
from pathlib import Path

from .io import replace_folder_contents

PIPELINE_IGNORE_PATTERNS = ["checkpoint-*", ".checkpoint-*", "logs/*", "samples/*", ".*"]


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


def push_folder_to_hub(folder: str | os.PathLike, repo_id: str, private: bool = False) -> str:
    """Upload the pipeline and EMA snapshots of ``folder`` (not checkpoints, logs or sample grids) to ``repo_id``."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True)
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        ignore_patterns=PIPELINE_IGNORE_PATTERNS,
        commit_message="Upload trained pipeline",
    )
    return commit.commit_url
