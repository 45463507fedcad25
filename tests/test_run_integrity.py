"""Run identity and content checksums on real training-script runs: a second run never mixes into an output folder,
damaged checkpoints and snapshots are found by their checksums, and records are checked against their files."""

import json
import shutil
import struct

import pytest
import torch
from _training_scripts import TINY_UNET, TRAIN_UNCONDITIONAL, load_script_module, run_script, tensors_equal
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from diffusers_scalelong.ema import PowerFunctionEMA, list_snapshots, save_reconstructed_models
from diffusers_scalelong.ema.cli import main as reconstruct_main
from diffusers_scalelong.ema.reconstruct import read_reconstruction_record
from diffusers_scalelong.integrity import IntegrityError, save_safetensors
from diffusers_scalelong.trainer import Checkpoint
from diffusers_scalelong.trainer.run_identity import LOCK_FILE

RUN = [*TINY_UNET, "--diagnostics_every", 0, "--checkpointing_steps", 4, "--ema_sigma_rels", 0.05, 0.10]
RUN += ["--snapshot_every", 2]
UNET_WEIGHTS = "unet/diffusion_pytorch_model.safetensors"


def _train(output, *extra):
    """A real training run in its own process."""
    return run_script(TRAIN_UNCONDITIONAL, ["--output_dir", output, *RUN, *extra])


def _refused(main, argv, capsys) -> str:
    """Call a script's or CLI's ``main`` in-process, expect the clean exit of bad input (status 2); its stderr."""
    with pytest.raises(SystemExit) as stop:
        main([str(arg) for arg in argv])
    assert stop.value.code == 2
    return capsys.readouterr().err


def _train_refused(output, capsys, *extra) -> str:
    main = load_script_module(TRAIN_UNCONDITIONAL).main
    return _refused(main, ["--output_dir", output, *RUN, *extra], capsys)


def _tree(folder):
    """``{relative path: bytes}`` of every file, but the lock file (each run that takes the lock records itself)."""
    files = (path for path in folder.rglob("*") if path.is_file() and path.name != LOCK_FILE)
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in files}


def _run_ids(output):
    """``{file or folder name: run id}`` of the checkpoints and snapshots in a training output folder."""
    ids = {checkpoint.path.name: checkpoint.read_state()["run_id"] for checkpoint in Checkpoint.find_all(output)}
    ids.update({info.path.name: info.run_id for info in list_snapshots(output / "ema_snapshots")})
    return ids


def _largest_tensor(path):
    """``(file offset, dtype, byte length)`` of the largest tensor in a safetensors file, from its header."""
    data = path.read_bytes()
    (header_length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_length])
    header.pop("__metadata__", None)
    entry = max(header.values(), key=lambda e: e["data_offsets"][1] - e["data_offsets"][0])
    start, end = entry["data_offsets"]
    return 8 + header_length + start, entry["dtype"], end - start


def _flip_byte(path):
    offset, _, length = _largest_tensor(path)
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _write_nan(path):
    offset, dtype, _ = _largest_tensor(path)
    assert dtype == "F32", dtype
    data = bytearray(path.read_bytes())
    data[offset : offset + 4] = struct.pack("<f", float("nan"))
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """8 steps: checkpoints 4 and 8, snapshots every 2 steps."""
    output = tmp_path_factory.mktemp("first") / "out"
    _train(output, "--seed", 3, "--max_train_steps", 8)
    return output


@pytest.fixture(scope="module")
def second_run(first_run, tmp_path_factory):
    """A second fresh run into a copy of the first run's folder with --overwrite_output_dir, 4 steps."""
    output = tmp_path_factory.mktemp("second") / "out"
    shutil.copytree(first_run, output)
    _train(output, "--seed", 4, "--max_train_steps", 4, "--overwrite_output_dir")
    return output


def test_a_run_records_one_run_id_everywhere(first_run):
    ids = _run_ids(first_run)
    assert len(ids) == 2 + 8  # checkpoints 4 and 8, two profiles at steps 2, 4, 6, 8
    (run_id,) = set(ids.values())
    assert len(run_id) == 32 and int(run_id, 16) >= 0
    for checkpoint in Checkpoint.find_all(first_run):
        assert checkpoint.verify()["run_id"] == run_id  # every recorded file checks out


def test_a_fresh_run_refuses_another_runs_folder_and_changes_nothing(first_run, tmp_path, capsys):
    output = tmp_path / "out"
    shutil.copytree(first_run, output)
    before = _tree(output)
    message = _train_refused(output, capsys, "--seed", 4, "--max_train_steps", 4)
    run_id = _run_ids(first_run)["checkpoint-4"]
    for expected in ("already holds another training run", "checkpoint-4", run_id, "--overwrite_output_dir"):
        assert expected in message
    assert _tree(output) == before


