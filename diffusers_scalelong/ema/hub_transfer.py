"""Post-hoc EMA through the Hugging Face Hub: share snapshot sets and reconstructed models.

Repository layout written by :func:`push_snapshots` (``path_in_repo`` defaults to ``"phema"``)::

    phema/phema-0000001000-0.050.safetensors    snapshot files, unchanged (see ``diffusers_scalelong.ema.snapshots``)
    phema/phema-0000001000-0.100.safetensors
    phema/phema-index.json                       the metadata of every snapshot in the folder, in one small file
    phema/README.md                              model card: tracked sigma_rel values, times, how to reconstruct

Why an index file: a reconstruction needs the time stamp and ``sigma_rel`` of every snapshot before it can choose
which ones to download. Reading them from the safetensors headers costs one HTTP range request per snapshot, and a
server that ignores ``Range`` (olah's local mirrors do) then sends whole files. The index answers in one request.
It is only a cache of the headers: snapshot files that the index does not list (pushed by other means) are read
through their headers with :meth:`huggingface_hub.HfApi.parse_safetensors_file_metadata` (a range request), and
every downloaded file's own header is checked against the index before it is used (every field, the run id and the
content checksum included; a disagreement is an error naming both values). An index entry whose file is missing
from the repository, or whose name disagrees with its time and sigma_rel, is an error too. Pushing verifies each
local snapshot's content checksum first and refuses to mix the snapshots of two training runs in one folder.

:func:`pull_snapshots` downloads only the snapshots a reconstruction at ``target_time`` needs (those with
``0 < time <= target_time``; by default the newest time) through the Hub cache. Interrupted pulls resume at two
levels: a transfer cut mid-file is retried by ``huggingface_hub`` with a ``Range`` request for the missing bytes,
and a pull that was stopped (killed, Ctrl-C) fetches only the snapshots not yet complete in the cache when run
again (``huggingface_hub`` 2.x downloads each file to a per-process temporary file and drops it if the process
dies, so the partial file itself is not reused across processes).
:func:`reconstruct_from_hub` pulls and calls :func:`diffusers_scalelong.ema.reconstruct_ema` on exactly those files.
:func:`push_reconstruction` uploads a reconstructed diffusers model folder with a model card recording its
``sigma_rel``.

Only regular files inside the folder a caller names are uploaded: the files to send are checked before anything is
read or sent, and a symbolic link (even one pointing inside; for a model folder anywhere under it), a device,
socket or pipe is refused with a ``ValueError`` naming it. Pulled snapshots get every header check of
``read_snapshot_info`` (the header's model built on the ``meta`` device and compared with the file's tensors)
before they are returned, and index entries must carry the ``gamma`` of their ``sigma_rel``.

All functions take ``endpoint`` and ``token`` (``None``: the ``huggingface_hub`` defaults, ``HF_ENDPOINT`` / saved
login); an endpoint that cannot be reached raises ``diffusers_scalelong.hub.HubAccessError`` naming it.
"""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi, ModelCard, ModelCardData, snapshot_download

from ..hub.access import reports_unreachable_hub
from ..hub.cards import build_card, markdown_table
from ..integrity import load_verified
from .profiles import sigma_rel_to_gamma
from .reconstruct import PROVENANCE_FILENAME, read_reconstruction_record, select_for_target
from .snapshots import (
    FILENAME_PATTERN,
    METADATA_KEY,
    SnapshotInfo,
    check_filename_matches,
    list_snapshots,
    parse_snapshot_metadata,
    read_snapshot_info,
)

INDEX_FILENAME = "phema-index.json"
INDEX_FORMAT = "diffusers_scalelong.phema-index"
INDEX_FORMAT_VERSION = 1
DEFAULT_PATH_IN_REPO = "phema"
TAGS = ["diffusers-scalelong", "post-hoc-ema", "edm2"]


