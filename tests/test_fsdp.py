"""FSDP2 (``fully_shard``, gloo, 2 CPU processes) trains EDM2 like one process with the same global batch."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _training_scripts import ROOT, script_env
from safetensors import safe_open
from safetensors.torch import load_file

from diffusers_scalelong.ema import list_snapshots

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

WORKER = Path(__file__).resolve().parent / "_fsdp_worker.py"


def run_worker(tmp_path: Path, *extra: str) -> dict:
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(WORKER), str(report), *extra]
    result = subprocess.run(command, capture_output=True, text=True, env=script_env(), cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(report.read_text())


@pytest.mark.slow  # five torchrun launches of 2 processes: about a minute each on a busy 2-core machine
def test_sharded_training_and_ema_snapshots_equal_single_process(tmp_path):
    report = run_worker(tmp_path / "projected")
    print(json.dumps(report, indent=1))
    assert report["world_size"] == 2 and report["num_tensors"] == 60
    # float32, 3 Adam steps: the two runs sum the batch's gradients in a different order (2 + 2 vs 4 samples) and
    # the sharded forward projects already-unit rows once more; Adam's g / sqrt(v) magnifies those last-bit
    # differences for near-zero gradients to ~1e-5, against parameter changes of order 1.
    assert report["max_abs_change_from_init"] > 0.5
    assert report["max_abs_difference"] < 1e-3
    assert report["sharded_snapshots"] == ["phema-0000000003-0.050.safetensors", "phema-0000000003-0.100.safetensors"]
    assert max(report["snapshot_max_abs_difference"].values()) < 1e-3  # same reason
    # The averages live on the local shards: about half the model per process (the 0-d gains are replicated).
    assert report["ema_local_numel"] < 0.6 * report["model_numel"]

    # Interrupted after 2 of 3 steps (checkpoint: model, optimizer and EMA state gathered into full tensors) and
    # resumed in new processes, sharded again: the same snapshots as the uninterrupted sharded run, bit for bit.
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    run_worker(tmp_path / "first_part", "--stop_after", "2", "--checkpoint", str(checkpoint))
    uninterrupted = list_snapshots(tmp_path / "projected" / "sharded")
    with safe_open(checkpoint / "ema_state.safetensors", "pt") as f:  # full tensors, as an unsharded run writes
        assert f.get_slice("averages.0.conv_out.weight").get_shape() == list(uninterrupted[0].shapes["conv_out.weight"])
        run_id = json.loads(f.metadata()["state"])["run_id"]
    resumed = run_worker(tmp_path / "resumed", "--resume", str(checkpoint))
    assert resumed["sharded_snapshots"] == report["sharded_snapshots"]
    for before, after in zip(uninterrupted, list_snapshots(tmp_path / "resumed" / "sharded"), strict=True):
        assert after.run_id == run_id and after.time == before.time == 3  # the run id came with the EMA state
        expected, actual = load_file(before.path), load_file(after.path)
        assert expected.keys() == actual.keys()
        for key, tensor in expected.items():
            assert torch.equal(actual[key], tensor), (after.path.name, key)

    # Without projecting the stored shards, the in-forward projection lands in FSDP's discarded all-gathered copy.
    unprojected = run_worker(tmp_path / "unprojected", "--without_shard_projection")
    assert unprojected["max_abs_difference"] > 0.1

    # bfloat16 mixed precision (forward and backward in bf16 on float32 stored shards, float32 gradient reduction):
    # the shards stay float32 and the run follows the float32 one. bf16 rounds each value to 2^-8 relative; through
    # 3 Adam steps that moves the parameters by about 2% of their change (measured 0.021), so 0.1 bounds it with
    # room, while the float32 run's relative difference (~1e-7) shows that bf16 did take effect.
    bf16 = run_worker(tmp_path / "bf16", "--bf16")
    assert bf16["stored_dtypes"] == ["torch.float32"]
    assert report["relative_difference"] < 1e-4 < bf16["relative_difference"] < 0.1