def test_overwrite_output_dir_replaces_the_earlier_run(first_run, second_run):
    ids = _run_ids(second_run)
    assert sorted(ids) == [
        "checkpoint-4",
        *(f"phema-{step:010d}-{sigma_rel}.safetensors" for step in (2, 4) for sigma_rel in ("0.050", "0.100")),
    ]
    (new_id,) = set(ids.values())
    assert new_id != _run_ids(first_run)["checkpoint-4"]
    assert not list(second_run.glob(".set-aside-*"))  # deleted once the new run wrote checkpoint-4


def test_reconstruction_refuses_snapshots_of_two_runs(first_run, second_run, tmp_path, capsys):
    mixed = tmp_path / "snapshots"
    shutil.copytree(second_run / "ema_snapshots", mixed)
    for step in (6, 8):  # what a second run without the refusal would have left of the first one
        shutil.copy(first_run / "ema_snapshots" / f"phema-{step:010d}-0.100.safetensors", mixed)
    message = _refused(reconstruct_main, [mixed, "--sigma_rel", 0.08, "--output_dir", tmp_path / "recon"], capsys)
    assert "different training runs" in message and "phema-0000000006-0.100.safetensors" in message
    for run in (first_run, second_run):
        assert _run_ids(run)["checkpoint-4"] in message
    assert not (tmp_path / "recon").exists()


def test_resume_refuses_a_folder_that_mixes_runs(first_run, second_run, tmp_path, capsys):
    mixed = tmp_path / "out"
    shutil.copytree(second_run, mixed)
    shutil.copytree(first_run / "checkpoint-8", mixed / "checkpoint-8")  # the first run's newest checkpoint
    message = _train_refused(mixed, capsys, "--max_train_steps", 12, "--resume_from_checkpoint", "latest")
    assert "mixes two training runs" in message
    for run in (first_run, second_run):
        assert _run_ids(run)["checkpoint-4"] in message


def test_damaged_checkpoint_weights_are_named_and_latest_falls_back(first_run, tmp_path, capsys):
    output = tmp_path / "out"
    shutil.copytree(first_run, output)
    _flip_byte(output / "checkpoint-8" / UNET_WEIGHTS)

    message = _train_refused(output, capsys, "--seed", 3, "--resume_from_checkpoint", "checkpoint-8")
    assert f"checkpoint-8/{UNET_WEIGHTS} is damaged" in message

    latest = _train(output, "--seed", 3, "--max_train_steps", 8, "--resume_from_checkpoint", "latest")
    log = latest.stdout + latest.stderr
    assert "skipping damaged checkpoint" in log and f"checkpoint-8/{UNET_WEIGHTS} is damaged" in log
    assert "resuming from" in log and f"Resuming from {output / 'checkpoint-4'}" in log
    # the run continued from step 4 of the same run and rewrote checkpoint 8 exactly as the first time
    assert Checkpoint.at(output, 8).verify()["run_id"] == _run_ids(first_run)["checkpoint-8"]
    tensors_equal(first_run / "checkpoint-8" / UNET_WEIGHTS, output / "checkpoint-8" / UNET_WEIGHTS)
    for info in list_snapshots(first_run / "ema_snapshots"):
        tensors_equal(info.path, output / "ema_snapshots" / info.path.name)


def test_checkpoint_records_are_checked_against_their_folders(first_run, tmp_path):
    output = tmp_path / "out"
    shutil.copytree(first_run, output)
    (output / "checkpoint-8").rename(output / "checkpoint-12")  # the record says 8
    (output / "checkpoint-4" / "optimizer.bin").unlink()
    with pytest.raises(ValueError) as error:
        Checkpoint.resolve("latest", output)
    message = str(error.value)
    assert "every checkpoint" in message and "records step 8, but the folder is named for step 12" in message
    assert "checkpoint-4/optimizer.bin is missing" in message

    shutil.copytree(first_run / "checkpoint-4", output / "checkpoint-4", dirs_exist_ok=True)
    (output / "checkpoint-4" / "notes.txt").write_text("not written by the checkpoint")
    with pytest.raises(IntegrityError, match="checkpoint-4/notes.txt is not in the folder's recorded file list"):
        Checkpoint.at(output, 4).verify()


def test_damaged_snapshots_fail_the_reconstruction_by_name(first_run, tmp_path, capsys):
    for damage, name in (
        (_flip_byte, "phema-0000000006-0.050.safetensors"),
        (_write_nan, "phema-0000000004-0.100.safetensors"),
    ):
        snapshots = tmp_path / damage.__name__
        shutil.copytree(first_run / "ema_snapshots", snapshots)
        damage(snapshots / name)
        argv = [snapshots, "--sigma_rel", 0.08, "--output_dir", tmp_path / "recon"]
        message = _refused(reconstruct_main, argv, capsys)
        assert f"{name} is damaged" in message and "records" in message
        assert not (tmp_path / "recon").exists()