@dataclass(frozen=True)
class RemoteSnapshot:
    """A snapshot file in a Hub repo, described by its metadata (from the index or its safetensors header)."""

    filename: str
    time: int
    time_unit: str
    sigma_rel: float
    gamma: float
    dtype: str
    model_class: str | None
    model_config: dict[str, Any] | None
    run_id: str | None = None
    content_sha256: str | None = None


_REMOTE_FIELDS = (
    "time",
    "time_unit",
    "sigma_rel",
    "gamma",
    "dtype",
    "model_class",
    "model_config",
    "run_id",
    "content_sha256",
)


# ----------------------------------------------------------------------------------------------------------------
# Push
# ----------------------------------------------------------------------------------------------------------------
@reports_unreachable_hub
def push_snapshots(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    path_in_repo: str = DEFAULT_PATH_IN_REPO,
    private: bool | None = None,
    commit_message: str | None = None,
    revision: str | None = None,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> CommitInfo:
    """Upload every snapshot in ``folder`` (plus the index and a model card) to ``repo_id`` in one commit.

    The repo is created if missing. Snapshots already in the repo stay listed in the index, so pushing a training
    run's folder again later adds the new snapshots (unchanged files are not uploaded twice).
    """
    local = list_snapshots(folder)
    if not local:
        raise ValueError(f"no snapshot files (phema-*.safetensors) in {folder}: nothing to push")
    links = [info.path for info in local if info.path.is_symlink()]
    if links:  # nothing but the folder's own files is sent
        raise ValueError(
            f"folder {folder}: {links[0].name} is a symbolic link (to {os.readlink(links[0])}); only regular files "
            "inside the folder are uploaded, replace it with a copy"
        )
    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    prefix = _clean_prefix(path_in_repo)
    head = api.repo_info(repo_id, revision=revision).sha
    with tempfile.TemporaryDirectory() as cache_dir:  # the old index is read once, not kept
        has_index = api.file_exists(repo_id, f"{prefix}{INDEX_FILENAME}", revision=head)
        old = _read_index(api, repo_id, head, prefix, cache_dir) if has_index else []
    entries = {entry.filename: entry for entry in old}
    for info in local:
        load_verified(info.path, METADATA_KEY)  # never publish damaged tensor data
        entries[info.path.name] = _entry_from_info(info)
    ordered = sorted(entries.values(), key=lambda entry: (entry.time, entry.sigma_rel))
    _check_one_run(ordered, f"{repo_id}/{prefix}")
    operations = [CommitOperationAdd(f"{prefix}{info.path.name}", str(info.path)) for info in local]
    operations.append(CommitOperationAdd(f"{prefix}{INDEX_FILENAME}", _index_bytes(ordered)))
    operations.append(CommitOperationAdd(f"{prefix}README.md", str(_snapshot_card(ordered, repo_id, prefix)).encode()))
    times = sorted({info.time for info in local})
    message = commit_message or f"Add {len(local)} post-hoc EMA snapshots (time {times[0]}..{times[-1]})"
    # parent_commit: a concurrent push in between makes this commit fail instead of dropping its index entries
    return api.create_commit(repo_id, operations, commit_message=message, revision=revision, parent_commit=head)


@reports_unreachable_hub
def push_reconstruction(
    model_folder: str | os.PathLike,
    repo_id: str,
    *,
    sigma_rel: float | None = None,
    source_repo: str | None = None,
    path_in_repo: str = "",
    private: bool | None = None,
    commit_message: str | None = None,
    revision: str | None = None,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> CommitInfo:
    """Upload a reconstructed diffusers model folder with a model card recording its ``sigma_rel``.

    ``sigma_rel``, time and source snapshots come from the folder's ``phema.json`` (written by
    ``save_reconstructed_models`` / ``reconstruct_from_hub(output_dir=...)``); pass ``sigma_rel`` for a folder
    without it. ``path_in_repo`` places the model in a subfolder (``from_pretrained(repo_id, subfolder=...)``);
    the card is written beside the model's ``config.json``.
    """
    model_folder = Path(model_folder)
    if not model_folder.is_dir():
        raise ValueError(f"model_folder {model_folder} has no config.json: expected a diffusers model folder")
    files = _regular_files(model_folder, "model_folder")  # before anything is read or uploaded
    config_path = model_folder / "config.json"
    if "config.json" not in files:
        raise ValueError(f"model_folder {model_folder} has no config.json: expected a diffusers model folder")
    record = _read_provenance(model_folder, sigma_rel)
    class_name = json.loads(config_path.read_text()).get("_class_name", "ModelMixin")
    card = _reconstruction_card(repo_id, class_name, record, source_repo, path_in_repo)
    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    prefix = _clean_prefix(path_in_repo)
    operations = [
        CommitOperationAdd(f"{prefix}{name}", str(model_folder / name)) for name in files if name != "README.md"
    ]
    operations.append(CommitOperationAdd(f"{prefix}README.md", str(card).encode()))
    message = commit_message or f"Add {class_name} reconstructed with post-hoc EMA sigma_rel={record['sigma_rel']:g}"
    return api.create_commit(repo_id, operations, commit_message=message, revision=revision)


def _read_provenance(model_folder: Path, sigma_rel: float | None) -> dict[str, Any]:
    """The folder's ``phema.json`` record, or a minimal one built from ``sigma_rel``."""
    path = model_folder / PROVENANCE_FILENAME
    if not path.is_file():
        if sigma_rel is None:
            raise ValueError(f"{model_folder} has no {PROVENANCE_FILENAME}: pass sigma_rel to record in the model card")
        return {"sigma_rel": float(sigma_rel), "gamma": sigma_rel_to_gamma(float(sigma_rel))}
    record = read_reconstruction_record(model_folder)
    try:
        recorded = float(record["sigma_rel"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path} is not a valid reconstruction record: {error!r}") from None
    if sigma_rel is not None and abs(float(sigma_rel) - recorded) > 1e-12:
        raise ValueError(f"sigma_rel={sigma_rel} contradicts {path}, which records sigma_rel={recorded}")
    return {**record, "gamma": sigma_rel_to_gamma(recorded)}


# ----------------------------------------------------------------------------------------------------------------
# Pull
# ----------------------------------------------------------------------------------------------------------------
@reports_unreachable_hub
def list_remote_snapshots(
    repo_id: str,
    *,
    path_in_repo: str = DEFAULT_PATH_IN_REPO,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> list[RemoteSnapshot]:
    """Metadata of every snapshot in the repo, sorted by (time, sigma_rel), without downloading any snapshot.

    One download of the index; one header read per snapshot the index does not list.
    """
    api = HfApi(endpoint=endpoint, token=token)
    commit = api.repo_info(repo_id, revision=revision).sha
    return _list_at_commit(api, repo_id, commit, _clean_prefix(path_in_repo), cache_dir)


@reports_unreachable_hub
def pull_snapshots(
    repo_id: str,
    *,
    target_time: int | None = None,
    path_in_repo: str = DEFAULT_PATH_IN_REPO,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> list[SnapshotInfo]:
    """Download only the snapshots a reconstruction at ``target_time`` needs; return their local headers.

    The result (``SnapshotInfo`` with local ``path``) can be passed to ``reconstruct_ema`` as it is. Files go
    through the Hub cache (``cache_dir``), so repeated pulls reuse them and an interrupted pull resumes. Every
    file's header is checked against the metadata it was chosen by.
    """
    api = HfApi(endpoint=endpoint, token=token)
    commit = api.repo_info(repo_id, revision=revision).sha
    prefix = _clean_prefix(path_in_repo)
    _, chosen = select_for_target(_list_at_commit(api, repo_id, commit, prefix, cache_dir), target_time)
    root = snapshot_download(
        repo_id,
        revision=commit,
        allow_patterns=[f"{prefix}{snapshot.filename}" for snapshot in chosen],
        cache_dir=cache_dir,
        endpoint=endpoint,
        token=token,
    )
    infos = []
    for snapshot in chosen:
        info = read_snapshot_info(Path(root) / f"{prefix}{snapshot.filename}")
        header = _entry_from_info(info)
        for name in _REMOTE_FIELDS:
            if getattr(header, name) != getattr(snapshot, name):
                raise ValueError(
                    f"{repo_id}: {prefix}{snapshot.filename} records {name}={getattr(header, name)!r}, but the index "
                    f"says {name}={getattr(snapshot, name)!r}; push the snapshots again"
                )
        infos.append(info)
    return infos


@reports_unreachable_hub
def reconstruct_from_hub(
    repo_id: str,
    target_sigma_rels: Sequence[float],
    target_time: int | None = None,
    *,
    output_dir: str | os.PathLike | None = None,
    path_in_repo: str = DEFAULT_PATH_IN_REPO,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    endpoint: str | None = None,
    token: str | bool | None = None,
    **reconstruct_kwargs: Any,
) -> list[dict[str, Any]] | list[Path]:
    """Pull the snapshots needed at ``target_time`` and reconstruct each target ``sigma_rel`` from them.

    Without ``output_dir``: the ``state_dict``s from :func:`~diffusers_scalelong.ema.reconstruct_ema`. With it:
    model folders written by :func:`~diffusers_scalelong.ema.save_reconstructed_models` (ready for
    :func:`push_reconstruction`). ``reconstruct_kwargs`` (``dtype``, ``accumulate_dtype``, ``progress``,
    ``allow_inexact``, ...) are passed on.
    """
    from .reconstruct import reconstruct_ema, save_reconstructed_models

    snapshots = pull_snapshots(
        repo_id,
        target_time=target_time,
        path_in_repo=path_in_repo,
        revision=revision,
        cache_dir=cache_dir,
        endpoint=endpoint,
        token=token,
    )
    if output_dir is None:
        return reconstruct_ema(snapshots, target_sigma_rels, target_time, **reconstruct_kwargs)
    return save_reconstructed_models(snapshots, output_dir, target_sigma_rels, target_time, **reconstruct_kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------
def _regular_files(folder: Path | str | os.PathLike, name: str) -> list[str]:
    """Relative POSIX paths of the regular files under ``folder``, sorted; ``ValueError`` naming the first symbolic
    link or special file anywhere under it (``name``: the caller's parameter), so that an upload cannot send a file
    from outside the folder."""
    folder = Path(folder)
    if folder.is_symlink():
        folder = folder.resolve()  # the folder the caller named may itself be a link; what lies under it may not
    found = []
    for root, dirs, files in os.walk(folder, followlinks=False):
        for entry in sorted(dirs + files):
            path = Path(root) / entry
            mode = os.lstat(path).st_mode
            relative = path.relative_to(folder).as_posix()
            if stat.S_ISLNK(mode):
                raise ValueError(
                    f"{name} {folder}: {relative} is a symbolic link (to {os.readlink(path)}); only regular files "
                    "inside the folder are uploaded, replace it with a copy"
                )
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise ValueError(f"{name} {folder}: {relative} is not a regular file; only regular files are uploaded")
            if stat.S_ISREG(mode):
                found.append(relative)
    return sorted(found)


def _clean_prefix(path_in_repo: str) -> str:
    path = path_in_repo.strip("/")
    if ".." in path.split("/"):
        raise ValueError(f"path_in_repo must not contain '..', got {path_in_repo!r}")
    return f"{path}/" if path else ""


def _entry_from_info(info) -> RemoteSnapshot:
    return RemoteSnapshot(
        filename=info.path.name,
        time=info.time,
        time_unit=info.time_unit,
        sigma_rel=info.sigma_rel,
        gamma=info.gamma,
        dtype=info.dtype,
        model_class=info.model_class,
        model_config=info.model_config,
        run_id=info.run_id,
        content_sha256=info.content_sha256,
    )


def _entry_from_header(filename: str, header: dict[str, str], where: str) -> RemoteSnapshot:
    meta = parse_snapshot_metadata(header, where)
    return RemoteSnapshot(filename=filename, **{name: meta[name] for name in _REMOTE_FIELDS})


def _index_bytes(entries: Sequence[RemoteSnapshot]) -> bytes:
    index = {
        "format": INDEX_FORMAT,
        "format_version": INDEX_FORMAT_VERSION,
        "snapshots": [asdict(entry) for entry in entries],
    }
    return (json.dumps(index, indent=1) + "\n").encode()


def _read_index(
    api: HfApi, repo_id: str, revision: str | None, prefix: str, cache_dir: str | os.PathLike | None
) -> list[RemoteSnapshot]:
    """The snapshots listed in the repo's index file (which must exist)."""
    path = api.hf_hub_download(repo_id, f"{prefix}{INDEX_FILENAME}", revision=revision, cache_dir=cache_dir)
    where = f"{repo_id}/{prefix}{INDEX_FILENAME}"
    try:
        index = json.loads(Path(path).read_text())
        if index.get("format") != INDEX_FORMAT or int(index["format_version"]) > INDEX_FORMAT_VERSION:
            raise ValueError(f"unsupported format {index.get('format')!r} version {index.get('format_version')!r}")
        entries = [RemoteSnapshot(**entry) for entry in index["snapshots"]]
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{where} is not a valid snapshot index: {error}") from None
    for entry in entries:
        check_filename_matches(entry.filename, entry.time, entry.sigma_rel, entry.filename, f"the index {where}")
        try:
            gamma = sigma_rel_to_gamma(entry.sigma_rel)
        except ValueError as error:
            raise ValueError(f"{where} lists {entry.filename} with {error}") from None
        if not math.isclose(entry.gamma, gamma, rel_tol=1e-9):  # float64 round-off of the same root, as in headers
            raise ValueError(
                f"{where} lists {entry.filename} with gamma={entry.gamma!r}, but sigma_rel={entry.sigma_rel!r} has "
                f"gamma={gamma!r}; push the snapshots again"
            )
    return entries


def _check_one_run(entries: Sequence[RemoteSnapshot], where: str) -> None:
    """Raise ``ValueError`` naming two files and their run ids when ``entries`` come from different runs."""
    for entry in entries:
        if entry.run_id != entries[0].run_id:
            raise ValueError(
                f"{where} would mix two training runs: {entries[0].filename} (run {entries[0].run_id or 'unnamed'}) "
                f"and {entry.filename} (run {entry.run_id or 'unnamed'}); push each run to its own path_in_repo"
            )


def _list_at_commit(
    api: HfApi, repo_id: str, commit: str, prefix: str, cache_dir: str | os.PathLike | None
) -> list[RemoteSnapshot]:
    repo_files = api.list_repo_files(repo_id, revision=commit)
    files = [
        name.removeprefix(prefix)
        for name in repo_files
        if name.startswith(prefix) and FILENAME_PATTERN.match(name.removeprefix(prefix))
    ]
    if not files:
        raise ValueError(
            f"{repo_id}@{commit[:12]} has no post-hoc EMA snapshots (phema-*.safetensors) under "
            f"'{prefix or '/'}'; push them with diffusers_scalelong.ema.hub_transfer.push_snapshots"
        )
    has_index = f"{prefix}{INDEX_FILENAME}" in repo_files
    indexed = (
        {entry.filename: entry for entry in _read_index(api, repo_id, commit, prefix, cache_dir)} if has_index else {}
    )
    stale = sorted(set(indexed) - set(files))
    if stale:
        raise ValueError(
            f"{repo_id}@{commit[:12]}: {prefix}{INDEX_FILENAME} lists {prefix}{stale[0]}, which the repository does "
            f"not hold ({len(stale)} such entries); push the snapshots again"
        )
    snapshots = []
    for name in files:
        if name not in indexed:  # pushed without the index: read the safetensors header (HTTP range request)
            header = api.parse_safetensors_file_metadata(repo_id, f"{prefix}{name}", revision=commit).metadata
            indexed[name] = _entry_from_header(name, header, f"{repo_id}/{prefix}{name}")
        snapshots.append(indexed[name])
    return sorted(snapshots, key=lambda entry: (entry.time, entry.sigma_rel))


def _snapshot_card(entries: Sequence[RemoteSnapshot], repo_id: str, prefix: str) -> ModelCard:
    sigma_rels = sorted({entry.sigma_rel for entry in entries})
    times = sorted({entry.time for entry in entries})
    data = ModelCardData(tags=TAGS, phema_sigma_rels=sigma_rels, phema_times=[times[0], times[-1]])
    summary = (
        f"{len(entries)} power-function EMA snapshots of {entries[-1].model_class or 'the model'} (EDM2, arXiv "
        f"2312.02696), tracked with sigma_rel {', '.join(str(s) for s in sigma_rels)} at {len(times)} times "
        f"({times[0]} to {times[-1]} {entries[-1].time_unit}). Any EMA length in between can be reconstructed after "
        "training; only the snapshots up to the chosen time are downloaded."
    )
    load_code = (
        "from diffusers_scalelong.ema import reconstruct_from_hub\n\n"
        f'models = reconstruct_from_hub("{repo_id}", target_sigma_rels=[0.08], path_in_repo="{prefix.rstrip("/")}")'
    )
    rows = [(f"`{e.filename}`", e.time, e.sigma_rel, f"{e.gamma:.4f}", e.dtype) for e in entries]
    table = markdown_table(("file", "time", "sigma_rel", "gamma", "dtype"), rows)
    return build_card(data, "Post-hoc EMA snapshots", summary, load_code, [("Snapshots", table)])


def _reconstruction_card(
    repo_id: str, class_name: str, record: dict[str, Any], source_repo: str | None, path_in_repo: str
) -> ModelCard:
    import diffusers

    extra = {
        "ema_time": record.get("time"),
        "ema_num_snapshots": len(record["snapshots"]) if "snapshots" in record else None,
        "ema_source": source_repo,
    }
    data = ModelCardData(
        library_name="diffusers",
        tags=TAGS,
        ema_sigma_rel=record["sigma_rel"],
        ema_gamma=round(record["gamma"], 6),
        **{key: value for key, value in extra.items() if value is not None},
    )
    summary = "Weights reconstructed with post-hoc EMA (EDM2, arXiv 2312.02696)"
    if source_repo:
        summary += f" from the snapshots in `{source_repo}`"
    if "time" in record:
        summary += f" at time {record['time']} {record['time_unit']}"
    summary += (
        f": the power-function average with relative width sigma_rel = {record['sigma_rel']} "
        f"(exponent gamma = {record['gamma']:.4f})."
    )
    if "snapshots" in record:
        summary += (
            f" It combines {len(record['snapshots'])} snapshots; the reconstructed averaging profile differs from the "
            f"exact one by {record['relative_profile_error']:.2e} (relative L2)."
        )
    if hasattr(diffusers, class_name):
        import_lines = f"from diffusers import {class_name}"
    else:
        import_lines = (
            "import diffusers_scalelong  # registers the package's classes with diffusers\n"
            f"from diffusers_scalelong.models import {class_name}"
        )
    subfolder = path_in_repo.strip("/")
    subfolder_arg = f', subfolder="{subfolder}"' if subfolder else ""
    load_code = f'{import_lines}\n\nmodel = {class_name}.from_pretrained("{repo_id}"{subfolder_arg})'
    title = f"{class_name} with post-hoc EMA sigma_rel = {record['sigma_rel']}"
    return build_card(data, title, summary, load_code)