def test_snapshot_file_names_are_checked_against_their_headers(first_run, tmp_path):
    snapshots = tmp_path / "snapshots"
    shutil.copytree(first_run / "ema_snapshots", snapshots)
    (snapshots / "phema-0000000006-0.050.safetensors").rename(snapshots / "phema-0000000010-0.050.safetensors")
    with pytest.raises(ValueError, match="named 'phema-0000000010-0.050.safetensors' but its header records time 6"):
        list_snapshots(snapshots)
    (snapshots / "phema-0000000010-0.050.safetensors").rename(snapshots / "phema-6-0.05.safetensors")
    with pytest.raises(ValueError, match="phema-6-0.05.safetensors is not named like a snapshot"):
        list_snapshots(snapshots)


def test_non_finite_averages_and_reconstructions_are_never_saved(first_run, tmp_path):
    model = nn.Linear(3, 2)
    ema = PowerFunctionEMA(model, sigma_rels=(0.1,))
    with torch.no_grad():
        model.weight[0, 1] = float("inf")
    ema.update(model, 1)
    with pytest.raises(ValueError, match="tensor 'weight' holds 1 NaN or infinite values"):
        ema.save_snapshots(str(tmp_path / "snapshots"), 1)
    assert list((tmp_path / "snapshots").glob("*")) == []

    # a snapshot holding a NaN under a matching checksum (not written by this library) passes the checksum, but
    # the reconstruction is checked finite before it is saved
    snapshots = tmp_path / "nan-snapshots"
    shutil.copytree(first_run / "ema_snapshots", snapshots)
    info = list_snapshots(snapshots)[-1]
    tensors = load_file(info.path)
    key = max(tensors, key=lambda name: tensors[name].numel())
    tensors[key].view(-1)[0] = float("nan")
    with safe_open(str(info.path), "pt") as handle:
        record = json.loads(handle.metadata()["phema"])
    record.pop("content_sha256")
    save_safetensors(tensors, info.path, "phema", record)
    with pytest.raises(ValueError, match=f"tensor '{key}' holds 1 NaN or infinite values"):
        save_reconstructed_models(snapshots, tmp_path / "recon", [0.08])
    assert not (tmp_path / "recon").exists()


def test_reconstructed_folders_record_and_verify_their_files(first_run, tmp_path):
    (folder,) = save_reconstructed_models(first_run / "ema_snapshots", tmp_path / "recon", [0.08])
    record = read_reconstruction_record(folder)
    assert set(record["files"]) == {path.name for path in folder.iterdir()} - {"phema.json"}
    assert {"config.json", "diffusion_pytorch_model.safetensors"} <= set(record["files"])
    assert record["run_id"] == _run_ids(first_run)["checkpoint-4"]
    _flip_byte(folder / "diffusion_pytorch_model.safetensors")
    with pytest.raises(IntegrityError, match="diffusion_pytorch_model.safetensors is damaged"):
        read_reconstruction_record(folder)


def test_resuming_without_the_post_hoc_ema_is_refused_not_dropped(first_run, tmp_path, capsys):
    """A run that tracked post-hoc EMA profiles, resumed without ema_sigma_rels, would lose them without a word."""
    output = tmp_path / "out"
    shutil.copytree(first_run, output)
    before = _tree(output)
    argv = [*TINY_UNET, "--diagnostics_every", 0, "--checkpointing_steps", 4]  # RUN without the post-hoc EMA
    main = load_script_module(TRAIN_UNCONDITIONAL).main
    message = _refused(
        main, ["--output_dir", output, *argv, "--max_train_steps", 12, "--resume_from_checkpoint", "latest"], capsys
    )
    assert "tracks a post-hoc EMA (posthoc_ema.safetensors); resume it with the same --ema_sigma_rels" in message
    assert _tree(output) == before


def test_a_checkpoint_the_disk_cannot_hold_is_one_line_and_leaves_no_half_written_folder(tmp_path):
    """A file-size limit (``RLIMIT_FSIZE``) makes every write past 1 MB fail as a full disk does (Python ignores
    SIGXFSZ, so the write raises): the model files (0.65 MB) fit, the optimiser state (1.3 MB) does not."""
    import resource
    import subprocess
    import sys

    from _training_scripts import ROOT, script_env

    limit = 1 << 20
    output = tmp_path / "out"
    argv = [*TINY_UNET, "--diagnostics_every", 0, "--checkpointing_steps", 2, "--max_train_steps", 4]
    result = subprocess.run(
        [sys.executable, str(TRAIN_UNCONDITIONAL), "--output_dir", str(output), *map(str, argv)],
        capture_output=True, text=True, env=script_env(), cwd=ROOT, timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
    assert "checkpoint-2 could not be written" in line and "resume_from_checkpoint latest" in line
    assert not list(output.glob("checkpoint-*")) and not list(output.glob(".checkpoint-*"))
